"""One replica's scheduler: requests in, a Plan per iteration out, state advanced only from Outcomes.

KV memory is reserved for prompt + output when a request is first scheduled (reserve-static), so a running
request never has to be preempted for memory; the rest wait in the prefill queue.
"""

from __future__ import annotations

from typing import Iterator

from jaxserve.sched.batch_cost import BatchCost
from jaxserve.sched.packer import PackerConfig, PrefillTimeCache, pack
from jaxserve.sched.plan import Outcome, Phase, Plan, WorkItem
from jaxserve.sched.policies import Policy
from jaxserve.sched.queue import PrefillQueue
from jaxserve.sched.request import Request
from jaxserve.sched.slo import SLO


class ReplicaScheduler:
    def __init__(self, policy: Policy, cost: BatchCost, packer: PackerConfig, kv_capacity: int,
                 group: tuple[int, ...] = (0,), slo: SLO | None = None, max_decode_batch: int = 256,
                 prefill_cache: PrefillTimeCache | None = None):
        self.policy, self.cost, self.packer, self.slo = policy, cost, packer, slo
        self.kv_capacity, self.kv_reserved = kv_capacity, 0
        self.group, self.max_decode_batch = group, max_decode_batch
        self.prefill_time = prefill_cache or PrefillTimeCache(cost, packer.t_target, align=packer.chunk_align)
        self.queue = PrefillQueue()
        self.decoding: dict[str, Request] = {}
        self.admitted: set[str] = set()  # holds a KV reservation
        self.in_flight: set[str] = set()  # in a Plan whose Outcome has not come back (pipeline stages)
        self.finished: list[Request] = []
        self._requests: dict[str, Request] = {}

    # -- requests in -----------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        need = request.prompt_len + request.output_len
        if need > self.kv_capacity:
            raise ValueError(f"request {request.id} needs {need} KV tokens; this replica holds {self.kv_capacity}")
        if request.id in self._requests:
            raise ValueError(f"request id {request.id} is already in use")
        total = self.prefill_time(request.prompt_len)
        if self.slo is not None and request.ttft_deadline == float("inf"):
            request.ttft_deadline = request.arrival + self.slo.ttft(total)
            request.tpot_slo = self.slo.tpot
        self._requests[request.id] = request
        self.queue.add(request, total, self.prefill_time.remaining(request.prompt_len, request.prefilled))

    @property
    def pending(self) -> int:
        return len(self._requests)

    def outstanding_work(self) -> float:
        """Seconds of prefill work queued: what a dispatcher balances."""
        return float(self.queue.column("remaining_work").sum())

    # -- Plan out --------------------------------------------------------------------------------------------
    def schedule(self, now: float) -> Plan | None:
        decodes = list(self.decoding.values())
        if self.in_flight:
            decodes = [r for r in decodes if r.id not in self.in_flight]
        decodes = decodes[: self.max_decode_batch]
        # this decision holds for one iteration, so slack is measured at its end: a request that cannot afford
        # to wait one more iteration ranks as such now, not one iteration too late
        horizon = now + self.packer.t_target
        order = self.policy.order(self.queue, horizon)
        slack = self.policy.relative_slack(self.queue, horizon) if self.packer.space_sharing else None
        last = self.queue.requests[order[-1]] if len(order) else None
        tentative: list[Request] = []

        def candidates() -> Iterator[Request]:
            """Requests in priority order; each newly looked at gets a tentative KV reservation, so two cannot
            both count on the same free memory."""
            for i in order:
                r = self.queue.requests[i]
                if r.id in self.in_flight:
                    continue
                if r.id not in self.admitted:
                    need = r.prompt_len + r.output_len
                    if self.kv_reserved + need > self.kv_capacity:
                        continue
                    self.kv_reserved += need
                    self.admitted.add(r.id)
                    tentative.append(r)
                yield r

        chunks, state = pack(self.cost, self.packer, decodes, candidates(),
                         relative_slack=lambda r: float(slack[self.queue.index(r)]),
                         more_waiting=lambda r: r is not last)
        if not chunks and not decodes:
            first = next(candidates(), None)
            if first is None:
                return None
            # even the smallest chunk overruns the budget (a huge history): run it anyway, or nothing moves
            n = min(self.packer.chunk_align, first.prompt_len - first.prefilled)
            chunks = [(first, n)]
            state.tokens, state.attention = n, self.cost.prefill_attention(n, first.prefilled)
        chosen = {r.id for r, _ in chunks}
        for r in tentative:
            if r.id not in chosen:
                self.kv_reserved -= r.prompt_len + r.output_len
                self.admitted.discard(r.id)
        group, decode = self.group, Phase.DECODE
        items = [WorkItem(r.id, kv, kv + 1, decode, group, 1, "zigzag", 0, kv)
                 for r in decodes for kv in (r.kv_len,)]
        items += [WorkItem(r.id, r.prefilled, r.prefilled + n, Phase.PREFILL, self.group, history=r.prefilled)
                  for r, n in chunks]
        plan = Plan(tuple(items), predicted_time=state.time(self.cost))
        self.in_flight |= plan.request_ids
        return plan

    # -- Outcome in ------------------------------------------------------------------------------------------
    def apply(self, plan: Plan, outcome: Outcome) -> list[Request]:
        """Advance state from an executed Plan; returns the requests that finished."""
        done = []
        for item in plan.items:
            r = self._requests[item.request_id]
            if item.phase is Phase.PREFILL:
                r.prefilled = item.end
                if r.in_prefill:
                    self.queue.set_remaining(r, self.prefill_time.remaining(r.prompt_len, r.prefilled))
                    continue
                self.queue.remove(r)
            r.add_tokens(len(outcome.tokens.get(r.id, ())), outcome.end_time)
            if r.id in outcome.stopped and not r.finished:
                r.finished_at = outcome.end_time
            if r.finished:
                self._finish(r)
                done.append(r)
            elif not r.in_prefill:
                self.decoding[r.id] = r
        self.in_flight -= plan.request_ids
        return done

    def _finish(self, r: Request) -> None:
        self.decoding.pop(r.id, None)
        del self._requests[r.id]
        self.admitted.discard(r.id)
        self.kv_reserved -= r.prompt_len + r.output_len
        self.finished.append(r)
