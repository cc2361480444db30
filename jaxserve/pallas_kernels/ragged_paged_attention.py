"""Attention of a flattened ragged batch (prefill chunks and decodes of many requests in one token axis) over
the paged KV cache: the pure-jnp reference the engine runs on CPU and a GPU kernel must match.

Queries are regrouped into tiles, each holding tokens of one request only: a decode is a tile of one token, a
prefill chunk is cut into tiles of `tile` tokens. A tile reads its request's pages key block by key block with
an online softmax, and the loop runs only as far as the longest context in the batch (a dynamic trip count), so
one compiled program serves every mix of lengths: shapes depend on the token and row buckets alone.

A block-table entry of -1 is a block held elsewhere (another device of a KV-parallel group): its keys are not
attended, and the returned log-sum-exp lets the group merge its partials exactly (sharding/lse.py).
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
) -> tuple[Float[Array, "n tq h d"], Float[Array, "n tq h"]]:
    """Each tile's queries over its own request's pages: key position j is visible to a query at position p
    when j <= p and its block entry is not -1 (p = -1 marks padding: it sees nothing). `tables` rows are block
    tables whose width is a multiple of key_block / block_size; blocks past a request's length may hold anything
    (never visible). Softmax in float32 whatever the cache dtype. Returns the output (0 where no key is visible)
    and its float32 log-sum-exp (-inf there)."""
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
        here = jnp.repeat(blk >= 0, block_size, axis=1)[:, None, None, :]  # [n, 1, 1, kb]
        slots = (jnp.maximum(blk, 0)[:, :, None] * block_size + offsets).reshape(n, key_block)
        k = k_cache[slots].astype(jnp.float32).transpose(0, 2, 1, 3)  # [n, kvh, kb, d]
        v = v_cache[slots].astype(jnp.float32).transpose(0, 2, 1, 3)
        s = jnp.matmul(qg, k.swapaxes(-1, -2))  # [n, kvh, g*tq, kb]
        key_pos = j * key_block + jnp.arange(key_block)
        seen = (key_pos <= rows_pos) & here
        s = jnp.where(seen, s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(seen, jnp.exp(s - m_new[..., None]), 0.0)  # a row with no key yet must not count masked ones
        scale = jnp.exp(m - m_new)
        return m_new, l * scale + p.sum(-1), acc * scale[..., None] + jnp.matmul(p, v)

    init = (jnp.full((n, kvh, g * tq), _NEG, jnp.float32), jnp.zeros((n, kvh, g * tq), jnp.float32),
            jnp.zeros((n, kvh, g * tq, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    seen = l > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    out = out.reshape(n, kvh, g, tq, d).transpose(0, 3, 1, 2, 4).reshape(n, tq, h, d)
    return out.astype(q.dtype), lse.reshape(n, kvh, g, tq).transpose(0, 3, 1, 2).reshape(n, tq, h)


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
) -> tuple[Float[Array, "t h d"], Float[Array, "t h"]]:
    """Causal attention of every token of a flat batch over its request's pages, and its log-sum-exp.

    Row i of the batch owns block table tables[i]. decode_token[i] is the flat index of row i's token when row i
    is a decode, else t (no token); prefill tokens are grouped in tiles: tile_tokens[k] holds flat indices of
    tokens of row tile_row[k], t where padded. A token's K/V must already be in the cache. Tokens in no tile and
    no decode (batch padding), or that see no key here, get 0 and a log-sum-exp of -inf.
    """
    t, h = q.shape[:2]

    def attend(idx: Int[Array, "n tq"], rows: Int[Array, "n"]):
        def run(_):
            pos = jnp.where(idx < t, jnp.take(positions, idx, mode="clip"), -1)
            return tiled_paged_attention(jnp.take(q, idx, axis=0, mode="clip"), pos, k_cache, v_cache,
                                         tables[rows], block_size=block_size, key_block=key_block)

        # a decode-only step skips the tiles entirely, and a prefill-only step the decode rows
        nothing = lambda _: (jnp.zeros((*idx.shape, *q.shape[1:]), q.dtype),  # noqa: E731
                             jnp.full((*idx.shape, h), -jnp.inf, jnp.float32))
        return jax.lax.cond(jnp.any(idx < t), run, nothing, None)

    out, lse = jnp.zeros_like(q), jnp.full((t, h), -jnp.inf, jnp.float32)
    tile_out, tile_lse = attend(tile_tokens, tile_row)
    flat = tile_tokens.reshape(-1)
    out = out.at[flat].set(tile_out.reshape(-1, *q.shape[1:]), mode="drop")
    lse = lse.at[flat].set(tile_lse.reshape(-1, h), mode="drop")
    dec_out, dec_lse = attend(decode_token[:, None], jnp.arange(tables.shape[0]))
    return out.at[decode_token].set(dec_out[:, 0], mode="drop"), lse.at[decode_token].set(dec_lse[:, 0], mode="drop")
