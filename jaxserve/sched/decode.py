"""A decode instance's scheduler (disaggregation): prefilled requests land with their KV, wait for memory under
an admission policy, and decode one token per iteration in a continuous batch (TetriInfer 3.4).

Admission (TetriInfer), with `predicted` the upper end of a request's predicted decode length:
- oracle: reserve prompt + the true output length (what a perfect predictor gives; never swaps);
- greedy (vLLM): admit while today's KV fits; KV grows a token per step, and when it no longer fits the newest
  request is swapped out to host memory (and back in first, when room returns);
- reserve_static: admit only if every running request's prompt + predicted length, and this one's, fit;
- reserve_dynamic: admit if there is still room at the moment the running request with the least predicted
  work left finishes (everyone's KV grown by then): less memory held back than reserve_static.
Swaps appear in the Plan as KV moves, so the executor charges them.
"""

from __future__ import annotations

import collections

from jaxserve.sched.plan import KVMove, MoveKind, Outcome, Phase, Plan, WorkItem
from jaxserve.sched.request import Request, RequestStatus

ADMISSION = ("oracle", "greedy", "reserve_static", "reserve_dynamic")


class DecodeScheduler:
    def __init__(self, kv_capacity: int, admission: str = "reserve_static", max_num_seqs: int = 256,
                 group: tuple[int, ...] = (0,)):
        if admission not in ADMISSION:
            raise ValueError(f"admission must be one of {ADMISSION}, got {admission!r}")
        self.kv_capacity, self.admission, self.max_num_seqs, self.group = kv_capacity, admission, max_num_seqs, group
        self.waiting: collections.deque[Request] = collections.deque()  # landed or swapped out, in order
        self.running: dict[str, Request] = {}
        self.predicted: dict[str, int] = {}
        self.swapped: set[str] = set()
        self.in_flight = False
        self.swaps = 0
        self.num_finished = 0  # a count, not a list: a live instance keeps nothing of what it has served

    def add(self, request: Request, predicted: int | None = None) -> None:
        """A prefilled request whose KV has arrived; predicted: its predicted decode length (upper end)."""
        if request.generated < 1 or request.finished:
            raise ValueError(f"request {request.id} must have its first token and not be finished")
        if request.prompt_len + request.output_len > self.kv_capacity:
            raise ValueError(f"request {request.id} needs {request.prompt_len + request.output_len} KV tokens; "
                             f"this instance holds {self.kv_capacity}")
        request.planned = request.prefilled = request.prompt_len
        self.predicted[request.id] = request.output_len if predicted is None else max(predicted, request.generated)
        self.waiting.append(request)

    # memory -------------------------------------------------------------------------------------------------
    def used(self) -> int:
        return sum(r.kv_len for r in self.running.values())

    def committed(self) -> int:
        """KV the admission policy counts as taken (what a dispatcher sees as not free)."""
        if self.admission == "oracle":
            return sum(r.prompt_len + r.output_len for r in self.running.values())
        if self.admission == "greedy":
            return self.used()
        return sum(r.prompt_len + max(self.predicted[r.id], r.generated) for r in self.running.values())

    def _room_for(self, r: Request) -> bool:
        if len(self.running) >= self.max_num_seqs:
            return False
        if self.admission == "greedy":
            return self.used() + r.kv_len + 1 <= self.kv_capacity
        if self.admission != "reserve_dynamic" or not self.running:
            need = r.prompt_len + (r.output_len if self.admission == "oracle" else self.predicted[r.id])
            return self.committed() + need <= self.kv_capacity
        left = {x.id: max(self.predicted[x.id] - x.generated, 1) for x in self.running.values()}
        t = min(left.values())  # steps until the first running request is predicted to finish
        # memory at that moment, before it frees its own: everyone (this one too) grown by t steps
        at_t = sum(x.kv_len + t for x in self.running.values())
        return at_t + r.kv_len + min(t, max(self.predicted[r.id] - r.generated, 1)) <= self.kv_capacity

    # Plan out -----------------------------------------------------------------------------------------------
    def schedule(self, now: float) -> Plan | None:
        if self.in_flight:
            return None
        moves = []
        while self.waiting and self._room_for(self.waiting[0]):
            r = self.waiting.popleft()
            self.running[r.id] = r
            if r.id in self.swapped:
                self.swapped.discard(r.id)
                moves.append(KVMove(request_id=r.id, src=(), dst=self.group, tokens=r.kv_len, kind=MoveKind.SWAP_IN))
        # KV grows by one token per running request; what does not fit goes out, newest first
        while self.running and self.used() + len(self.running) > self.kv_capacity:
            victim = next(reversed(self.running.values()))
            del self.running[victim.id]
            self.swapped.add(victim.id)
            self.waiting.appendleft(victim)
            self.swaps += 1
            moves.append(KVMove(request_id=victim.id, src=self.group, dst=(), tokens=victim.kv_len,
                                kind=MoveKind.SWAP_OUT))
        if not self.running and not moves:
            return None
        items = tuple(WorkItem(r.id, kv, kv + 1, Phase.DECODE, self.group, 1, "zigzag", 0, kv)
                      for r in self.running.values() for kv in (r.kv_len,))
        self.in_flight = True
        return Plan(items, tuple(moves))

    # Outcome in ---------------------------------------------------------------------------------------------
    def apply(self, plan: Plan, outcome: Outcome) -> list[Request]:
        self.in_flight = False
        done = []
        for item in plan.items:
            r = self.running[item.request_id]
            r.add_tokens(len(outcome.tokens.get(r.id, ())), outcome.end_time)
            if r.id in outcome.stopped:
                r.finish(RequestStatus.FINISHED_STOPPED, outcome.end_time)
            if r.finished:
                del self.running[r.id]
                del self.predicted[r.id]
                self.num_finished += 1
                done.append(r)
        return done
