"""Exact softmax merges across devices: partials (o, lse) over disjoint key sets, combined with collectives.

With m = pmax(lse), each partial is weighted by w = exp(lse - m); the result is sum(o * w) / sum(w) and its
log-sum-exp m + log(sum(w)). A partial that saw no key (lse = -inf) has w = 0 and drops out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


def merge_over(o, lse, axis_name: str):
    """Every device gets the merged result of all devices' partials (an all-reduce)."""
    num, w, m = weigh(o, lse, axis_name)
    return finish(jax.lax.psum(num, axis_name), jax.lax.psum(w, axis_name), m)


def merge_scatter(o, lse, axis_name: str):
    """Partials for all queries of the group in, this device's 1/p of the queries out (a reduce-scatter)."""
    num, w, m = weigh(o, lse, axis_name)
    t = o.shape[0] // jax.lax.axis_size(axis_name)
    m_own = jax.lax.dynamic_slice_in_dim(m, jax.lax.axis_index(axis_name) * t, t)
    scatter = lambda x: jax.lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)
    return finish(scatter(num), scatter(w), m_own)
