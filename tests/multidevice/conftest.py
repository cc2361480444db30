"""Tests that need 8 devices. tests/test_multidevice.py runs this folder in its own process with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (the flag must be set before JAX starts)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.pallas_kernels.reference import NO_POSITION


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    if len(devs) < 8:
        pytest.fail(f"need 8 devices, got {len(devs)}: run through tests/test_multidevice.py")
    return devs


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
