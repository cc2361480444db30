"""Chunk-wise KV transfer from the prefill pool to a decode instance, behind one interface (Transport) so the
multi-process transport can replace the in-process one.

A finished chunk's rows are taken out of the prefill stores at once (staged on their devices, so the stores serve
the next chunk) and wait for one of the decode instance's receive buffers (Tetris 4.2's handshake): a transfer is
sent only into a free buffer and holds it until its rows have landed in the instance's paged cache; later
transfers wait, in order. Decoding starts when a request's last chunk has landed.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Protocol

import jax
import numpy as np

Piece = tuple[jax.Array, jax.Array, np.ndarray]  # k, v [layers, n, kvh, d] and the rows' positions [n]


class Transport(Protocol):
    def send(self, pieces: list[Piece], device: jax.Device) -> list[Piece]:
        """The pieces on `device` (asynchronously: JAX orders their use after the copy)."""


class LocalTransport:
    """One process: `jax.device_put` between devices."""

    def send(self, pieces: list[Piece], device: jax.Device) -> list[Piece]:
        return [(*jax.device_put((k, v), device), pos) for k, v, pos in pieces]


@dataclasses.dataclass
class Transfer:
    request_id: str
    chunk: int
    last: bool  # the request's last chunk
    pieces: list[Piece]  # on the prefill devices until sent, then on the decode device
    ready: float  # when the chunk finished
    sent: float | None = None
    landed: float | None = None


class ReceiveBuffers:
    def __init__(self, count: int):
        if count < 1:
            raise ValueError(f"a decode instance needs at least one receive buffer, got {count}")
        self.count = count
        self.waiting: collections.deque[Transfer] = collections.deque()  # finished chunks not yet sent
        self.held: list[Transfer] = []  # sent, not yet landed: one buffer each

    def offer(self, transfer: Transfer) -> None:
        self.waiting.append(transfer)

    def send(self, transport: Transport, device: jax.Device, clock: Callable[[], float]) -> None:
        """Send waiting transfers, in order, into the free buffers."""
        while self.waiting and len(self.held) < self.count:
            t = self.waiting.popleft()
            t.pieces, t.sent = transport.send(t.pieces, device), clock()
            self.held.append(t)

    def release(self, transfer: Transfer) -> None:
        self.held.remove(transfer)

    def drop(self, request_id: str) -> None:
        """Forget an aborted request's transfers, sent or not."""
        self.waiting = collections.deque(t for t in self.waiting if t.request_id != request_id)
        self.held = [t for t in self.held if t.request_id != request_id]
