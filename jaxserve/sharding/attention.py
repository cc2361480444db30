"""Entry points that run a chunk's attention over an SP group from natural-order (unsharded) arrays.

They permute the chunk into the layout, place shards on the mesh, run the strategy inside `shard_map` and
restore natural order: what the model and the tests call. History KV is given per device, device-major:
[p * cap, kvh, d] where device i's shard is rows [i * cap, (i + 1) * cap), padding at NO_POSITION.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, Int

from jaxserve.pallas_kernels.dispatch import Implementation
from jaxserve.sharding import layouts
from jaxserve.sharding.mesh import SP
from jaxserve.sharding.ring import ring_attention
from jaxserve.sharding.ulysses import ulysses_attention

Strategy = Literal["ring", "ulysses"]


def sp_size(mesh: Mesh) -> int:
    return mesh.shape[SP]


@functools.partial(jax.jit, static_argnames=("mesh", "strategy", "layout", "implementation"))
def chunk_attention_sp(
    mesh: Mesh,
    q: Float[Array, "n h d"],
    k: Float[Array, "n kvh d"],
    v: Float[Array, "n kvh d"],
    q_pos: Int[Array, " n"],
    k_pos: Int[Array, " n"],
    hist_k: Float[Array, "pc kvh d"],
    hist_v: Float[Array, "pc kvh d"],
    hist_pos: Int[Array, " pc"],
    *,
    strategy: Strategy = "ring",
    layout: layouts.Layout = "zigzag",
    implementation: Implementation | None = None,
) -> Float[Array, "n h d"]:
    """implementation: the attention kernel's (pallas_kernels.dispatch); default the backend's choice."""
    p = sp_size(mesh)
    perm = layouts.permutation(q.shape[0], p, layout)
    local = functools.partial(
        ring_attention if strategy == "ring" else ulysses_attention, axis_size=p, implementation=implementation
    )

    def body(*args):
        out = local(*args)
        return out[0] if strategy == "ring" else out

    seq = P(SP)
    # check_vma=False: a Pallas kernel inside shard_map has no varying-axes rule (trace-time error otherwise)
    out = jax.shard_map(body, mesh=mesh, in_specs=(seq,) * 8, out_specs=seq, check_vma=False)(
        *(
            jax.lax.with_sharding_constraint(x, NamedSharding(mesh, seq))
            for x in (q[perm], k[perm], v[perm], q_pos[perm], k_pos[perm], hist_k, hist_v, hist_pos)
        )
    )
    return out[jnp.asarray(layouts.inverse(perm))]
