"""SP-TP attention (CSPS; call inside `shard_map` over the 'sp' axis): all-gather the sequence, attend with this
device's heads (tensor-parallel weights), reduce-scatter the output projection back to sequence shards.

The history KV is head-sharded for the whole sequence, as tensor parallelism keeps it.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxserve.pallas_kernels import dispatch as kernels
from jaxserve.sharding.mesh import SP

Rope = Callable[[Array, Array], Array]  # (x [t, heads, d], positions [t]) -> rotated x


def sp_tp_attention(
    x: Float[Array, "t e"],
    wq: Float[Array, "e hd"],
    wk: Float[Array, "e kd"],
    wv: Float[Array, "e kd"],
    wo: Float[Array, "hd e"],
    q_pos: Int[Array, " t"],
    hist_k: Float[Array, "n kvh d"],
    hist_v: Float[Array, "n kvh d"],
    hist_pos: Int[Array, " n"],
    *,
    head_dim: int,
    rope: Rope | None = None,
    axis_name: str = SP,
) -> tuple[Float[Array, "t e"], Float[Array, "T kvh d"], Float[Array, "T kvh d"]]:
    """Output for this device's sequence shard, and this device's heads' K/V of the whole chunk (to cache)."""
    x_all = jax.lax.all_gather(x, axis_name, tiled=True)
    pos = jax.lax.all_gather(q_pos, axis_name, tiled=True)
    t = x_all.shape[0]
    q = (x_all @ wq).reshape(t, -1, head_dim)
    k = (x_all @ wk).reshape(t, -1, head_dim)
    v = (x_all @ wv).reshape(t, -1, head_dim)
    if rope is not None:
        q, k = rope(q, pos), rope(k, pos)
    o, _ = kernels.chunk_attention(
        q, jnp.concatenate([hist_k, k]), jnp.concatenate([hist_v, v]), pos, jnp.concatenate([hist_pos, pos])
    )
    partial = o.reshape(t, -1).astype(x.dtype) @ wo
    return jax.lax.psum_scatter(partial, axis_name, scatter_dimension=0, tiled=True), k, v
