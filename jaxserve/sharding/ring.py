"""Ring attention for a prefill chunk over an SP group (call inside `shard_map` over the 'sp' axis).

Each device holds a shard of the chunk's queries and K/V (any layout: the shards carry their positions) and its
shard of the request's history KV. Two parts, merged by log-sum-exp:
- history: the (short) queries move, not the (long) history: the chunk's queries are all-gathered, every device
  attends them over its history shard, and the partials come back to their owners by a weighted
  reduce-scatter (the max trick keeps it exact);
- chunk: the chunk's K/V blocks travel around the ring with `ppermute`; the send of the next block is issued
  before the current block is computed so XLA can overlap the two.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxserve.pallas_kernels import dispatch as kernels
from jaxserve.sharding.lse import merge_scatter
from jaxserve.sharding.mesh import SP


def merge_two(o_a, lse_a, o_b, lse_b):
    return kernels.merge_attention(jnp.stack([o_a, o_b]), jnp.stack([lse_a, lse_b]))


def history_attention(q, q_pos, hist_k, hist_v, hist_pos, *, axis_name: str = SP):
    """This device's queries over every device's history shard: (o [t, h, d], lse [t, h])."""
    o, lse = kernels.chunk_attention(jax.lax.all_gather(q, axis_name, tiled=True), hist_k, hist_v,
                                     jax.lax.all_gather(q_pos, axis_name, tiled=True), hist_pos)
    return merge_scatter(o, lse, axis_name)


def ring_attention(
    q: Float[Array, "t h d"],
    k: Float[Array, "t kvh d"],
    v: Float[Array, "t kvh d"],
    q_pos: Int[Array, "t"],
    k_pos: Int[Array, "t"],
    hist_k: Float[Array, "n kvh d"],
    hist_v: Float[Array, "n kvh d"],
    hist_pos: Int[Array, "n"],
    *,
    axis_size: int,
    axis_name: str = SP,
) -> tuple[Float[Array, "t h d"], Float[Array, "t h"]]:
    """Local shard of the chunk's attention output (and log-sum-exp) over history + the whole chunk.

    Padding: queries at position -1, chunk keys and history entries at NO_POSITION.
    """
    o, lse = history_attention(q, q_pos, hist_k, hist_v, hist_pos, axis_name=axis_name)
    ring = [(i, (i + 1) % axis_size) for i in range(axis_size)]
    block = (k, v, k_pos)
    for step in range(axis_size):
        if step + 1 < axis_size:
            incoming = jax.lax.ppermute(block, axis_name, ring)  # in flight while this block is computed
        o_s, lse_s = kernels.chunk_attention(q, block[0], block[1], q_pos, block[2])
        o, lse = merge_two(o, lse, o_s, lse_s)
        if step + 1 < axis_size:
            block = incoming
    return o, lse


@dataclasses.dataclass(frozen=True)
class RingBackend:
    """The model's attention backend inside `shard_map`: one request's chunk shard, ring attention over the group.

    caches = this device's (hist_k, hist_v), each [layers, n_hist + t, kvh, d]: rows [0, n_hist) are the history,
    the last t rows are reserved for this chunk; ctx = (history positions [n_hist], this shard's key positions
    [t]). The backend attends over the history rows of `layer` and writes the shard's new K/V into its reserved
    rows, so the cache stays aligned with concat(history pos, key pos).
    """

    axis_size: int
    axis_name: str = SP

    def __call__(self, q, k, v, positions, caches, layer, ctx):
        hist_k, hist_v = caches
        hist_pos, k_pos = ctx
        n_hist = hist_pos.shape[0]
        layer_k = jax.lax.dynamic_index_in_dim(hist_k, layer, keepdims=False)[:n_hist]
        layer_v = jax.lax.dynamic_index_in_dim(hist_v, layer, keepdims=False)[:n_hist]
        o, _ = ring_attention(q[0], k[0], v[0], positions[0], k_pos, layer_k, layer_v, hist_pos,
                              axis_size=self.axis_size, axis_name=self.axis_name)
        at = (layer, n_hist, 0, 0)
        hist_k = jax.lax.dynamic_update_slice(hist_k, k.astype(hist_k.dtype), at)  # k: [1, t, kvh, d]
        hist_v = jax.lax.dynamic_update_slice(hist_v, v.astype(hist_v.dtype), at)
        return o[None].astype(q.dtype), (hist_k, hist_v)
