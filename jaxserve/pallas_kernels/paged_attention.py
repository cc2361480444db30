"""Attention of new query tokens over a request's paged KV cache (pure-jnp reference)."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def page_slots(block_tables: Int[Array, "b nblk"], block_size: int) -> Int[Array, "b s"]:
    """Cache rows of each request's blocks, in logical order: s = nblk * block_size key positions."""
    offsets = jnp.arange(block_size, dtype=block_tables.dtype)
    return (block_tables[:, :, None] * block_size + offsets).reshape(block_tables.shape[0], -1)


def pages_in_order(tables: Int[Array, "b nblk"], block_size: int) -> Int[Array, "b nblk"]:
    """Each entry's first key position when a table lists a request's blocks in order (entry c from
    c * block_size): the page_pos of every table but a KV-parallel device's (held_pages)."""
    return jnp.broadcast_to(jnp.arange(tables.shape[1], dtype=jnp.int32) * block_size, tables.shape)


def held_pages(
    tables: Int[Array, "b nblk"], held: Bool[Array, "b nblk"], block_size: int, no_position: int
) -> tuple[Int[Array, "b nblk"], Int[Array, "b nblk"]]:
    """The entries of each block table that `held` marks, first and in order, the rest -1; and each entry's first
    key position (`no_position` for the rest): a KV-parallel device's own share of its tables, as
    reference.tiled_paged_attention reads them (page_pos)."""
    order = jnp.argsort(~held, axis=1, stable=True)
    mine = jnp.take_along_axis(held, order, axis=1)
    return (
        jnp.where(mine, jnp.take_along_axis(tables, order, axis=1), -1),
        jnp.where(mine, order * block_size, no_position).astype(jnp.int32),
    )


def walk_bounds(
    q_pos: Int[Array, "n t"], page_pos: Int[Array, "n w"], block_size: int, window: int | None
) -> tuple[Int[Array, " n"], Int[Array, " n"], Int[Array, " n"]]:
    """Per row of queries (q_pos -1 where padded), as counts of its table's leading entries (which hold increasing
    positions, page_pos): those wholly before its earliest query's window (0 without a window: where a walk over
    its keys starts), those wholly before its earliest query (every query sees their keys, the window aside), and
    those holding a key at or before its last query (where the walk ends). A row without a query ends at 0."""
    earliest = jnp.min(jnp.where(q_pos >= 0, q_pos, jnp.iinfo(jnp.int32).max), axis=1, keepdims=True)
    last = jnp.max(q_pos, axis=1, keepdims=True)

    def below(limit):  # the entries whose keys all lie below limit
        return jnp.sum(page_pos + block_size <= limit, axis=1).astype(jnp.int32)

    start = jnp.zeros(q_pos.shape[0], jnp.int32) if window is None else below(earliest - window + 1)
    return start, below(earliest), below(last + block_size)


def gather_pages(
    cache: Float[Array, "slots kvh d"], block_tables: Int[Array, "b nblk"], block_size: int
) -> Float[Array, "b s kvh d"]:
    return cache[page_slots(block_tables, block_size)]


def paged_attention(
    q: Float[Array, "b t h d"],
    k_cache: Float[Array, "slots kvh d"],
    v_cache: Float[Array, "slots kvh d"],
    block_tables: Int[Array, "b nblk"],
    q_positions: Int[Array, "b t"],
    kv_lens: Int[Array, " b"],
    *,
    block_size: int,
) -> Float[Array, "b t h d"]:
    """Causal GQA attention of q over key positions [0, kv_len) of each request's paged cache.

    Key position j (the j-th row of the gathered blocks) is visible to a query at position p when
    j <= p and j < kv_len. The softmax runs in float32 whatever the cache dtype. A query row that sees no key
    (batch padding) gets an arbitrary finite output.
    """
    b, t, h, d = q.shape
    kvh = k_cache.shape[-2]
    g = h // kvh
    k = gather_pages(k_cache, block_tables, block_size).transpose(0, 2, 1, 3)  # [b, kvh, s, d]
    v = gather_pages(v_cache, block_tables, block_size).transpose(0, 2, 1, 3)
    # Each KV head's query group and tokens form one [g*t, d] matrix: plain batched matmuls run fastest on XLA.
    qg = (q * d**-0.5).reshape(b, t, kvh, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kvh, g * t, d)
    scores = jnp.matmul(qg, k.swapaxes(-1, -2), preferred_element_type=jnp.float32)  # [b, kvh, g*t, s]
    q_pos = jnp.tile(q_positions, (1, g))[:, None, :, None]  # row r of a group is token r % t
    key_pos = jnp.arange(k.shape[2])
    visible = (key_pos <= q_pos) & (key_pos < kv_lens[:, None, None, None])
    # A finite mask keeps rows with no visible key (padding) NaN-free; their output is never read.
    scores = jnp.where(visible, scores, -1e30)
    p = jnp.exp(scores - scores.max(-1, keepdims=True))
    # Normalise after the second matmul: a pass over [g*t, d] instead of [g*t, s].
    out = jnp.matmul(p.astype(v.dtype), v, preferred_element_type=jnp.float32) / p.sum(-1, keepdims=True)
    return out.reshape(b, kvh, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)
