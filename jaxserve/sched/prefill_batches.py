"""TetriInfer's prefill instance (3.3.1, 3.3.3): a raw queue, a scheduled queue filled one scheduling batch
(PrefillSchedBatch) at a time, and prefill in fixed-size chunks.

- Scheduling batch: when the scheduled queue runs dry, the oldest `batch` raw requests (or fewer, if fewer wait)
  are sorted by the policy (FCFS: arrival order; SJF / LJF: prompt length up / down, ties by arrival) and
  become the scheduled queue. Arrivals meanwhile wait in the raw queue, so no request waits behind more than
  the batch in progress and the one it joins.
- Non-preemptive: the scheduled queue is consumed in order, so a prompt once started is finished (on this
  instance) before any later one starts.
- Fixed-size chunks: each iteration runs one chunk of exactly `chunk` tokens (the accelerator's saturation
  point, ChunkSize): the scheduled prompts are sliced and merged in order, and the last chunk of a scheduling
  batch is padded to `chunk` with zeros. A chunk costs what a batch of its pieces (each after its own history)
  plus the padding tokens costs: padding runs through every linear op but attends to nothing (masked).

Plan -> Outcome like every scheduler here: a Plan holds one chunk's pieces; apply() advances the prefills and
returns the requests whose prompt is done (their first token is in the Outcome).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

from jaxserve.sched.batch_cost import BatchCost, BatchState
from jaxserve.sched.plan import Outcome, Phase, Plan, WorkItem
from jaxserve.sched.request import Request

ORDERS = ("fcfs", "sjf", "ljf")


def chunk_time(cost: BatchCost, items: Sequence[WorkItem], chunk: int) -> float:
    """Seconds for one fixed-size chunk holding `items` (prefill pieces), padded to `chunk` tokens."""
    state = BatchState()
    for i in items:
        state = cost.add_prefill(state, i.tokens, i.history)
    return cost.time(dataclasses.replace(state, tokens=max(state.tokens, chunk)))


def least_queued(instances: Sequence["PrefillBatchScheduler"]) -> int:
    """TetriInfer's global scheduler: an arrival joins the instance with the fewest prompt tokens left to prefill
    (ties: the lowest index)."""
    return min(range(len(instances)), key=lambda i: (instances[i].queued_tokens(), i))


class PrefillBatchScheduler:
    def __init__(self, chunk: int = 512, batch: int = 16, order: str = "sjf", group: tuple[int, ...] = (0,)):
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if chunk < 1 or batch < 1:
            raise ValueError(f"chunk and batch must be >= 1, got {chunk} and {batch}")
        self.chunk, self.batch, self.order, self.group = chunk, batch, order, group
        self.raw: collections.deque[Request] = collections.deque()  # arrival order
        self.scheduled: collections.deque[Request] = collections.deque()  # the batch in progress, sorted
        self.requests: dict[str, Request] = {}  # every request whose prefill is not done
        self.in_flight = False

    def add(self, request: Request) -> None:
        if request.id in self.requests:
            raise ValueError(f"request {request.id} is already queued")
        self.requests[request.id] = request
        self.raw.append(request)

    def remove(self, request_id: str) -> None:
        """Drop a request (aborted); a chunk in flight with its piece still applies to the others."""
        r = self.requests.pop(request_id, None)
        if r is not None:
            for queue in (self.raw, self.scheduled):
                if r in queue:
                    queue.remove(r)

    def queued_tokens(self) -> int:
        """Prompt tokens not yet prefilled: the load a global scheduler balances over instances."""
        return sum(r.prompt_len - r.prefilled for r in self.requests.values())

    def yields_token(self, item: WorkItem) -> bool:
        """Whether the item ends its prompt (the executor samples the first token there)."""
        return item.end == self.requests[item.request_id].prompt_len

    def _next_batch(self) -> None:
        take = [self.raw.popleft() for _ in range(min(self.batch, len(self.raw)))]
        if self.order != "fcfs":  # sorted() is stable: equal lengths keep arrival order
            take = sorted(take, key=lambda r: r.prompt_len, reverse=self.order == "ljf")
        self.scheduled.extend(take)

    def schedule(self, now: float) -> Plan | None:
        """The next chunk: the scheduled queue's heads, sliced and merged into `chunk` tokens (the rest is
        padding). None while a chunk is in flight or nothing waits."""
        if self.in_flight:
            return None
        if not self.scheduled:
            self._next_batch()
        items, room = [], self.chunk
        for r in self.scheduled:  # in order; everything but the last piece is a whole remaining prompt
            n = min(r.prompt_len - r.planned, room)
            items.append(
                WorkItem(
                    request_id=r.id,
                    start=r.planned,
                    end=r.planned + n,
                    phase=Phase.PREFILL,
                    group=self.group,
                    history=r.planned,
                )
            )
            r.planned += n
            room -= n
            if not room:
                break
        if not items:
            return None
        self.in_flight = True
        return Plan(tuple(items))

    def cancel(self, plan: Plan) -> None:
        """The executor could not run this chunk: its pieces are planned again (the instance is free)."""
        self.in_flight = False
        for item in plan.items:
            r = self.requests.get(item.request_id)
            if r is not None:
                r.planned = min(r.planned, item.start)

    def apply(self, plan: Plan, outcome: Outcome) -> list[Request]:
        """Advance the chunk's prompts; those it finished leave the queue, with their first token."""
        self.in_flight = False
        done = []
        for item in plan.items:
            r = self.requests.get(item.request_id)
            if r is None:  # removed while its chunk ran
                continue
            r.prefilled = item.end
            if r.prefilled == r.prompt_len:
                r.add_tokens(len(outcome.tokens.get(r.id, ())), outcome.end_time)
                del self.requests[r.id]
                done.append(r)
        while self.scheduled and self.scheduled[0].id not in self.requests:
            self.scheduled.popleft()
        return done
