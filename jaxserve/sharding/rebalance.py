"""KV rebalancing between CDSP chunk groups (Tetris 4.1), as one all-to-all inside `shard_map`.

A request's history KV is held by the devices of group G, n_i valid tokens on device i (any tokens: they carry
their positions). Before a chunk runs on a larger group G' (G a prefix of G'), the history moves so every device
of G' holds an equal share (targets differ by at most one). Each device keeps as many of its own tokens as its
target allows and only the excess moves, into the other devices' free slots: the fewest bytes possible. The
counts are known to the planner, so `plan` runs on the host and only the moves run on devices.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxserve.pallas_kernels.reference import NO_POSITION
from jaxserve.sharding.mesh import SP


def targets(total: int, devices: int, width: int | None = None) -> np.ndarray:
    """Balanced token counts for the first `devices` of a group of `width` (the rest get none)."""
    width = width or devices
    return np.array([total // devices + (j < total % devices) if j < devices else 0 for j in range(width)])


def plan(pos: np.ndarray, devices: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """For every device's buffer slot: destination device and slot there ([p, cap] each), and the share.

    pos: [p, cap] positions of each device's buffer on the mesh the move runs on (NO_POSITION: empty slot;
    devices that join hold only empty slots). The history ends up balanced over the first `devices` (default:
    all; fewer scales the group down). Empty slots get destination p (dropped)."""
    valid = np.asarray(pos) != NO_POSITION
    p, cap = valid.shape
    counts = valid.sum(axis=1)
    want = targets(int(counts.sum()), devices or p, p)
    share = max(1, int(want.max()))
    dest = np.full((p, cap), p, np.int32)
    at = np.zeros((p, cap), np.int32)
    free = iter([(j, s) for j in range(p) for s in range(min(counts[j], want[j]), want[j])])
    for i in range(p):
        for rank, slot in enumerate(np.flatnonzero(valid[i])):
            dest[i, slot], at[i, slot] = (i, rank) if rank < want[i] else next(free)
    return dest, at, share


def moved_tokens(counts: Sequence[int], devices: int | None = None) -> int:
    """Tokens that change device under `plan`, given each device's token count."""
    want = targets(sum(counts), devices or len(counts), len(counts))
    return int(sum(max(0, n - w) for n, w in zip(counts, want)))


def rebalance(
    k: Float[Array, "cap kvh d"],
    v: Float[Array, "cap kvh d"],
    pos: Int[Array, " cap"],
    dest: Int[Array, " cap"],
    at: Int[Array, " cap"],
    *,
    share: int,
    axis_size: int,
    axis_name: str = SP,
) -> tuple[Float[Array, "q kvh d"], Float[Array, "q kvh d"], Int[Array, " q"]]:
    """This device's balanced share: `share` slots, padding at position NO_POSITION.

    k/v/pos: this device's buffer; dest/at: this device's rows of `plan`.
    """

    def scatter(x, fill):
        buf = jnp.full((axis_size, share) + x.shape[1:], fill, x.dtype)
        return buf.at[dest, at].set(x, mode="drop")  # destination axis_size: padding, dropped

    recv_k, recv_v, recv_pos = (
        jax.lax.all_to_all(scatter(x, fill), axis_name, split_axis=0, concat_axis=0, tiled=False)
        for x, fill in ((k, 0), (v, 0), (pos, NO_POSITION))
    )
    # Each slot of the share is filled by at most one source device: the one whose position is valid.
    valid = (recv_pos != NO_POSITION)[..., None, None]
    return (
        jnp.sum(jnp.where(valid, recv_k, 0), axis=0),
        jnp.sum(jnp.where(valid, recv_v, 0), axis=0),
        jnp.min(recv_pos, axis=0),
    )
