"""The scheduler's side of one decode instance in a disaggregated cluster, for the live cluster
(cluster/decode.py) and the simulator (sim/disagg.py) alike: what a dispatcher sees of it and the receive-buffer
handshake its KV arrives through. The executors keep only what a step does or costs.

- Promises (Tetris 5.2's virtual usage): a request dispatched here promises its prompt's KV and its predicted
  decode until it holds its blocks on the instance (`holds`), then its predicted decode until it decodes
  (`admit`). A dispatcher's load counts the promised slots as used and the requests on their way as running.
- Heavy and light (TetriInfer 3.3.4): every request dispatched here and not finished, by predicted decode length.
- Flip load (TetriInfer 3.5): the fuller of the KV its admission policy counts as taken and its batch, the
  requests on their way in it.
- Receive buffers (Tetris 4.2): a finished chunk's KV is offered; transfers are sent in order, each into a free
  buffer it holds until its rows have landed; a request is ready to decode when every chunk offered for it has
  landed and its last chunk was among them.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

from jaxserve.sched.decode_dispatch import DecodeLoad
from jaxserve.sched.flip import decode_busy

if TYPE_CHECKING:
    from jaxserve.sched.scheduler import ReplicaScheduler

Key = tuple[str, int]  # (request id, chunk index)


@dataclasses.dataclass
class Transfer:
    """One chunk's KV on its way from the prefill side to a decode instance."""

    request_id: str
    chunk: int
    last: bool  # the request's last chunk
    tokens: int  # rows of KV it carries
    ready: float  # when its chunk finished
    sent: float | None = None
    landed: float | None = None

    @property
    def key(self) -> Key:
        return self.request_id, self.chunk


@dataclasses.dataclass
class _Promise:
    prompt_len: int
    decode: int  # predicted decode tokens promised
    holds: bool = False  # its blocks are held on the instance: only `decode` is still promised
    in_flight: int = 0  # chunks offered and not landed
    last_landed: bool = False


class DecodeLedger:
    def __init__(self, receive_buffers: int):
        if receive_buffers < 1:
            raise ValueError(f"a decode instance needs at least one receive buffer, got {receive_buffers}")
        self.receive_buffers = receive_buffers
        self.incoming: dict[str, _Promise] = {}  # dispatched here, not yet decoding
        self.heavy: dict[str, bool] = {}  # dispatched here and not finished: is it a heavy decode?
        self.waiting: collections.deque[Transfer] = collections.deque()  # offered, not yet sent
        self.held: list[Transfer] = []  # sent, not yet landed: one buffer each

    # ---- dispatch ---------------------------------------------------------------------------------------------
    def expect(self, request_id: str, prompt_len: int, decode: int, heavy: bool) -> None:
        """The request was dispatched here, promising its prompt and `decode` predicted tokens."""
        if request_id in self.heavy:
            raise ValueError(f"request {request_id} was already dispatched to this decode instance")
        self.incoming[request_id] = _Promise(prompt_len, decode)
        self.heavy[request_id] = heavy

    def load(self, free_slots: int, running: int) -> DecodeLoad:
        """What a dispatcher sees, from the instance's free KV slots and the requests running on it."""
        promised = sum(p.decode + (0 if p.holds else p.prompt_len) for p in self.incoming.values())
        heavy = sum(self.heavy.values())
        return DecodeLoad(free_slots - promised, running + self._on_the_way, heavy, len(self.heavy) - heavy)

    def busy(self, committed: int, capacity: int, running: int, max_num_seqs: int) -> float:
        """The instance's load for the flip policy, from its scheduler's KV committed by admission, its capacity
        and its running requests: the requests on their way count in its batch."""
        return decode_busy(committed, capacity, running + self._on_the_way, max_num_seqs)

    @property
    def _on_the_way(self) -> int:
        """Requests dispatched here that do not hold blocks yet."""
        return sum(not p.holds for p in self.incoming.values())

    def predicted(self, request_id: str) -> int:
        """The decode length promised for a request on its way (what its reservation is checked against)."""
        return self.incoming[request_id].decode

    def holds(self, request_id: str) -> bool:
        """Whether the request holds its blocks on the instance (its prompt no longer promised)."""
        return self.incoming[request_id].holds

    def hold(self, request_id: str) -> None:
        self.incoming[request_id].holds = True

    def ready(self, request_id: str) -> bool:
        """Every chunk of the request has landed, its last among them."""
        p = self.incoming.get(request_id)
        return p is not None and p.last_landed and not p.in_flight

    def admit(self, request_id: str) -> None:
        """The request decodes: nothing of it is promised any more."""
        del self.incoming[request_id]

    def forget(self, request_id: str) -> list[Transfer]:
        """The request ended (finished, failed or aborted): nothing of it stays. Returns its transfers that were
        offered or sent and had not landed, for the executor to drop."""
        self.incoming.pop(request_id, None)
        self.heavy.pop(request_id, None)
        dropped = [t for t in (*self.waiting, *self.held) if t.request_id == request_id]
        self.waiting = collections.deque(t for t in self.waiting if t.request_id != request_id)
        self.held = [t for t in self.held if t.request_id != request_id]
        return dropped

    # ---- the receive-buffer handshake ---------------------------------------------------------------------------
    def offer(self, transfer: Transfer) -> None:
        """A finished chunk's KV waits for a buffer (its request must have been dispatched here)."""
        p = self.incoming[transfer.request_id]
        p.in_flight += 1
        self.waiting.append(transfer)

    def send(self, now: float) -> list[Transfer]:
        """The waiting transfers that go now, in order, each into a free buffer."""
        sent = []
        while self.waiting and len(self.held) < self.receive_buffers:
            t = self.waiting.popleft()
            t.sent = now
            self.held.append(t)
            sent.append(t)
        return sent

    def landing(self, arrived: Callable[[Transfer], bool], reserve: Callable[[str], bool]) -> Iterator[Transfer]:
        """The held transfers that land now, in order: those whose KV is in its buffer (`arrived`) and whose
        request holds blocks, which reserve(request id) gets it the first time. A request refused keeps its
        buffer, and the transfers after it wait. The caller lands each one it is given (`land`)."""
        for t in list(self.held):
            if not arrived(t):
                continue
            if not self.holds(t.request_id):
                if not reserve(t.request_id):
                    return
                self.hold(t.request_id)
            yield t

    def land(self, transfer: Transfer, now: float) -> None:
        """A sent transfer's rows are in the instance's cache: its buffer is free."""
        self.held.remove(transfer)
        transfer.landed = now
        p = self.incoming[transfer.request_id]
        p.in_flight -= 1
        p.last_landed |= transfer.last


class DecodeSide(Protocol):
    """A decode instance as a cluster policy reads it: its ledger and its ReplicaScheduler (cluster/decode.py's
    LiveDecoder, sim/disagg.py's SimulatedDecoder)."""

    ledger: DecodeLedger

    @property
    def scheduler(self) -> ReplicaScheduler: ...


def load(side: DecodeSide) -> DecodeLoad:
    """What a dispatcher sees of the instance."""
    kv = side.scheduler.kv
    return side.ledger.load(kv.num_free * kv.block_size, len(side.scheduler.running))


def busy(side: DecodeSide) -> float:
    """The instance's load for the flip policy."""
    s = side.scheduler
    return side.ledger.busy(s.committed(), s.kv_capacity, len(s.running), s.max_num_seqs)
