"""Chunk-wise KV transfer from the prefill pool to a decode instance.

The control (Transfer, ReceiveBuffers) is the scheduler's side and holds no device arrays: a finished chunk's
rows are staged at once (taken out of the prefill stores, on their devices, so the stores serve the next chunk)
and wait for one of the decode instance's receive buffers (Tetris 4.2's handshake): a transfer is sent only into
a free buffer and holds it until its rows have landed in the instance's paged cache; later transfers wait, in
order. Decoding starts when a request's last chunk has landed.

The data (KVMover) is the device side: every process holds one, and the leader's calls on it are made by every
process in the same order (cluster/lockstep.py), so a prefill group on one host sends to a decode instance on
another through the same three calls as within one process (sharding/processes.move: a device_put there, a
point-to-point program between hosts).
"""

from __future__ import annotations

import collections
import dataclasses
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

    def stage(self, key: Key, written: dict[int, tuple[int, int]]) -> list[np.ndarray]:
        """Take a finished chunk's rows (instance -> [lo, hi) store rows) out of the prefill stores, as
        power-of-two pieces on their instances. Returns each piece's positions."""
        positions, pieces = [], []
        for instance, (lo, hi) in written.items():
            for k, v, pos in self.prefill.rows_of(instance, lo, hi):
                pieces.append((k, v))
                positions.append(pos)
        self._pieces[key] = pieces
        return positions

    def send(self, key: Key, decoder: int) -> None:
        """The staged pieces onto the decode instance's first device (asynchronously: their use is ordered
        after the copy)."""
        self._pieces[key] = self._onto(self._pieces[key], decoder)

    def warmup(self) -> None:
        """Send a one-row piece from every prefill instance to every decode instance, so that each pair's
        program exists and, between processes, its communicator is set up (which both processes must reach
        within a deadline) before serving."""
        for instance in self.prefill.stores:
            piece = self.prefill.take(instance, 0, 1)
            for decoder in range(len(self.runners)):
                self._onto([piece], decoder)

    def _onto(self, pieces: list[tuple[jax.Array, jax.Array]], decoder: int) -> list[tuple[jax.Array, jax.Array]]:
        """A tensor-parallel instance's pieces are gathered on its first device first."""
        target = SingleDeviceSharding(self.runners[decoder].device)
        gathered = lambda x: processes.move(x, SingleDeviceSharding(min(x.sharding.device_set,  # noqa: E731
                                                                        key=lambda d: d.id)))
        return [(processes.move(gathered(k), target), processes.move(gathered(v), target)) for k, v in pieces]

    def land(self, key: Key, decoder: int, slots: Sequence[np.ndarray]) -> None:
        """Write the sent pieces into the decode instance's cache at `slots` (one array per piece)."""
        for (k, v), s in zip(self._pieces.pop(key), slots):
            self.runners[decoder].land(k, v, s)

    def drop(self, key: Key) -> None:
        self._pieces.pop(key, None)


@dataclasses.dataclass
class Transfer:
    request_id: str
    chunk: int
    last: bool  # the request's last chunk
    positions: list[np.ndarray]  # each staged piece's token positions
    ready: float  # when the chunk finished
    sent: float | None = None
    landed: float | None = None

    @property
    def key(self) -> Key:
        return self.request_id, self.chunk


class ReceiveBuffers:
    def __init__(self, count: int):
        if count < 1:
            raise ValueError(f"a decode instance needs at least one receive buffer, got {count}")
        self.count = count
        self.waiting: collections.deque[Transfer] = collections.deque()  # finished chunks not yet sent
        self.held: list[Transfer] = []  # sent, not yet landed: one buffer each

    def offer(self, transfer: Transfer) -> None:
        self.waiting.append(transfer)

    def send(self, mover: KVMover, decoder: int, clock) -> None:
        """Send waiting transfers, in order, into the free buffers."""
        while self.waiting and len(self.held) < self.count:
            t = self.waiting.popleft()
            mover.send(t.key, decoder)
            t.sent = clock()
            self.held.append(t)

    def release(self, transfer: Transfer) -> None:
        self.held.remove(transfer)

    def drop(self, request_id: str, mover: KVMover) -> None:
        """Forget an aborted request's transfers, sent or not."""
        for t in [t for t in (*self.waiting, *self.held) if t.request_id == request_id]:
            mover.drop(t.key)
        self.waiting = collections.deque(t for t in self.waiting if t.request_id != request_id)
        self.held = [t for t in self.held if t.request_id != request_id]
