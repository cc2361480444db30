"""Attention of a flattened ragged batch (prefill chunks and decodes of many requests in one token axis) over
the paged KV cache, the engine's attention: the tiles' attention is the Pallas kernel on GPU
(tiled_paged_attention.py) and its pure-jnp reference elsewhere (reference.tiled_paged_attention).

Queries are regrouped into tiles, each holding tokens of one request only: a decode is a tile of one token, a
prefill chunk is cut into tiles of `tile` tokens. A tile reads its request's pages key block by key block with
an online softmax, and the loop has a dynamic trip count (the reference: as far as the longest context in the
batch; the kernel: each tile's own), so one compiled program serves every mix of lengths: shapes depend on the
token and row buckets alone.

A step of decodes alone has no tiles (the engine's decode programs): only the decode rows run.

A block-table entry of -1 is a block held elsewhere (another device of a KV-parallel group): its keys are not
attended, and the returned log-sum-exp lets the group merge its partials exactly (sharding/lse.py). Such a device
passes the entries it holds first, with their positions (`page_pos`, from paged_attention.held_pages): its loops
then walk its own share of a context, not the whole.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxserve.pallas_kernels import dispatch


def ragged_paged_attention(
    q: Float[Array, "t h d"],
    positions: Int[Array, " t"],
    k_cache: Float[Array, "slots kvh d"],
    v_cache: Float[Array, "slots kvh d"],
    tables: Int[Array, "r w"],
    decode_token: Int[Array, " r"],
    tile_tokens: Int[Array, "nt tq"],
    tile_row: Int[Array, " nt"],
    *,
    block_size: int,
    key_block: int,
    window: int | None = None,
    page_pos: Int[Array, "r w"] | None = None,
    implementation: dispatch.Implementation | None = None,
) -> tuple[Float[Array, "t h d"], Float[Array, "t h"]]:
    """Causal attention of every token of a flat batch over its request's pages, and its log-sum-exp.

    Row i of the batch owns block table tables[i]. decode_token[i] is the flat index of row i's token when row i
    is a decode, else t (no token); prefill tokens are grouped in tiles: tile_tokens[k] holds flat indices of
    tokens of row tile_row[k], t where padded. A token's K/V must already be in the cache. Tokens in no tile and
    no decode (batch padding), or that see no key here, get 0 and a log-sum-exp of -inf. window: a sliding
    window's keys (reference.visible). page_pos: each table entry's first key position (None: entry c holds
    positions from c * block_size; see reference.tiled_paged_attention).
    """
    t, h = q.shape[:2]

    # Nothing branches on the device: padding (position -1) sees no key, and the attention runs no key block
    # for it. A decode program has no tiles at all (a static shape).
    def attend(idx: Int[Array, "n tq"], rows: Int[Array, " n"]):
        pos = jnp.where(idx < t, jnp.take(positions, idx, mode="clip"), -1)
        return dispatch.tiled_paged_attention(
            jnp.take(q, idx, axis=0, mode="clip"),
            pos,
            k_cache,
            v_cache,
            tables[rows],
            block_size=block_size,
            key_block=key_block,
            window=window,
            page_pos=None if page_pos is None else page_pos[rows],
            implementation=implementation,
        )

    out, lse = jnp.zeros_like(q), jnp.full((t, h), -jnp.inf, jnp.float32)
    if tile_tokens.shape[0]:
        tile_out, tile_lse = attend(tile_tokens, tile_row)
        flat = tile_tokens.reshape(-1)
        out = out.at[flat].set(tile_out.reshape(-1, *q.shape[1:]), mode="drop")
        lse = lse.at[flat].set(tile_lse.reshape(-1, h), mode="drop")
    dec_out, dec_lse = attend(decode_token[:, None], jnp.arange(tables.shape[0]))
    return out.at[decode_token].set(dec_out[:, 0], mode="drop"), lse.at[decode_token].set(dec_lse[:, 0], mode="drop")
