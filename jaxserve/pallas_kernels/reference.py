"""Pure-jnp references of the attention kernels: the semantics every kernel and sharded path is checked against.

Masks come from positions, so one function serves history + causal-within-chunk, any sequence layout
(contiguous / striped / zigzag shards carry their own positions) and padding: a padded key has position
NO_POSITION (never visible), a padded query has position -1 (sees nothing). A query that sees no key gets
output 0 and log-sum-exp -inf, which is what `merge_attention` expects of an empty shard.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxserve.pallas_kernels.paged_attention import page_slots

NO_POSITION = 2**30  # position of a padded key: larger than any query position


def chunk_attention(
    q: Float[Array, "t h d"],
    k: Float[Array, "s kvh d"],
    v: Float[Array, "s kvh d"],
    q_pos: Int[Array, "t"],
    k_pos: Int[Array, "s"],
) -> tuple[Float[Array, "t h d"], Float[Array, "t h"]]:
    """Softmax attention of each query over the keys with k_pos <= q_pos (GQA: h a multiple of kvh).

    Returns the float32 output and the float32 log-sum-exp of the scaled scores, per query and head.
    """
    t, h, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(t, kvh, h // kvh, d).astype(jnp.float32) * d**-0.5
    scores = jnp.einsum("tkgd,skd->kgts", qg, k.astype(jnp.float32))
    visible = k_pos[None, :] <= q_pos[:, None]
    scores = jnp.where(visible, scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)  # [kvh, g, t]; -inf where nothing is visible
    probs = jnp.where(visible, jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    out = jnp.einsum("kgts,skd->tkgd", probs, v.astype(jnp.float32))
    return out.reshape(t, h, d), lse.reshape(h, t).T


def merge_attention(
    o: Float[Array, "n ... d"], lse: Float[Array, "n ..."]
) -> tuple[Float[Array, "... d"], Float[Array, "..."]]:
    """Combine n partial results over disjoint key sets into the exact softmax result (-inf partials drop out)."""
    m = jnp.max(lse, axis=0)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m_safe)  # 0 for empty partials
    total = jnp.sum(w, axis=0)
    out = jnp.sum(o * w[..., None], axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
    return out, jnp.where(total > 0, m_safe + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)


def paged_decode_attention(
    q: Float[Array, "b h d"],
    k_cache: Float[Array, "slots kvh d"],
    v_cache: Float[Array, "slots kvh d"],
    block_tables: Int[Array, "b nblk"],
    kv_lens: Int[Array, "b"],
    *,
    block_size: int,
    num_splits: int,
) -> tuple[Float[Array, "b n h d"], Float[Array, "b n h"]]:
    """One new query per request over its first kv_lens cached tokens, split into num_splits KV ranges.

    Split i covers block-table columns [i * nblk / n, (i + 1) * nblk / n); merge the partials with
    `merge_attention` over axis 1 (after moving it first) for the full result.
    """
    b, nblk = block_tables.shape
    if nblk % num_splits:
        raise ValueError(f"block table width {nblk} is not a multiple of num_splits {num_splits}")
    per = nblk // num_splits
    slots = page_slots(block_tables, block_size).reshape(b, num_splits, per * block_size)
    pos = jnp.arange(nblk * block_size).reshape(num_splits, per * block_size)

    def one(qb, slot_b, kv_len):
        def split(slot_s, pos_s):
            k_pos = jnp.where(pos_s < kv_len, pos_s, NO_POSITION)
            o, lse = chunk_attention(qb[None], k_cache[slot_s], v_cache[slot_s], jnp.array([kv_len - 1]), k_pos)
            return o[0], lse[0]

        return jax.vmap(split)(slot_b, pos)

    return jax.vmap(one)(q, slots, kv_lens)
