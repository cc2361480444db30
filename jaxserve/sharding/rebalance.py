"""KV rebalancing between CDSP chunk groups (Tetris 4.1), as one all-to-all inside `shard_map`.

A request's history KV is held by the devices of group G, n_i valid tokens on device i (any tokens: they carry
their positions). Before a chunk runs on a larger group G' (G a prefix of G'), the history moves so every device
of G' holds an equal share. Devices are ranked by their order in G'; the valid tokens take global ranks in
device order, and rank r goes to device r // q at slot r % q, with q = ceil(N / |G'|). The counts are known to
the planner, so `plan` runs on the host and only the moves run on devices.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxserve.pallas_kernels.reference import NO_POSITION
from jaxserve.sharding.mesh import SP


def plan(counts: Sequence[int]) -> tuple[np.ndarray, int]:
    """Per-device first global rank, and q: the tokens each device holds afterwards (the last may hold fewer)."""
    counts = np.asarray(counts, np.int32)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
    return starts, max(1, -(-int(counts.sum()) // len(counts)))


def rebalance(
    k: Float[Array, "cap kvh d"],
    v: Float[Array, "cap kvh d"],
    pos: Int[Array, "cap"],
    start: Int[Array, ""],
    count: Int[Array, ""],
    *,
    share: int,
    axis_size: int,
    axis_name: str = SP,
) -> tuple[Float[Array, "q kvh d"], Float[Array, "q kvh d"], Int[Array, "q"]]:
    """This device's balanced share: `share` (= q from `plan`) slots, padding at position NO_POSITION.

    k/v/pos: this device's buffer with its `count` valid tokens first; start: their first global rank.
    """
    slot = jnp.arange(k.shape[0])
    rank = start + slot
    # Invalid slots aim past the last device and are dropped by the scatter.
    dest = jnp.where(slot < count, rank // share, axis_size)
    at = rank % share

    def scatter(x, fill):
        buf = jnp.full((axis_size, share) + x.shape[1:], fill, x.dtype)
        return buf.at[dest, at].set(x, mode="drop")

    recv_k, recv_v, recv_pos = (
        jax.lax.all_to_all(scatter(x, fill), axis_name, split_axis=0, concat_axis=0, tiled=False)
        for x, fill in ((k, 0), (v, 0), (pos, NO_POSITION))
    )
    # Each slot of the share is filled by exactly one source device: the one whose position is valid.
    valid = recv_pos != NO_POSITION
    pick = lambda x: jnp.sum(jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x, 0), axis=0)
    return pick(recv_k), pick(recv_v), jnp.min(recv_pos, axis=0)
