"""Chunk-wise KV transfer from the prefill pool to a decode instance: the device side.

The control (the receive-buffer handshake: when a transfer is sent and lands) is the scheduler's, in
sched/decode_ledger.py. A finished chunk's rows are staged at once (taken out of the prefill stores, on their
devices, so the stores serve the next chunk), sent when the ledger gives them a buffer, and landed in the
decode instance's paged cache.

KVMover is the data: every process holds one, and the leader's calls on it are made by every
process in the same order (cluster/lockstep.py), so a prefill group on one host sends to a decode instance on
another through the same three calls as within one process (sharding/processes.move: a device_put there, a
point-to-point program between hosts).
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxserve.engine.runner import ModelRunner
from jaxserve.engine.sp_prefill import SPPrefill
from jaxserve.sharding import processes

Key = tuple[str, int]  # (request id, chunk index)


class KVMover:
    def __init__(self, prefill: SPPrefill, runners: Sequence[ModelRunner]):
        self.prefill, self.runners = prefill, list(runners)
        self._pieces: dict[Key, list[tuple[jax.Array, jax.Array]]] = {}  # k, v [layers, n, kvh, d]
        self._positions: dict[Key, list[np.ndarray]] = {}  # each staged piece's token positions

    def stage(self, key: Key, written: dict[int, tuple[int, int]]) -> int:
        """Take a finished chunk's rows (instance -> [lo, hi) store rows) out of the prefill stores, as
        power-of-two pieces on their instances. Returns the rows taken."""
        positions, pieces = [], []
        for instance, (lo, hi) in written.items():
            for k, v, pos in self.prefill.rows_of(instance, lo, hi):
                pieces.append((k, v))
                positions.append(pos)
        self._pieces[key], self._positions[key] = pieces, positions
        return sum(len(p) for p in positions)

    def send(self, key: Key, decoder: int) -> None:
        """The staged pieces onto the decode instance's first device (asynchronously: their use is ordered
        after the copy)."""
        self._pieces[key] = self._onto(self._pieces[key], decoder)

    def warmup(self, instance: int) -> None:
        """Send a one-row piece from prefill `instance` to every decode instance, so that each pair's program
        exists and, between processes, its communicator is set up (which both processes must reach within a
        deadline) before serving."""
        piece = self.prefill.take(instance, 0, 1)
        for decoder in range(len(self.runners)):
            self._onto([piece], decoder)

    def _onto(self, pieces: list[tuple[jax.Array, jax.Array]], decoder: int) -> list[tuple[jax.Array, jax.Array]]:
        """A tensor-parallel instance's pieces are gathered on its first device first."""
        target = SingleDeviceSharding(self.runners[decoder].device)
        gathered = lambda x: processes.move(
            x,
            SingleDeviceSharding(
                min(
                    x.sharding.device_set,  # noqa: E731
                    key=lambda d: d.id,
                )
            ),
        )
        return [(processes.move(gathered(k), target), processes.move(gathered(v), target)) for k, v in pieces]

    def land(self, key: Key, decoder: int, table: Sequence[int], block_size: int) -> None:
        """Write the sent pieces into the decode instance's cache, each row into its position's slot of the
        request's block table."""
        table = np.asarray(table)
        for (k, v), pos in zip(self._pieces.pop(key), self._positions.pop(key)):
            self.runners[decoder].land(k, v, table[pos // block_size] * block_size + pos % block_size)

    def drop(self, key: Key) -> None:
        self._pieces.pop(key, None)
        self._positions.pop(key, None)
