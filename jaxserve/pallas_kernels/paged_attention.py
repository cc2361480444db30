"""Attention of new query tokens over a request's paged KV cache (pure-jnp reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def gather_pages(
    cache: Float[Array, "slots kvh d"], block_tables: Int[Array, "b nblk"], block_size: int
) -> Float[Array, "b s kvh d"]:
    """Rows of each request's blocks, in logical order: s = nblk * block_size key positions."""
    offsets = jnp.arange(block_size, dtype=block_tables.dtype)
    slots = (block_tables[:, :, None] * block_size + offsets).reshape(block_tables.shape[0], -1)
    return cache[slots]


def paged_attention(
    q: Float[Array, "b t h d"],
    k_cache: Float[Array, "slots kvh d"],
    v_cache: Float[Array, "slots kvh d"],
    block_tables: Int[Array, "b nblk"],
    q_positions: Int[Array, "b t"],
    kv_lens: Int[Array, "b"],
    *,
    block_size: int,
) -> Float[Array, "b t h d"]:
    """Causal GQA attention of q over key positions [0, kv_len) of each request's paged cache.

    Key position j (the j-th row of the gathered blocks) is visible to a query at position p when
    j <= p and j < kv_len. The softmax runs in float32 whatever the cache dtype.
    """
    b, t, h, d = q.shape
    kvh = k_cache.shape[-2]
    k = gather_pages(k_cache, block_tables, block_size)
    v = gather_pages(v_cache, block_tables, block_size)
    qg = q.reshape(b, t, kvh, h // kvh, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (d**-0.5)
    key_pos = jnp.arange(k.shape[1])
    visible = (key_pos[None, None, :] <= q_positions[:, :, None]) & (key_pos[None, None, :] < kv_lens[:, None, None])
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # A padded query row sees no key; its output is zeros instead of NaN.
    probs = jnp.where(visible[:, None, None].any(-1, keepdims=True), probs, 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)
