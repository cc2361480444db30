"""The sharding tests, most on 8 devices. tests/test_many_devices.py runs this folder in its own process with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (the flag must be set before JAX starts)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.models.config import LlamaConfig
from jaxserve.models.llama import init_params
from jaxserve.pallas_kernels.reference import NO_POSITION

# A small random Llama with GQA (6 heads over 2 KV heads) for the sharded model paths.
CFG = LlamaConfig(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=96,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=512,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    if len(devs) < 8:
        pytest.fail(f"need 8 devices, got {len(devs)}: run through tests/test_many_devices.py")
    return devs


def random_params(cfg: LlamaConfig) -> dict:
    """cfg's weights, all random: Flax's default init leaves norms at 1, so every weight is drawn (norm weights,
    stacked [layers, e] in the scanned layers or [e] for the final norm, at scale 1; matrices at 0.3)."""
    variables = init_params(cfg, jax.random.key(1))
    leaves, tree = jax.tree_util.tree_flatten_with_path(variables)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    return jax.tree.unflatten(
        tree,
        [
            jax.random.normal(k, x.shape) * (1.0 if path[-1].key == "weight" else 0.3)
            for k, (path, x) in zip(keys, leaves)
        ],
    )


@pytest.fixture(scope="session")
def params():
    return random_params(CFG)


def dense_attention(q, keys, values, q_pos, k_pos):
    """float64 numpy attention: each query over the keys with k_pos <= q_pos (GQA by head groups)."""
    q, keys, values = (np.asarray(x, np.float64) for x in (q, keys, values))
    t, h, d = q.shape
    g = h // keys.shape[1]
    out = np.zeros((t, h, d))
    for i in range(t):
        vis = np.asarray(k_pos) <= int(q_pos[i])
        if not vis.any():
            continue
        for j in range(h):
            s = keys[vis, j // g] @ q[i, j] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[i, j] = p @ values[vis, j // g] / p.sum()
    return out


def scatter_history(rng, hk, hv, p, cap):
    """Spread history tokens unevenly over p devices, device-major [p * cap], padding at NO_POSITION."""
    n = len(hk)
    K = np.zeros((p * cap,) + hk.shape[1:], np.float32)
    V = np.zeros_like(K)
    P = np.full(p * cap, NO_POSITION, np.int32)
    fill = [0] * p
    order = rng.permutation(n)  # any token may live on any device
    for j in order:
        i = int(rng.integers(0, p))
        while fill[i] == cap:
            i = (i + 1) % p
        K[i * cap + fill[i]], V[i * cap + fill[i]], P[i * cap + fill[i]] = hk[j], hv[j], j
        fill[i] += 1
    return K, V, P, fill
