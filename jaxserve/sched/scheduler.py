"""One replica's scheduler: requests in, a Plan per iteration out, state advanced only from Outcomes.

KV memory is reserved for prompt + output when a request is first scheduled (reserve-static), so a running
request never has to be preempted for memory; at most `max_running` requests hold KV at once (vLLM's
max_num_seqs), which bounds the decode batch. A request that ranks first but does not fit yet holds back the
admission of lower-ranked newcomers, so a large request is not overtaken forever by a stream of small ones.

Prefill chunks of one request may be in flight together (stream pipeline parallelism: chunk i+1 enters the
first stage while chunk i is in the second); a decode is planned only once its previous token is back.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from jaxserve.sched.batch_cost import BatchCost
from jaxserve.sched.packer import BatchState, PackerConfig, PrefillTimeCache, pack
from jaxserve.sched.plan import Outcome, Phase, Plan, WorkItem
from jaxserve.sched.policies import Policy
from jaxserve.sched.queue import PrefillQueue
from jaxserve.sched.request import Request
from jaxserve.sched.slo import SLO


class ReplicaScheduler:
    def __init__(self, policy: Policy, cost: BatchCost, packer: PackerConfig, kv_capacity: int,
                 group: tuple[int, ...] = (0,), slo: SLO | None = None, max_running: int = 256,
                 prefill_cache: PrefillTimeCache | None = None):
        self.policy, self.cost, self.packer, self.slo = policy, cost, packer, slo
        self.kv_capacity, self.kv_reserved = kv_capacity, 0
        self.group, self.max_running = group, max_running  # requests holding KV at once: bounds a decode batch
        self.prefill_time = prefill_cache or PrefillTimeCache(cost, packer.t_target, align=packer.chunk_align)
        self.queue = PrefillQueue()  # requests with prompt tokens not yet planned
        self.decoding: dict[str, Request] = {}
        self.admitted: set[str] = set()  # holds a KV reservation
        self.decode_in_flight: set[str] = set()  # a decode token planned, its Outcome not back
        self.finished: list[Request] = []
        self.requests: dict[str, Request] = {}  # every request not finished

    # -- requests in -----------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        need = request.prompt_len + request.output_len
        if need > self.kv_capacity:
            raise ValueError(f"request {request.id} needs {need} KV tokens; this replica holds {self.kv_capacity}")
        if request.id in self.requests:
            raise ValueError(f"request id {request.id} is already in use")
        total = self.prefill_time(request.prompt_len)
        if self.slo is not None:
            if math.isinf(request.ttft_deadline):
                request.ttft_deadline = request.arrival + self.slo.ttft(total)
            if math.isinf(request.tpot_slo):
                request.tpot_slo = self.slo.tpot
        self.requests[request.id] = request
        self.queue.add(request, total, self.prefill_time.remaining(request.prompt_len, request.planned))

    def outstanding_work(self) -> float:
        """Seconds of prefill work queued: what a dispatcher balances."""
        return float(self.queue.column("remaining_work").sum())

    # -- Plan out --------------------------------------------------------------------------------------------
    def schedule(self, now: float) -> Plan | None:
        decodes = [r for r in self.decoding.values() if r.id not in self.decode_in_flight]
        # this decision holds for one iteration, so slack is measured at its end: a request that cannot afford
        # to wait one more iteration ranks as such now, not one iteration too late
        horizon = now + self.packer.t_target
        queued = self.queue.requests
        order = self.policy.order(self.queue, horizon)
        tentative: list[Request] = []

        def fits(r: Request) -> bool:
            return r.id in self.admitted or (len(self.admitted) < self.max_running and
                                             self.kv_reserved + r.prompt_len + r.output_len <= self.kv_capacity)

        def admit(r: Request, yes: bool) -> None:
            self.kv_reserved += (1 if yes else -1) * (r.prompt_len + r.output_len)
            (self.admitted.add if yes else self.admitted.discard)(r.id)
            self.queue.set_admitted(r, yes)

        def candidates() -> Iterator[Request]:
            """Requests in priority order that may get a chunk. A newcomer is reserved KV tentatively (two cannot
            count on the same free memory); once one does not fit, no lower-ranked newcomer is admitted and only
            the admitted rest of the order is walked."""
            for k, i in enumerate(order):
                r = queued[i]
                if r.id not in self.admitted:
                    if not fits(r):
                        rest = order[k + 1:]
                        for j in rest[self.queue.column("admitted")[rest] > 0]:
                            yield queued[j]
                        return
                    admit(r, True)
                    tentative.append(r)
                yield r

        sharing = self.packer.space_sharing and len(order)
        slack = self.policy.relative_slack(self.queue, horizon) if sharing else None

        def more_waiting(r: Request) -> bool:
            """Could a request ranked below r get a chunk, with the memory r now holds? If not, r (a long
            prefill) yields its share of the budget to nobody."""
            last = queued[order[-1]]
            if not fits(last):
                admitted = np.flatnonzero(self.queue.column("admitted")[order] > 0)
                last = queued[order[admitted[-1]]]  # r is admitted: never empty
            return r is not last

        smallest = min(self.packer.chunk_align, int(self.queue.column("left").min(initial=self.packer.chunk_align)))
        chunks, state = pack(self.cost, self.packer, decodes, candidates(),
                             relative_slack=lambda r: float(slack[self.queue.index(r)]),
                             more_waiting=more_waiting, smallest_chunk=smallest)
        if not chunks:
            # The top request's smallest chunk overruns the budget (a huge history, or decodes fill it): run it
            # anyway, or a long prefill would stall for as long as anything decodes.
            first = next(candidates(), None)
            if first is not None:
                n = min(self.packer.chunk_align, first.prompt_len - first.planned)
                chunks = [(first, n)]
                state.tokens += n
                state.attention += self.cost.prefill_attention(n, first.planned)
        chosen = {r.id for r, _ in chunks}
        for r in tentative:
            if r.id not in chosen:
                admit(r, False)
        if not chunks and not decodes:
            return None
        group, decode = self.group, Phase.DECODE
        items = [WorkItem(r.id, kv, kv + 1, decode, group, 1, "zigzag", 0, kv)
                 for r in decodes for kv in (r.kv_len,)]
        for r, n in chunks:
            items.append(WorkItem(r.id, r.planned, r.planned + n, Phase.PREFILL, group, history=r.planned))
            r.planned += n
            if r.planned < r.prompt_len:
                self.queue.set_remaining(r, self.prefill_time.remaining(r.prompt_len, r.planned))
            else:
                self.queue.remove(r)
        self.decode_in_flight.update(r.id for r in decodes)
        return Plan(tuple(items), predicted_time=state.time(self.cost))

    # -- Outcome in ------------------------------------------------------------------------------------------
    def apply(self, plan: Plan, outcome: Outcome) -> list[Request]:
        """Advance state from an executed Plan; returns the requests that finished."""
        done = []
        for item in plan.items:
            r = self.requests[item.request_id]
            if item.phase is Phase.PREFILL:
                r.prefilled = max(r.prefilled, item.end)
                if r.in_prefill:
                    continue
            else:
                self.decode_in_flight.discard(r.id)
            r.add_tokens(len(outcome.tokens.get(r.id, ())), outcome.end_time)
            if r.id in outcome.stopped and not r.finished:
                r.finished_at = outcome.end_time
            if r.finished:
                self._finish(r)
                done.append(r)
            else:
                self.decoding[r.id] = r
        return done

    def _finish(self, r: Request) -> None:
        self.decoding.pop(r.id, None)
        if r in self.queue:  # stopped before its prompt was fully planned (an engine abort)
            self.queue.remove(r)
        del self.requests[r.id]
        self.admitted.discard(r.id)
        self.kv_reserved -= r.prompt_len + r.output_len
        self.finished.append(r)
