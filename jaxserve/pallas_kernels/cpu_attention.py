"""Decode attention on a CPU in C++ (cpu_attention.cc): each decode row's query over its own pages, read in place
from the paged cache, with an online softmax; rows x KV heads over the helper threads (cpu_threads.h).

On a CPU, reference.tiled_paged_attention gathers every page a step reads and runs a dozen small XLA ops per step
and layer: at one token a row that is most of a decode step's ops, and of the time to compile it.
dispatch.tiled_paged_attention takes this instead for float32 decode tiles on a CPU where it builds (else the
reference, with a warning), unless an implementation is named. Every load checks it against the reference on
random pages (GQA, a window, padding rows, pages out of order, a KV-parallel device's held pages).
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxserve.pallas_kernels import cpu_ffi, paged_attention, reference

SOURCE = pathlib.Path(__file__).with_name("cpu_attention.cc")
TARGET = "jaxserve_cpu_decode_attention"


def takes(q: Array, k_cache: Array) -> bool:
    """Whether decode attention of these arrays runs here: float32 decode tiles on a CPU where the kernel builds."""
    return jax.default_backend() == "cpu" and q.shape[1] == 1 and q.dtype == k_cache.dtype == jnp.float32 and built()


@functools.cache
def built() -> bool:
    """Whether the kernel is built, registered and checked here (else the reference runs: cpu_ffi.builds)."""
    return cpu_ffi.builds(load, "decode attention runs on the jnp reference")


@functools.cache
def load() -> None:
    """Build (or find) the kernel, register it and check it against the reference; raises where it disagrees."""
    cpu_ffi.load(SOURCE, [TARGET], _check)


def decode_attention(
    q: Float[Array, "n 1 h d"],
    q_pos: Int[Array, "n 1"],
    k_cache: Float[Array, "slots kvh d"],
    v_cache: Float[Array, "slots kvh d"],
    tables: Int[Array, "n w"],
    *,
    block_size: int,
    window: int | None = None,
    page_pos: Int[Array, "n w"] | None = None,
) -> tuple[Float[Array, "n 1 h d"], Float[Array, "n 1 h"]]:
    """reference.tiled_paged_attention for one-token tiles, in C++ (the same arguments and results)."""
    load()
    return _call(q, q_pos, k_cache, v_cache, tables, block_size, window, page_pos)


def _call(q, q_pos, k_cache, v_cache, tables, block_size, window, page_pos):
    n, _, h, d = q.shape
    if page_pos is None:
        page_pos = paged_attention.pages_in_order(tables, block_size)
    out = (jax.ShapeDtypeStruct((n, h, d), jnp.float32), jax.ShapeDtypeStruct((n, h), jnp.float32))
    o, lse = jax.ffi.ffi_call(TARGET, out)(
        q.reshape(n, h, d),
        q_pos.reshape(n).astype(jnp.int32),
        k_cache,
        v_cache,
        tables.astype(jnp.int32),
        page_pos.astype(jnp.int32),
        block_size=np.int64(block_size),
        window=np.int64(window or 0),
    )
    return o.reshape(n, 1, h, d), lse.reshape(n, 1, h)


def _check() -> None:
    """The kernel against reference.tiled_paged_attention on random pages, in one program (each of the reference's
    ops compiled alone would take seconds): pages in order without a window, and a KV-parallel device's held pages
    with one. Outputs within float32 rounding of sums over a few dozen keys, log-sum-exps alike, -inf and 0 where
    a row sees nothing (padding)."""
    rng = np.random.default_rng(0)
    block, pages, kvh, g, d = 4, 12, 2, 3, 16
    k, v = (rng.standard_normal((pages * block, kvh, d)).astype(np.float32) for _ in range(2))
    tables = np.stack([rng.permutation(pages)[:6] for _ in range(4)]).astype(np.int32)
    tables[2, 3:] = -1  # a short request
    q_pos = np.array([[21], [5], [10], [-1]], np.int32)  # the last row is padding
    q = rng.standard_normal((4, 1, kvh * g, d)).astype(np.float32)
    held = rng.random(tables.shape) < 0.6

    @jax.jit
    def cases(q, q_pos, k, v, tables, held):
        held_tables, held_pos = paged_attention.held_pages(tables, held, block, 1 << 30)
        out = []
        for window, t, pos in zip(windows, (tables, held_tables), (None, held_pos)):
            want = reference.tiled_paged_attention(
                q, q_pos, k, v, t, block_size=block, key_block=block, window=window, page_pos=pos
            )
            out.append((_call(q, q_pos, k, v, t, block, window, pos), want))
        return out

    windows = (None, 7)
    for window, (got, want) in zip(windows, cases(q, q_pos, k, v, tables, held)):
        for a, b in zip(got, want):
            a, b = np.asarray(a), np.asarray(b)
            assert np.array_equal(np.isinf(a), np.isinf(b)), "rows that see nothing differ"
            finite = np.isfinite(b)
            assert np.allclose(a[finite], b[finite], rtol=1e-5, atol=1e-5), f"window {window}: results differ"
