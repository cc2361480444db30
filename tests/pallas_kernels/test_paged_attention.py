"""Paged attention against a dense causal reference on random data: shapes, GQA, histories, uneven lengths."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels.paged_attention import paged_attention


def dense_reference(q, k, v, q_pos, kv_len, window=None):
    """Plain numpy softmax attention for one request: q [t, h, d], k/v [s, kvh, d] (float64); with a sliding
    window, query i sees keys q_pos[i] - window < j <= q_pos[i] only."""
    t, h, d = q.shape
    group = h // k.shape[1]
    out = np.zeros((t, h, d))
    for i in range(t):
        keys = min(q_pos[i] + 1, kv_len)
        first = 0 if window is None else max(0, q_pos[i] - window + 1)
        for j in range(h):
            s = k[first:keys, j // group] @ q[i, j] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[i, j] = (p / p.sum()) @ v[first:keys, j // group]
    return out


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("new_tokens, histories", [(1, [0, 5, 37]), (7, [0, 13, 20]), (16, [3, 0, 48])])
def test_paged_attention_matches_dense(heads, kv_heads, block_size, new_tokens, histories):
    rng = np.random.default_rng(heads * 1000 + block_size * 10 + new_tokens)
    d = 32
    b = len(histories)
    # Uneven valid lengths: each request uses a different number of its new-token rows.
    valid = [new_tokens - (i % 2) * (new_tokens // 2) for i in range(b)]
    kv_lens = [h + n for h, n in zip(histories, valid)]
    nblk = max(-(-n // block_size) for n in kv_lens) + 1
    num_blocks = b * nblk + 3
    perm = rng.permutation(np.arange(1, num_blocks))  # blocks scattered over the pool
    tables = perm[: b * nblk].reshape(b, nblk)
    k_cache = rng.standard_normal((num_blocks * block_size, kv_heads, d)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks * block_size, kv_heads, d)).astype(np.float32)
    q = rng.standard_normal((b, new_tokens, heads, d)).astype(np.float32)
    positions = np.array([[h + t for t in range(new_tokens)] for h in histories], np.int32)

    got = np.asarray(
        paged_attention(
            jnp.asarray(q),
            jnp.asarray(k_cache),
            jnp.asarray(v_cache),
            jnp.asarray(tables, jnp.int32),
            jnp.asarray(positions),
            jnp.asarray(kv_lens, jnp.int32),
            block_size=block_size,
        )
    )
    for i in range(b):
        slots = (tables[i][:, None] * block_size + np.arange(block_size)).reshape(-1)
        ref = dense_reference(
            q[i].astype(np.float64),
            k_cache[slots].astype(np.float64),
            v_cache[slots].astype(np.float64),
            positions[i],
            kv_lens[i],
        )
        np.testing.assert_allclose(got[i, : valid[i]], ref[: valid[i]], rtol=1e-5, atol=1e-5)
