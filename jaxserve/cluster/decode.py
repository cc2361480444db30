"""A decode instance of the live cluster: the Plan-executing engine on its own device or KV-parallel group of
devices, with receive buffers for KV arriving from the prefill pool (on the instance's first device; landing
sends each row on to the device that owns its block; the data moves through the KVMover), and the load a dispatcher sees (virtual usage: KV promised
to requests on their way, sized by the predicted decode length)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from jaxserve.cluster.transfer import KVMover, ReceiveBuffers, Transfer
from jaxserve.engine.engine import Engine
from jaxserve.sched.decode_dispatch import DecodeLoad


@dataclasses.dataclass
class _Incoming:
    prompt_len: int
    predicted: int  # decode tokens
    reserved: bool = False
    landed_last: bool = False


class DecodeInstance:
    def __init__(self, index: int, engine: Engine, receive_buffers: int, mover: KVMover):
        """index: this instance's runner in the mover."""
        self.index, self.engine, self.mover = index, engine, mover
        self.buffers = ReceiveBuffers(receive_buffers)
        self.incoming: dict[str, _Incoming] = {}  # dispatched here, not yet decoding
        self.heavy: dict[str, bool] = {}  # every request dispatched here and not finished: is it a heavy decode?

    def expect(self, request_id: str, prompt_len: int, predicted: int, heavy: bool) -> None:
        self.incoming[request_id] = _Incoming(prompt_len, predicted)
        self.heavy[request_id] = heavy

    @property
    def kv_tokens(self) -> int:
        """Tokens its KV pool holds."""
        return self.engine.kv.capacity * self.engine.kv.block_size

    def load(self) -> DecodeLoad:
        kv = self.engine.kv
        promised = sum(r.predicted + (0 if r.reserved else r.prompt_len) for r in self.incoming.values())
        heavy = sum(self.heavy.values())
        return DecodeLoad(kv.num_free * kv.block_size - promised,
                          len(self.engine.scheduler.running) + sum(not r.reserved for r in self.incoming.values()),
                          heavy, len(self.heavy) - heavy)

    def pump(self, clock: Callable[[], float]) -> list[Transfer]:
        """Send waiting transfers into free buffers and land the held ones whose request has its blocks (in
        order; a request without room keeps its buffer). Returns the transfers that landed."""
        self.buffers.send(self.mover, self.index, clock)
        landed = []
        for t in list(self.buffers.held):
            inc = self.incoming.get(t.request_id)
            if inc is None:  # finished by its first token, or aborted
                self.mover.drop(t.key)
                self.buffers.release(t)
                continue
            if not inc.reserved:
                if self.engine.reserve(t.request_id) is None:
                    break
                inc.reserved = True
            table = np.asarray(self.engine.block_table(t.request_id))
            bs = self.engine.kv.block_size
            self.mover.land(t.key, self.index, [table[pos // bs] * bs + pos % bs for pos in t.positions])
            inc.landed_last |= t.last
            t.landed = clock()
            self.buffers.release(t)
            landed.append(t)
        self.buffers.send(self.mover, self.index, clock)
        return landed

    def ready(self, request_id: str) -> bool:
        inc = self.incoming.get(request_id)
        return inc is not None and inc.landed_last

    def admit(self, request_id: str) -> None:
        del self.incoming[request_id]
        self.engine.admit_prefilled(request_id)

    def forget(self, request_id: str) -> None:
        """The request ended (finished, failed or aborted): nothing of it stays here."""
        self.incoming.pop(request_id, None)
        self.heavy.pop(request_id, None)
        self.buffers.drop(request_id, self.mover)
