"""Ring attention for a prefill chunk over an SP group (call inside `shard_map` over the 'sp' axis).

Each device holds a shard of the chunk's queries and K/V (any layout: the shards carry their positions) and its
shard of the request's history KV. Two parts, merged by log-sum-exp:
- history: the (short) queries move, not the (long) history: the chunk's queries are all-gathered, every device
  attends them over its history shard, and the partials come back to their owners by a weighted
  reduce-scatter (the max trick keeps it exact);
- chunk: the chunk's K/V blocks travel around the ring with `ppermute`, each step's transfer overlapped with
  that step's attention.

`implementation` picks the attention kernel (pallas_kernels.dispatch); a `shard_map` around a Pallas call needs
`check_vma=False`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxserve.models.attention import AttentionMetadata
from jaxserve.pallas_kernels import dispatch as kernels
from jaxserve.sharding.lse import merge_scatter
from jaxserve.sharding.mesh import SP


def merge_two(o_a, lse_a, o_b, lse_b, implementation: kernels.Implementation | None = None):
    return kernels.merge_attention(jnp.stack([o_a, o_b]), jnp.stack([lse_a, lse_b]), implementation=implementation)


def history_attention(
    q, q_pos, hist_k, hist_v, hist_pos, *, axis_name: str = SP, implementation: kernels.Implementation | None = None
):
    """This device's queries over every device's history shard: (o [t, h, d], lse [t, h])."""
    o, lse = kernels.chunk_attention(
        jax.lax.all_gather(q, axis_name, tiled=True),
        hist_k,
        hist_v,
        jax.lax.all_gather(q_pos, axis_name, tiled=True),
        hist_pos,
        implementation=implementation,
    )
    return merge_scatter(o, lse, axis_name)


def stored_history_attention(
    q: Float[Array, "t h d"],
    q_pos: Int[Array, " t"],
    k_store: Float[Array, "layers cap kvh d"],
    v_store: Float[Array, "layers cap kvh d"],
    hist_pos: Int[Array, " cap"],
    layer: Int[Array, ""],
    blocks: Int[Array, ""],
    *,
    key_block: int,
    axis_name: str = SP,
    implementation: kernels.Implementation | None = None,
) -> tuple[Float[Array, "t h d"], Float[Array, "t h"]]:
    """history_attention over this device's first `blocks` key blocks of `layer` in a preallocated store: the
    trip count is a traced value, so one compiled program serves every history length (each device its own)."""
    qa = jax.lax.all_gather(q, axis_name, tiled=True)
    qa_pos = jax.lax.all_gather(q_pos, axis_name, tiled=True)

    def block(i, carry):
        ks, vs, ps = store_block(k_store, v_store, hist_pos, layer, i, key_block)
        o_b, lse_b = kernels.chunk_attention(qa, ks, vs, qa_pos, ps, implementation=implementation)
        return merge_two(*carry, o_b, lse_b, implementation)

    t, h = qa.shape[:2]
    empty = (jnp.zeros((t, h, q.shape[-1]), jnp.float32), jnp.full((t, h), -jnp.inf, jnp.float32))
    o, lse = jax.lax.fori_loop(0, blocks, block, empty)
    return merge_scatter(o, lse, axis_name)


def store_block(
    k_store: Float[Array, "layers cap kvh d"],
    v_store: Float[Array, "layers cap kvh d"],
    hist_pos: Int[Array, " cap"],
    layer: Int[Array, ""],
    i: Int[Array, ""],
    key_block: int,
) -> tuple[Float[Array, "kb kvh d"], Float[Array, "kb kvh d"], Int[Array, " kb"]]:
    """Key block i of `layer` in a store: its K, V and positions."""
    at = i * key_block
    kvh, d = k_store.shape[2:]
    ks, vs = (jax.lax.dynamic_slice(x, (layer, at, 0, 0), (1, key_block, kvh, d))[0] for x in (k_store, v_store))
    return ks, vs, jax.lax.dynamic_slice_in_dim(hist_pos, at, key_block)


def chunk_ring(
    o,
    lse,
    q,
    k,
    v,
    q_pos,
    k_pos,
    *,
    axis_size: int,
    axis_name: str = SP,
    implementation: kernels.Implementation | None = None,
):
    """Merge into (o, lse) this device's queries over the whole chunk's K/V, whose shards circulate the ring.

    One transfer per step, overlapped with that step's attention: K and V travel stacked as one buffer (the key
    positions are all-gathered once instead), and each step's send waits, through an optimization barrier, for
    the previous step's attention. Without the barrier XLA hoists the sends, which depend only on each other,
    ahead of the attention and runs most of them unoverlapped, holding every block at once
    (tools/ring_overlap.py checks the compiled schedule for GPUs)."""
    ring = [(i, (i + 1) % axis_size) for i in range(axis_size)]
    me = jax.lax.axis_index(axis_name)
    positions = jax.lax.all_gather(k_pos, axis_name)  # [axis_size, t]: row j holds device j's key positions
    kv = jnp.stack([k, v])
    for step in range(axis_size):
        if step:
            kv, o, lse = jax.lax.optimization_barrier((kv, o, lse))
        if step + 1 < axis_size:
            incoming = jax.lax.ppermute(kv, axis_name, ring)  # in flight while this block is computed
        held = positions[(me - step) % axis_size]  # the block here came from `step` devices back on the ring
        o_s, lse_s = kernels.chunk_attention(q, kv[0], kv[1], q_pos, held, implementation=implementation)
        o, lse = merge_two(o, lse, o_s, lse_s, implementation)
        if step + 1 < axis_size:
            kv = incoming
    return o, lse


def ring_attention(
    q: Float[Array, "t h d"],
    k: Float[Array, "t kvh d"],
    v: Float[Array, "t kvh d"],
    q_pos: Int[Array, " t"],
    k_pos: Int[Array, " t"],
    hist_k: Float[Array, "n kvh d"],
    hist_v: Float[Array, "n kvh d"],
    hist_pos: Int[Array, " n"],
    *,
    axis_size: int,
    axis_name: str = SP,
    implementation: kernels.Implementation | None = None,
) -> tuple[Float[Array, "t h d"], Float[Array, "t h"]]:
    """Local shard of the chunk's attention output (and log-sum-exp) over history + the whole chunk.

    Padding: queries at position -1, chunk keys and history entries at NO_POSITION.
    """
    o, lse = history_attention(q, q_pos, hist_k, hist_v, hist_pos, axis_name=axis_name, implementation=implementation)
    return chunk_ring(
        o, lse, q, k, v, q_pos, k_pos, axis_size=axis_size, axis_name=axis_name, implementation=implementation
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StoreMetadata(AttentionMetadata):
    """What a store backend (ring, SP-NTP or CSA) reads on one device of the group."""

    hist_pos: Int[Array, " cap"]
    """The store's row positions; NO_POSITION where empty."""
    k_pos: Int[Array, " t"]
    """This shard's key positions."""
    fill: Int[Array, ""]
    """The store row where this shard's K/V goes."""
    blocks: Int[Array, ""]
    """How many key blocks of the store hold history."""


