"""Moving a request's KV rows between devices, exactly the rows that must move: host-planned runs of rows cut
into power-of-two pieces (so one small program per piece size and device serves every move), each taken from its
source buffer, sent with `jax.device_put` and written into its destination. The CDSP rebalance (between chunk
groups) and the prefill -> decode transfer both move KV this way; a multi-process transport replaces the send.
"""

from __future__ import annotations

import functools
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int


def runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """Sorted row indices as maximal [lo, hi) runs of consecutive rows."""
    rows = np.asarray(rows)
    if not len(rows):
        return []
    cut = np.flatnonzero(np.diff(rows) != 1) + 1
    return [(int(r[0]), int(r[-1]) + 1) for r in np.split(rows, cut)]


def pieces(lo: int, hi: int) -> Iterator[tuple[int, int]]:
    """[lo, hi) as (start, size) pieces of power-of-two sizes, largest first."""
    while lo < hi:
        size = 1 << ((hi - lo).bit_length() - 1)
        yield lo, size
        lo += size


@functools.partial(jax.jit, static_argnames="size")
def take(k: Float[Array, "layers cap kvh d"], v: Float[Array, "layers cap kvh d"], lo: Int[Array, ""], *, size: int):
    """Rows [lo, lo + size) of every layer (on the buffers' device)."""
    cut = lambda x: jax.lax.dynamic_slice_in_dim(x, lo, size, axis=1)  # noqa: E731
    return cut(k), cut(v)


def as_cache(x: Array, dtype: jnp.dtype) -> Array:
    """x in a cache's dtype; saturated into an 8-bit float's range, where a plain cast would give NaN."""
    if jnp.dtype(dtype).itemsize == 1:
        x = jnp.clip(x, -float(jnp.finfo(dtype).max), float(jnp.finfo(dtype).max))
    return x.astype(dtype)


@jax.jit
def select(k: Float[Array, "layers n kvh d"], v: Float[Array, "layers n kvh d"], idx: Int[Array, " m"]):
    """Rows `idx` of every layer (on the rows' device)."""
    return k[:, idx], v[:, idx]


@functools.partial(jax.jit, donate_argnums=(0, 1))
def put(
    k: Float[Array, "layers cap kvh d"],
    v: Float[Array, "layers cap kvh d"],
    k_rows: Float[Array, "layers n kvh d"],
    v_rows: Float[Array, "layers n kvh d"],
    at: Int[Array, ""],
):
    """The rows written at [at, at + n) of every layer, in place."""
    paste = lambda x, rows: jax.lax.dynamic_update_slice_in_dim(x, as_cache(rows, x.dtype), at, axis=1)  # noqa: E731
    return paste(k, k_rows), paste(v, v_rows)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def scatter(
    k: Float[Array, "layers slots kvh d"],
    v: Float[Array, "layers slots kvh d"],
    k_rows: Float[Array, "layers n kvh d"],
    v_rows: Float[Array, "layers n kvh d"],
    slots: Int[Array, " n"],
):
    """The rows written at `slots` (a paged cache's token slots) of every layer, in place."""
    return k.at[:, slots].set(as_cache(k_rows, k.dtype)), v.at[:, slots].set(as_cache(v_rows, v.dtype))
