"""A decode instance of the live cluster: the Plan-executing engine on its own device or KV-parallel group of
devices, and its ledger (sched/decode_ledger.py: the load a dispatcher sees, the receive-buffer handshake). KV
arriving from the prefill pool lands through the KVMover: on the instance's first device, then each row on to
the device that owns its block."""

from __future__ import annotations

from typing import Callable

from jaxserve.cluster.transfer import KVMover
from jaxserve.engine.engine import Engine
from jaxserve.sched.decode_ledger import DecodeLedger, Transfer
from jaxserve.sched.scheduler import ReplicaScheduler


class LiveDecoder:
    def __init__(self, index: int, engine: Engine, receive_buffers: int, mover: KVMover):
        """index: this instance's runner in the mover."""
        self.index, self.engine, self.mover = index, engine, mover
        self.ledger = DecodeLedger(receive_buffers)

    @property
    def kv_tokens(self) -> int:
        """Tokens its KV pool holds."""
        return self.engine.kv.capacity * self.engine.kv.block_size

    @property
    def scheduler(self) -> ReplicaScheduler:
        """Its engine's scheduler (what a cluster policy reads, with the ledger: sched/decode_ledger.py)."""
        return self.engine.scheduler

    def pump(self, clock: Callable[[], float]) -> list[Transfer]:
        """Send waiting transfers into free buffers and land the held ones whose request has its blocks (in
        order; a request without room keeps its buffer). Returns the transfers that landed."""
        self._send(clock)
        landed = []
        reserve = lambda rid: self.engine.reserve(rid, self.ledger.predicted(rid)) is not None  # noqa: E731
        for t in self.ledger.landing(lambda t: True, reserve):  # a sent transfer's copy is ordered before its use
            self.mover.land(t.key, self.index, self.engine.block_table(t.request_id), self.engine.kv.block_size)
            self.ledger.land(t, clock())
            landed.append(t)
        self._send(clock)
        return landed

    def _send(self, clock: Callable[[], float]) -> None:
        for t in self.ledger.send(clock()):
            self.mover.send(t.key, self.index)

    def admit_ready(self, prefilling: Callable[[str], bool]) -> None:
        """Start decoding the requests whose KV has landed (and whose prefill has ended)."""
        for rid in [rid for rid in self.ledger.incoming if self.ledger.ready(rid) and not prefilling(rid)]:
            self.ledger.admit(rid)
            self.engine.admit_prefilled(rid)

    def forget(self, request_id: str) -> None:
        """The request ended (finished, failed or aborted): nothing of it stays here."""
        for t in self.ledger.forget(request_id):
            self.mover.drop(t.key)
