"""Exact softmax merges across devices: partials (o, lse) over disjoint key sets, combined with collectives.

With m = pmax(lse), each partial is weighted by w = exp(lse - m); the result is sum(o * w) / sum(w) and its
log-sum-exp m + log(sum(w)). A partial that saw no key (lse = -inf) has w = 0 and drops out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels.reference import merge_attention


def weigh(o, lse, axis_name: str):
    """(o * w, w, m) for this device's partial."""
    m = jax.lax.pmax(lse, axis_name)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m)
    return o * w[..., None], w, m


def finish(num, den, m):
    """Normalised output and log-sum-exp from the reduced numerator and denominator."""
    seen = den > 0
    safe = jnp.where(seen, den, 1.0)
    return num / safe[..., None], jnp.where(seen, m + jnp.log(safe), -jnp.inf)


def merge_gathered(o, lse, axis_name: str):
    """Every device gets the merged result of all devices' partials: one all-gather of (o, lse) packed as
    [..., d + 1] and a local merge (KV-parallel decode's exchange: one collective per layer, not a pmax and two
    psums)."""
    packed = jnp.concatenate([o.astype(jnp.float32), lse[..., None].astype(jnp.float32)], axis=-1)
    every = jax.lax.all_gather(packed, axis_name)  # [p, ..., d + 1]
    out, merged = merge_attention(every[..., :-1], every[..., -1])
    return out.astype(o.dtype), merged


def merge_scatter(o, lse, axis_name: str):
    """Partials for all queries of the group in, this device's 1/p of the queries out (a reduce-scatter)."""
    num, w, m = weigh(o, lse, axis_name)
    t = o.shape[0] // jax.lax.axis_size(axis_name)
    m_own = jax.lax.dynamic_slice_in_dim(m, jax.lax.axis_index(axis_name) * t, t)
    scatter = lambda x: jax.lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)
    return finish(scatter(num), scatter(w), m_own)