@dataclasses.dataclass(frozen=True)
class StoreRingBackend:
    """The model's attention backend inside `shard_map` for a CDSP chunk: ring attention over the group, the
    request's history read from each device's preallocated store.

    caches = this device's (k_store, v_store), each [layers, cap, kvh, d]. Each layer attends, then writes the
    shard's K/V at rows [fill, fill + t) of its own slice (the store is donated: updated in place).
    """

    axis_size: int
    key_block: int
    axis_name: str = SP
    implementation: kernels.Implementation | None = None

    def __call__(self, q, k, v, positions, caches, layer, metadata: StoreMetadata):
        k_store, v_store = caches
        kw = dict(axis_name=self.axis_name, implementation=self.implementation)
        o, lse = stored_history_attention(
            q[0],
            positions[0],
            k_store,
            v_store,
            metadata.hist_pos,
            layer,
            metadata.blocks,
            key_block=self.key_block,
            **kw,
        )
        o, _ = chunk_ring(o, lse, q[0], k[0], v[0], positions[0], metadata.k_pos, axis_size=self.axis_size, **kw)
        return o[None].astype(q.dtype), write_store(caches, k, v, layer, metadata.fill)


def write_store(
    caches, k: Float[Array, "1 t kvh d"], v: Float[Array, "1 t kvh d"], layer: Int[Array, ""], fill: Int[Array, ""]
):
    """The store (k_store, v_store) with this shard's K/V of `layer` at rows [fill, fill + t)."""
    at = (layer, fill, 0, 0)
    return tuple(jax.lax.dynamic_update_slice(store, x.astype(store.dtype), at) for store, x in zip(caches, (k, v)))
