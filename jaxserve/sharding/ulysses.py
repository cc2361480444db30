"""Ulysses-style all-to-all SP (CSPS SP-NTP; call inside `shard_map` over the 'sp' axis).

Queries and K/V arrive sharded by sequence; one all-to-all re-shards them by head, each device attends over the
whole sequence for its heads, and a second all-to-all brings the output back to sequence shards.

`StoreUlyssesBackend` is the CSPS prefill pool's attention (engine/sp_prefill.py, sp_attention="sp_ntp"): the
chunk as above, and the request's history, kept by sequence in each device's store, re-sharded by head one key
block at a time and merged by log-sum-exp. Heads that do not split over the group (9 over 2, say) are split as
MHA: K/V repeated to one head per query head, query and K/V heads padded with zeros to a multiple of the group.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxserve.pallas_kernels import dispatch as kernels
from jaxserve.sharding.mesh import SP
from jaxserve.sharding.ring import StoreMetadata, merge_two, store_block, write_store


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
    q_pos: Int[Array, " t"],
    k_pos: Int[Array, " t"],
    hist_k: Float[Array, "n kvh d"],
    hist_v: Float[Array, "n kvh d"],
    hist_pos: Int[Array, " n"],
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
    o, _ = kernels.chunk_attention(
        _seq_to_heads(q, axis_name),
        _seq_to_heads(keys, axis_name),
        _seq_to_heads(values, axis_name),
        all_q_pos,
        key_pos,
        implementation=implementation,
    )
    return jax.lax.all_to_all(o, axis_name, split_axis=0, concat_axis=1, tiled=True)


@dataclasses.dataclass(frozen=True)
class HeadSplit:
    """How h query heads and kvh KV heads split over p devices: each KV head repeated `repeat` times, then query
    and KV heads padded with zero heads to `q_heads` and `kv_heads` (multiples of p)."""

    h: int
    repeat: int
    q_heads: int
    kv_heads: int

    @classmethod
    def of(cls, h: int, kvh: int, p: int) -> "HeadSplit":
        if h % p == 0 and (kvh % p == 0 or p % kvh == 0):
            return cls(h, kv_heads_for(h, kvh, p) // kvh, h, kv_heads_for(h, kvh, p))
        padded = -(-h // p) * p
        return cls(h, h // kvh, padded, padded)  # MHA: query head j pairs with repeated KV head j

    def queries(self, q: Float[Array, "t h d"], axis_name: str) -> Float[Array, "pt hp d"]:
        return _seq_to_heads(_pad_heads(q, self.q_heads), axis_name)

    def keys(self, k: Float[Array, "t kvh d"], axis_name: str) -> Float[Array, "pt kp d"]:
        return _seq_to_heads(_pad_heads(jnp.repeat(k, self.repeat, axis=1), self.kv_heads), axis_name)

    def outputs(self, o: Float[Array, "pt hp d"], axis_name: str) -> Float[Array, "t h d"]:
        return jax.lax.all_to_all(o, axis_name, split_axis=0, concat_axis=1, tiled=True)[:, : self.h]


def _f32(partial: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(o, lse) in float32: a loop's carry keeps one dtype."""
    return tuple(x.astype(jnp.float32) for x in partial)


def _pad_heads(x: Float[Array, "t n d"], heads: int) -> Float[Array, "t heads d"]:
    return jnp.pad(x, ((0, 0), (0, heads - x.shape[1]), (0, 0)))


@dataclasses.dataclass(frozen=True)
class StoreUlyssesBackend:
    """The model's attention backend inside `shard_map` for a CSPS SP-NTP chunk: the chunk and the request's
    stored history attended head-sharded, then the output back to sequence shards.

    caches = this device's (k_store, v_store), each [layers, cap, kvh, d], kept by sequence as the ring keeps
    them (rebalancing and transfers are the same). metadata.blocks must be equal on every device of the group
    (the group's most): each history block is re-sharded by one all-to-all that all of them join.
    """

    axis_size: int
    key_block: int
    axis_name: str = SP
    implementation: kernels.Implementation | None = None

    def __call__(self, q, k, v, positions, caches, layer, metadata: StoreMetadata):
        k_store, v_store = caches
        ax, kb = self.axis_name, self.key_block
        split = HeadSplit.of(q.shape[2], k.shape[2], self.axis_size)
        q_heads = split.queries(q[0], ax)
        q_pos = jax.lax.all_gather(positions[0], ax, tiled=True)

        def attend(keys, values, k_pos):  # every query of the chunk, this device's heads
            return _f32(
                kernels.chunk_attention(
                    q_heads,
                    split.keys(keys, ax),
                    split.keys(values, ax),
                    q_pos,
                    jax.lax.all_gather(k_pos, ax, tiled=True),
                    implementation=self.implementation,
                )
            )

        def block(i, carry):
            held = attend(*store_block(k_store, v_store, metadata.hist_pos, layer, i, kb))
            return _f32(merge_two(*carry, *held, self.implementation))

        o, lse = jax.lax.fori_loop(0, metadata.blocks, block, attend(k[0], v[0], metadata.k_pos))
        out = split.outputs(o.astype(q.dtype), ax)
        return out[None], write_store(caches, k, v, layer, metadata.fill)
