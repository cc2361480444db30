"""Attention of a flattened ragged batch (prefill chunks and decodes of many requests in one token axis) over
the paged KV cache: the pure-jnp reference the engine runs on CPU and a GPU kernel must match.

Queries are regrouped into tiles, each holding tokens of one request only: a decode is a tile of one token, a
prefill chunk is cut into tiles of `tile` tokens. A tile reads its request's pages key block by key block with
an online softmax, and the loop runs only as far as the longest context in the batch (a dynamic trip count), so
one compiled program serves every mix of lengths: shapes depend on the token and row buckets alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

_NEG = -1e30  # finite: a row that sees no key stays NaN-free


def tiled_paged_attention(
    q: Float[Array, "n tq h d"],
    q_pos: Int[Array, "n tq"],
    k_cache: Float[Array, "slots kvh d"],
    v_cache: Float[Array, "slots kvh d"],
    tables: Int[Array, "n w"],
    *,
    block_size: int,
    key_block: int,
) -> Float[Array, "n tq h d"]:
    """Each tile's queries over its own request's pages: key position j is visible to a query at position p
    when j <= p (p = -1 marks padding: it sees nothing and gets 0). `tables` rows are block tables whose width
    is a multiple of key_block / block_size; blocks past a request's length may hold anything (never visible).
    Softmax in float32 whatever the cache dtype."""
    n, tq, h, d = q.shape
    kvh = k_cache.shape[-2]
    g = h // kvh
    pages = key_block // block_size
    # [n, kvh, g*tq, d]: each KV head's query group and tokens as one matrix (row r is token r % tq)
    qg = (q.astype(jnp.float32) * d**-0.5).reshape(n, tq, kvh, g, d).transpose(0, 2, 3, 1, 4).reshape(n, kvh, g * tq, d)
    rows_pos = jnp.tile(q_pos, (1, g))[:, None, :, None]  # [n, 1, g*tq, 1]
    num_blocks = (jnp.max(q_pos) + key_block) // key_block  # key blocks any query can see (0 if all padding)
    offsets = jnp.arange(block_size, dtype=tables.dtype)

    def body(j, carry):
        m, l, acc = carry
        blk = jax.lax.dynamic_slice_in_dim(tables, j * pages, pages, axis=1)  # [n, pages]
        slots = (blk[:, :, None] * block_size + offsets).reshape(n, key_block)
        k = k_cache[slots].astype(jnp.float32).transpose(0, 2, 1, 3)  # [n, kvh, kb, d]
        v = v_cache[slots].astype(jnp.float32).transpose(0, 2, 1, 3)
        s = jnp.matmul(qg, k.swapaxes(-1, -2))  # [n, kvh, g*tq, kb]
        key_pos = j * key_block + jnp.arange(key_block)
        s = jnp.where(key_pos <= rows_pos, s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        scale = jnp.exp(m - m_new)
        return m_new, l * scale + p.sum(-1), acc * scale[..., None] + jnp.matmul(p, v)

    init = (jnp.full((n, kvh, g * tq), _NEG, jnp.float32), jnp.zeros((n, kvh, g * tq), jnp.float32),
            jnp.zeros((n, kvh, g * tq, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    visible = rows_pos[:, :, :, 0] >= 0
    out = jnp.where(visible[..., None], acc / jnp.maximum(l, 1e-30)[..., None], 0.0)
    return out.reshape(n, kvh, g, tq, d).transpose(0, 3, 1, 2, 4).reshape(n, tq, h, d).astype(q.dtype)


def ragged_paged_attention(
    q: Float[Array, "t h d"],
    positions: Int[Array, "t"],
    k_cache: Float[Array, "slots kvh d"],
    v_cache: Float[Array, "slots kvh d"],
    tables: Int[Array, "r w"],
    decode_token: Int[Array, "r"],
    tile_tokens: Int[Array, "nt tq"],
    tile_row: Int[Array, "nt"],
    *,
    block_size: int,
    key_block: int,
) -> Float[Array, "t h d"]:
    """Causal attention of every token of a flat batch over its request's pages.

    Row i of the batch owns block table tables[i]. decode_token[i] is the flat index of row i's token when row i
    is a decode, else t (no token); prefill tokens are grouped in tiles: tile_tokens[k] holds flat indices of
    tokens of row tile_row[k], t where padded. A token's K/V must already be in the cache. Tokens in no tile and
    no decode (batch padding) get 0.
    """
    t = q.shape[0]

    def attend(idx: Int[Array, "n tq"], rows: Int[Array, "n"]) -> Float[Array, "n tq h d"]:
        def run(_):
            pos = jnp.where(idx < t, jnp.take(positions, idx, mode="clip"), -1)
            return tiled_paged_attention(jnp.take(q, idx, axis=0, mode="clip"), pos, k_cache, v_cache,
                                         tables[rows], block_size=block_size, key_block=key_block)

        # a decode-only step skips the tiles entirely, and a prefill-only step the decode rows
        return jax.lax.cond(jnp.any(idx < t), run, lambda _: jnp.zeros((*idx.shape, *q.shape[1:]), q.dtype), None)

    out = jnp.zeros_like(q)
    tiles = attend(tile_tokens, tile_row)
    out = out.at[tile_tokens.reshape(-1)].set(tiles.reshape(-1, *q.shape[1:]), mode="drop")
    decodes = attend(decode_token[:, None], jnp.arange(tables.shape[0]))
    return out.at[decode_token].set(decodes[:, 0], mode="drop")
