"""Ulysses-style all-to-all SP (CSPS SP-NTP; call inside `shard_map` over the 'sp' axis).

Queries and K/V arrive sharded by sequence; one all-to-all re-shards them by head, each device attends over the
whole sequence for its heads, and a second all-to-all brings the output back to sequence shards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxserve.pallas_kernels import dispatch as kernels
from jaxserve.sharding.mesh import SP


def kv_heads_for(h: int, kvh: int, p: int) -> int:
    """KV heads after replication so that p head shards each get whole KV heads for their query heads."""
    if h % p:
        raise ValueError(f"Ulysses SP needs the {h} query heads to divide over {p} devices")
    if kvh % p == 0:
        return kvh
    if p % kvh == 0:
        return p
    raise ValueError(f"Ulysses SP cannot split {kvh} KV heads over {p} devices")


def _seq_to_heads(x, axis_name):
    return jax.lax.all_to_all(x, axis_name, split_axis=1, concat_axis=0, tiled=True)


def ulysses_attention(
    q: Float[Array, "t h d"],
    k: Float[Array, "t kvh d"],
    v: Float[Array, "t kvh d"],
    q_pos: Int[Array, "t"],
    k_pos: Int[Array, "t"],
    hist_k: Float[Array, "n kvh d"],
    hist_v: Float[Array, "n kvh d"],
    hist_pos: Int[Array, "n"],
    *,
    axis_size: int,
    axis_name: str = SP,
    implementation: kernels.Implementation | None = None,
) -> Float[Array, "t h d"]:
    h, kvh = q.shape[1], k.shape[1]
    rep = kv_heads_for(h, kvh, axis_size) // kvh
    # Replicated KV heads keep query head j paired with KV head j // (h / kvh) after the head split.
    keys = jnp.repeat(jnp.concatenate([hist_k, k]), rep, axis=1)
    values = jnp.repeat(jnp.concatenate([hist_v, v]), rep, axis=1)
    key_pos = jax.lax.all_gather(jnp.concatenate([hist_pos, k_pos]), axis_name, tiled=True)
    all_q_pos = jax.lax.all_gather(q_pos, axis_name, tiled=True)
    o, _ = kernels.chunk_attention(_seq_to_heads(q, axis_name), _seq_to_heads(keys, axis_name),
                                   _seq_to_heads(values, axis_name), all_q_pos, key_pos,
                                   implementation=implementation)
    return jax.lax.all_to_all(o, axis_name, split_axis=0, concat_axis=1, tiled=True)
