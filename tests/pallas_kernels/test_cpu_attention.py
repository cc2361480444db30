"""The C++ decode attention (pallas_kernels/cpu_attention.cc) against reference.tiled_paged_attention on random
pages: GQA groups of 1, 3 and 8, windows, padding rows, short requests, pages out of order and a KV-parallel
device's held pages. dispatch takes it for float32 decode tiles on a CPU unless an implementation is named, and
the reference where it cannot be built."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import cpu_attention, dispatch, paged_attention, reference


def _case(rng, rows: int, kvh: int, g: int, d: int, block: int, width: int):
    pages = rows * width + 3
    k, v = (jnp.asarray(rng.standard_normal((pages * block, kvh, d)), jnp.float32) for _ in range(2))
    tables = np.stack([rng.permutation(pages)[:width] for _ in range(rows)]).astype(np.int32)
    lengths = rng.integers(1, width * block + 1, rows)
    tables[0, (lengths[0] + block - 1) // block :] = -1  # a request shorter than its table
    q_pos = (lengths - 1).astype(np.int32)[:, None]
    q_pos[-1] = -1  # padding
    q = jnp.asarray(3 * rng.standard_normal((rows, 1, kvh * g, d)), jnp.float32)  # scores spread over several units
    return q, jnp.asarray(q_pos), k, v, jnp.asarray(tables)


def _close(got, want) -> None:
    """Outputs (values of magnitude ~1, float32 sums over at most a few hundred keys) and log-sum-exps alike;
    rows that see nothing: 0 and -inf on both sides."""
    for a, b in zip(got, want):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape
        np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b))
        finite = np.isfinite(b)
        np.testing.assert_allclose(a[finite], b[finite], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("g", [1, 3, 8])
@pytest.mark.parametrize("window", [None, 5, 37])
@pytest.mark.parametrize(("block", "d"), [(4, 16), (16, 64)])
def test_decode_rows_equal_the_reference(g, window, block, d):
    rng = np.random.default_rng(g * 100 + (window or 0) + block)
    args = _case(rng, rows=5, kvh=2, g=g, d=d, block=block, width=6)
    want = reference.tiled_paged_attention(*args, block_size=block, key_block=block, window=window)
    _close(cpu_attention.decode_attention(*args, block_size=block, window=window), want)


@pytest.mark.parametrize("window", [None, 9])
def test_a_kv_parallel_devices_held_pages_equal_the_reference(window):
    """held_pages lists a device's own entries first with their first positions (the rest -1, at no position)."""
    rng = np.random.default_rng(7)
    q, q_pos, k, v, tables = _case(rng, rows=4, kvh=3, g=2, d=32, block=8, width=8)
    held = jnp.asarray(rng.random(tables.shape) < 0.5)
    held_tables, page_pos = paged_attention.held_pages(tables, held, 8, 1 << 30)
    args = (q, q_pos, k, v, held_tables)
    want = reference.tiled_paged_attention(*args, block_size=8, key_block=8, window=window, page_pos=page_pos)
    _close(cpu_attention.decode_attention(*args, block_size=8, window=window, page_pos=page_pos), want)


def test_dispatch_takes_it_for_float32_decode_tiles_on_a_cpu(monkeypatch):
    """implementation=None: the C++ kernel for float32 one-token tiles; a named implementation, a longer tile or
    another cache dtype: as before."""
    rng = np.random.default_rng(3)
    args = _case(rng, rows=3, kvh=2, g=2, d=16, block=4, width=4)
    calls = []
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda *a, **kw: calls.append(1) or (None, None))
    dispatch.tiled_paged_attention(*args, block_size=4, key_block=4)
    assert calls == [1]
    dispatch.tiled_paged_attention(*args, block_size=4, key_block=4, implementation="reference")
    q, q_pos, k, v, tables = args
    dispatch.tiled_paged_attention(
        q, q_pos, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), tables, block_size=4, key_block=4
    )
    assert calls == [1]


def test_where_the_kernel_cannot_be_built_the_reference_runs_with_a_warning(tmp_path):
    """A compiler that cannot build it (here `false`, with an empty cache): decode attention runs on the reference,
    and the log says why."""
    code = (
        "import numpy as np, jax.numpy as jnp\n"
        "from jaxserve.pallas_kernels import cpu_attention, dispatch\n"
        "q = jnp.ones((1, 1, 2, 8)); kv = jnp.ones((8, 1, 8)); tables = jnp.zeros((1, 2), jnp.int32)\n"
        "o, lse = dispatch.tiled_paged_attention(q, jnp.array([[3]]), kv, kv, tables, block_size=4, key_block=4)\n"
        "assert not cpu_attention.built() and np.allclose(o, 1.0), o\n"
    )
    env = {**os.environ, "CXX": shutil.which("false"), "JAXSERVE_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "decode attention runs on the jnp reference" in done.stderr
