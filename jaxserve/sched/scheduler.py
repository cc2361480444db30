"""One replica's scheduler: requests in, a Plan per iteration out, state advanced only from Outcomes. The same
object drives the live engine and the simulator.

It owns the KV cache (kv_manager.KVCacheManager) and allocates on demand: a chunk gets the blocks it writes when
it is planned, a decode one slot per token. When a decode finds no free block, the most recently admitted
request is preempted: its blocks go back (free but still cached), it re-enters the queue keeping its place, and
it later recomputes, mostly from prefix-cache hits; likewise when nothing decodes and the blocks are all held by
half-done prefills, so that the top one could never get its next chunk. A step that preempted admits nothing
new. At most `max_num_seqs` requests hold KV at once, which bounds the decode batch. A
request that ranks first but does not fit yet holds back the admission of lower-ranked newcomers, so a large
request is not overtaken forever by a stream of small ones.

Prefill chunks of one request may be in flight together (stream pipeline parallelism: chunk i+1 enters the
first stage while chunk i is in the second). A decode is planned once its previous token is back, or, in a
lagged schedule, while that token is still in flight: the executor then feeds the in-flight token on the device
(its value is not known here yet), so it can dispatch the next step before it reads the last. A request with
work in flight is never preempted.

Multi-step decode (vLLM's num_scheduler_steps): when nothing waits to be prefilled, a Plan of decodes alone may
run up to num_scheduler_steps decode steps in one device loop, each row up to its own share (Plan.steps,
WorkItem.tokens). It runs as many steps as fit the iteration's time budget together (so a prompt arriving
meanwhile waits for about one budget, two in a lagged schedule), as some row still has tokens for, and as every
row has free KV blocks for without preempting anyone; one step fitting, the Plan is a plain one. A burst's tokens
arrive together: the request's token gaps inside it are 0. No burst runs while a decoding request is single_step
(structured output: each token's mask comes from the host).

Admission of requests prefilled elsewhere (`reserve`, a decode instance of a cluster; TetriInfer 3.4), with a
request's predicted decode length (the upper end; its max_tokens without one):
- greedy (vLLM): blocks for the prompt while they are free; KV grows a token per step, and a request that no
  longer fits is preempted and recomputes here;
- reserve_static: only while every holder's prompt + predicted decode, and this one's, fit the cache;
- reserve_dynamic: while there is room at the moment the holder with the least predicted decode left finishes
  (everyone's KV grown by then): less memory held back than reserve_static.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from jaxserve.sched.batch_cost import BatchCost
from jaxserve.sched.kv_manager import KVCacheManager
from jaxserve.sched.packer import PackerConfig, PrefillTimeCache, pack
from jaxserve.sched.plan import Outcome, Phase, Plan, WorkItem
from jaxserve.sched.policies import Policy
from jaxserve.sched.queue import PrefillQueue
from jaxserve.sched.request import Request, RequestStatus
from jaxserve.config import DECODE_ADMISSION, SLO


DECODING = RequestStatus.DECODING
RESUMED_SEQ = -(2**40)  # arrival places of resumed requests: before every newcomer's (from 0)


class ReplicaScheduler:
    def __init__(
        self,
        policy: Policy,
        cost: BatchCost,
        packer: PackerConfig,
        kv: KVCacheManager,
        group: tuple[int, ...] = (0,),
        slo: SLO | None = None,
        max_num_seqs: int = 256,
        prefill_cache: PrefillTimeCache | None = None,
        num_scheduler_steps: int = 1,
        admission: str = "greedy",
    ):
        if not isinstance(num_scheduler_steps, int) or num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be an integer >= 1, got {num_scheduler_steps!r}")
        if admission not in DECODE_ADMISSION:
            raise ValueError(f"admission must be one of {', '.join(DECODE_ADMISSION)}, got {admission!r}")
        self.admission = admission
        self._predicted: dict[str, int] = {}  # a reserved request's predicted decode length (upper end)
        self.num_scheduler_steps = num_scheduler_steps
        self.policy, self.cost, self.packer, self.slo, self.kv = policy, cost, packer, slo, kv
        self.group, self.max_num_seqs = group, max_num_seqs
        self.prefill_time = prefill_cache or PrefillTimeCache.for_packer(cost, packer)
        self.queue = PrefillQueue()  # requests with prefill tokens not yet planned
        self.running: dict[str, Request] = {}  # requests holding KV, in admission order (the last is preempted first)
        self.decode_in_flight: dict[str, list[int]] = {}  # tokens of each decode Plan not back, oldest first
        self.requests: dict[str, Request] = {}  # every request not finished
        self._seq: dict[str, int] = {}  # arrival order, kept through preemptions
        self._resumed = 0  # requests resumed from elsewhere so far

    @property
    def decoding(self) -> list[Request]:
        """Running requests past their prefill, in admission order."""
        return [r for r in self.running.values() if r.status is DECODING]

    @property
    def kv_capacity(self) -> int:
        """Tokens the KV cache holds."""
        return self.kv.capacity * self.kv.block_size

    # -- requests in -----------------------------------------------------------------------------------------
    def _check_new(self, request: Request) -> None:
        need = request.prompt_len + request.output_len - 1  # the last token is never fed back
        if need > self.kv_capacity:
            raise ValueError(f"request {request.id} needs {need} KV tokens; this replica holds {self.kv_capacity}")
        if request.id in self.requests:
            raise ValueError(f"request id {request.id} is already in use")

    def add(self, request: Request) -> None:
        self._check_new(request)
        total = self.prefill_time(request.prefill_target)  # a resumed request's: its tokens too
        if self.slo is not None:
            if math.isinf(request.ttft_deadline):
                request.ttft_deadline = request.arrival + self.slo.ttft(total)
            if math.isinf(request.tpot_slo):
                request.tpot_slo = self.slo.tpot_slo
        seq = None
        if request.generated:  # resumed from elsewhere (a fail-over): its stream stalls until it decodes here, so
            # it goes before every newcomer (whose first token can wait) under every policy, in its arrival order
            request.ttft_deadline = -math.inf
            seq, self._resumed = RESUMED_SEQ + self._resumed, self._resumed + 1
        self.requests[request.id] = request
        self._seq[request.id] = self.queue.add(request, total, seq=seq)

    def reserve(self, request: Request, predicted: int | None = None) -> list[int] | None:
        """Blocks for the prompt of a request prefilled elsewhere (disaggregation), for its KV to land in; None
        (nothing changes) while they are not free, the batch is full or the admission policy holds it back.
        predicted: its predicted decode length (None: its max_tokens). From here the request holds KV but is not
        planned (nor preempted: its prefill counts as in flight) until add_prefilled."""
        self._check_new(request)
        if len(self.running) >= self.max_num_seqs:
            return None
        decode = max(request.output_len if predicted is None else min(predicted, request.output_len), 1)
        if not self._admits(request, decode):
            return None
        blocks = self.kv.allocate(request.id, request.prompt_len)
        if blocks is None:
            return None
        self._predicted[request.id] = decode
        request.planned, request.prefilled = request.prompt_len, 0
        request.status = RequestStatus.AWAITING_KV
        self.requests[request.id] = request
        self._seq[request.id] = self.queue.new_seq()
        self.running[request.id] = request
        return blocks

    def prefilled_elsewhere(self, request: Request, outcome: Outcome) -> None:
        """The Outcome of a prompt prefilled elsewhere (disaggregation): its first token, counted whether or not
        its KV has landed here yet."""
        tokens = outcome.tokens.get(request.id, ())
        if request.token_ids is not None:
            request.token_ids.extend(tokens)
        request.add_tokens(len(tokens), outcome.end_time)

    def committed(self) -> int:
        """KV tokens the admission policy counts as taken: what the requests hold (greedy), or every holder's
        prompt and predicted decode (reserving)."""
        if self.admission == "greedy":
            return (self.kv.capacity - self.kv.num_free) * self.kv.block_size
        return sum(_promised(r, self._decode(r)) for r in self.running.values())

    def _admits(self, request: Request, decode: int) -> bool:
        """The admission policy's check for a request prefilled elsewhere, predicted to decode `decode` tokens."""
        if self.admission == "greedy":
            return True
        holders = list(self.running.values())
        if self.admission == "reserve_static" or not holders:
            return self.committed() + _promised(request, decode) <= self.kv_capacity
        left = [max(self._decode(r) - r.generated, 1) for r in holders]
        t = min(left)  # steps until the first holder is predicted to finish
        # memory at that moment, before it frees its own: everyone (this one too) grown by t steps
        at_t = sum(_held(r) + t for r in holders)
        return at_t + _held(request) + min(t, max(decode - request.generated, 1)) <= self.kv_capacity

    def _decode(self, r: Request) -> int:
        """The decode length a holder's admission counts: its reserved prediction (its max_tokens otherwise)."""
        return self._predicted.get(r.id, r.output_len)

    def add_prefilled(self, request: Request) -> None:
        """Its prompt's KV has landed in the reserved blocks and its first token is counted: it decodes from the
        next Plan on."""
        if request.status is not RequestStatus.AWAITING_KV or request.generated < 1:
            raise ValueError(f"request {request.id} must hold reserved blocks and have its first token")
        request.prefilled = request.prompt_len
        if request.token_ids is not None:
            self.kv.commit(request.id, request.token_ids, request.prompt_len)
        request.status = DECODING

    def abort(self, request_id: str) -> Request | None:
        """End a request at once (client gone): its blocks go back; an Outcome still in flight for it is ignored."""
        r = self.requests.get(request_id)
        if r is not None:
            r.status = RequestStatus.FINISHED_ABORTED
            self._finish(r)
        return r

    def use_cost(self, cost: BatchCost, packer: PackerConfig) -> None:
        """Plan with another cost model from now on (one measured after a quick start). Only while no request
        is held: their deadlines and prefill times came from the old one."""
        if self.requests:
            raise RuntimeError("the cost model changes only while the scheduler holds no request")
        self.cost, self.packer, self.prefill_time = cost, packer, PrefillTimeCache.for_packer(cost, packer)

    def drop_all_kv(self) -> None:
        """The executor lost the cache's contents (a failed step deleted its buffers): every request holding KV
        recomputes, and no cached prefix may be hit again. Work in flight is forgotten: no Outcome of it may be
        applied."""
        for r in list(self.running.values()):
            self._preempt(r, {}, [])
        self.decode_in_flight.clear()
        self.kv.reset_prefix_cache()

    def outstanding_work(self) -> float:
        """Seconds of prefill work queued: what a dispatcher balances."""
        return float(self.queue.column("remaining_work").sum())

    def yields_token(self, item: WorkItem) -> bool:
        """Does this item sample a token the request keeps? Decodes do, and the last chunk of a first prefill;
        a recompute after preemption ends where the next decode feeds the last token it had."""
        r = self.requests[item.request_id]
        return item.phase is Phase.DECODE or (item.end == r.prefill_target and r.generated == 0)

    # -- Plan out --------------------------------------------------------------------------------------------
    def schedule(self, now: float, lagged: bool = False) -> Plan | None:
        """The next Plan. lagged: the previous Plan is still running, so a decode whose token is in flight gets
        its next decode too (at most one ahead; not past its output_len; only into a free block, never by
        preempting). The simulator plans synchronously."""
        grants: dict[str, list[int]] = {}
        preempted: list[str] = []
        if self.num_scheduler_steps > 1 and not len(self.queue):
            burst = self._burst(grants, lagged)
            if burst is not None:
                return burst
        decodes = self._grant_decodes(grants, preempted, lagged)
        # this decision holds for one iteration, so slack is measured at its end: a request that cannot afford
        # to wait one more iteration ranks as such now, not one iteration too late
        horizon = now + self.packer.iteration_budget
        queued = self.queue.requests
        order = self.policy.order(self.queue, horizon)
        tentative: list[Request] = []
        smallest = min(self.packer.chunk_align, int(self.queue.column("left").min(initial=self.packer.chunk_align)))

        def could_admit(r: Request) -> bool:
            """Room for a newcomer's first (smallest) chunk, before any prefix hit."""
            return (
                not preempted
                and len(self.running) < self.max_num_seqs
                and self.kv.num_free >= self.kv.blocks_for(min(smallest, r.prefill_target))
            )

        def admitted(r: Request) -> bool:
            """Admit a newcomer tentatively: take its prefix hits, then check its first chunk has room."""
            if preempted or len(self.running) >= self.max_num_seqs:
                return False
            self._admit(r, grants)
            need = self.kv.blocks_for(r.planned + min(smallest, r.prefill_target - r.planned))
            if self.kv.num_free < need - self.kv.num_blocks_held(r.id):
                self._unadmit(r, grants)
                return False
            tentative.append(r)
            return True

        def candidates() -> Iterator[Request]:
            """Requests in priority order that may get a chunk. A newcomer is admitted tentatively (two cannot
            count on the same free memory); once one does not fit, no lower-ranked newcomer is admitted and only
            the running rest of the order is walked."""
            for k, i in enumerate(order):
                r = queued[i]
                if r.id not in self.running:
                    if not admitted(r):
                        rest = order[k + 1 :]
                        for j in rest[self.queue.column("admitted")[rest] > 0]:
                            yield queued[j]
                        return
                    if not r.in_prefill:  # every token it needs was cached: it decodes from the next step
                        continue
                yield r

        sharing = self.packer.space_sharing and len(order)
        slack = self.policy.relative_slack(self.queue, horizon) if sharing else None

        def more_waiting(r: Request) -> bool:
            """Could a request ranked below r get a chunk, with the memory r now holds? If not, r (a long
            prefill) yields its share of the budget to nobody."""
            last = queued[order[-1]]
            if last.id not in self.running and not could_admit(last):
                running = np.flatnonzero(self.queue.column("admitted")[order] > 0)
                last = queued[order[running[-1]]]  # r is running: never empty
            return r is not last

        room = _Room(self.kv, grants)
        chunks, state = pack(
            self.cost,
            self.packer,
            decodes,
            candidates(),
            relative_slack=lambda r: float(slack[self.queue.index(r)]),
            more_waiting=more_waiting,
            smallest_chunk=smallest,
            room=room,
        )
        if not chunks:
            # The top request's smallest chunk overruns the budget (a huge history, or decodes fill it): run it
            # anyway, or a long prefill would stall for as long as anything decodes.
            first = next(candidates(), None)
            if first is not None and not decodes:
                self._make_room(first, grants, preempted, tentative)
            n = (
                0
                if first is None
                else min(self.packer.chunk_align, first.prefill_target - first.planned, room.limit(first))
            )
            if n > 0:
                room.take(first, n)
                chunks = [(first, n)]
                state = self.cost.add_prefill(state, n, first.planned)
        chosen = {r.id for r, _ in chunks}
        for r in tentative:
            if r.id not in chosen and r.in_prefill:
                self._unadmit(r, grants)
            elif not r.in_prefill:
                self.queue.remove(r)
                r.status = DECODING
        blocks = _granted(grants)
        if not chunks and not decodes:
            # a Plan of no work still tells the executor of preemptions, and of the tables of requests admitted
            # with every token cached (they decode from the next Plan, which grants only their new blocks)
            return Plan((), blocks=blocks, preempted=tuple(preempted)) if preempted or blocks else None
        group, decode = self.group, Phase.DECODE
        items = [
            WorkItem(request_id=r.id, start=kv, end=kv + 1, phase=decode, group=group, history=kv)
            for r in decodes
            for kv in (self._next_position(r),)
        ]
        for r, n in chunks:
            items.append(
                WorkItem(
                    request_id=r.id,
                    start=r.planned,
                    end=r.planned + n,
                    phase=Phase.PREFILL,
                    group=group,
                    history=r.planned,
                )
            )
            r.planned += n
            if r.planned < r.prefill_target:
                self.queue.set_remaining(r, self.prefill_time.remaining(r.prefill_target, r.planned))
            else:
                self.queue.remove(r)
        for r in decodes:
            self.decode_in_flight.setdefault(r.id, []).append(1)
        return Plan(tuple(items), predicted_time=state.time(self.cost), blocks=blocks, preempted=tuple(preempted))

    def _grant_decodes(self, grants: dict[str, list[int]], preempted: list[str], lagged: bool) -> list[Request]:
        """A KV slot for each decode's token, oldest admission first; preempt the newest when none is free. In a
        lagged schedule a decode in flight gets the slot after its in-flight token's, if one is free."""
        decodes = []
        for r in self.decoding:
            if r.id not in self.running:  # preempted for an older request's token
                continue
            if r.id in self.decode_in_flight:
                if self._tokens_left(r, lagged) <= 0:
                    continue
                new = self.kv.allocate(r.id, self._next_position(r) + 1)  # none free: it waits for its token
            else:
                while (new := self.kv.allocate(r.id, r.kv_len + 1)) is None:
                    victim = next(v for v in reversed(self.running.values()) if not self._in_flight(v))
                    self._preempt(victim, grants, preempted)
                    if victim is r:
                        break
            if new is not None:
                grants.setdefault(r.id, []).extend(new)
                decodes.append(r)
        return decodes

    def _next_position(self, r: Request) -> int:
        """Where r's next decode starts: after its cached tokens and the decode tokens in flight."""
        return r.kv_len + sum(self.decode_in_flight.get(r.id, ()))

    def _tokens_left(self, r: Request, lagged: bool) -> int:
        """Decode tokens r may be planned now: none while a Plan of it is in flight, unless lagged (then one
        Plan ahead), and none past its output_len."""
        flying = self.decode_in_flight.get(r.id, ())
        if flying and (not lagged or len(flying) > 1):
            return 0
        return r.output_len - r.generated - sum(flying)

    def _burst(self, grants: dict[str, list[int]], lagged: bool) -> Plan | None:
        """A multi-step decode Plan of every decode that may run, or None where a plain Plan serves as well (a
        burst of one step) or better (a decode that needs a block not free: the plain path may preempt)."""
        rows = [
            (r, self._next_position(r), left)
            for r in self.decoding
            for left in (self._tokens_left(r, lagged),)
            if left > 0
        ]
        if not rows or any(r.single_step for r, _, _ in rows):
            return None
        free, most = self.kv.num_free, min(self.num_scheduler_steps, max(left for _, _, left in rows))

        def need(k: int) -> int:
            return sum(
                max(self.kv.blocks_for(start + min(k, left)) - self.kv.num_blocks_held(r.id), 0)
                for r, start, left in rows
            )

        steps, time = 0, 0.0
        for t in self.cost.burst_steps([(start, left) for _, start, left in rows]):
            if steps == most or time + t > self.packer.iteration_budget or need(steps + 1) > free:
                break
            steps, time = steps + 1, time + t
        if steps < 2:
            return None
        items = []
        for r, start, left in rows:
            n = min(steps, left)
            new = self.kv.allocate(r.id, start + n)
            assert new is not None, "need() counted these blocks free"
            if new:
                grants[r.id] = new
            items.append(
                WorkItem(
                    request_id=r.id, start=start, end=start + n, phase=Phase.DECODE, group=self.group, history=start
                )
            )
            self.decode_in_flight.setdefault(r.id, []).append(n)
        return Plan(tuple(items), predicted_time=time, blocks=_granted(grants), steps=steps)

    def _make_room(
        self, first: Request, grants: dict[str, list[int]], preempted: list[str], tentative: list[Request]
    ) -> None:
        """Nothing decodes and `first` (the top request) has no block for its next chunk: the blocks are all held
        by requests halfway through their prefills, none of which could ever finish. Preempt the most recently
        admitted of them (all rank below `first`; none with work in flight) until first's next chunk fits."""
        need = self.kv.blocks_for(first.planned + min(self.packer.chunk_align, first.prefill_target - first.planned))
        while self.kv.num_free + self.kv.num_blocks_held(first.id) < need:
            victim = next(
                (
                    v
                    for v in reversed(self.running.values())
                    if v is not first and v not in tentative and not self._in_flight(v)
                ),
                None,
            )
            if victim is None:
                return
            self._preempt(victim, grants, preempted)

    def _in_flight(self, r: Request) -> bool:
        return r.id in self.decode_in_flight or r.planned > r.prefilled

    def _admit(self, r: Request, grants: dict[str, list[int]]) -> None:
        """Take a newcomer's prefix-cache hits: a first prefill keeps its last prompt token to compute (its logits
        give the first output token); a recompute may find everything cached and go straight to decoding."""
        if r.token_ids is not None:  # simulated requests have no ids to hash
            limit = r.prefill_target - (1 if r.generated == 0 else 0)
            r.planned = r.prefilled = self.kv.match_prefix(r.id, r.token_ids, limit)
            if r.preemptions == 0:
                r.cached_tokens = r.prefilled
        self.running[r.id] = r
        r.status = RequestStatus.PREFILLING
        self.queue.set_admitted(r, True)
        grants[r.id] = self.kv.block_table(r.id)

    def _unadmit(self, r: Request, grants: dict[str, list[int]]) -> None:
        self.kv.free(r.id)
        r.planned = r.prefilled = 0
        del self.running[r.id]
        r.status = RequestStatus.PREEMPTED if r.preemptions else RequestStatus.WAITING
        self.queue.set_admitted(r, False)
        grants.pop(r.id, None)

    def _preempt(self, r: Request, grants: dict[str, list[int]], preempted: list[str]) -> None:
        self.kv.free(r.id)
        del self.running[r.id]
        grants.pop(r.id, None)
        preempted.append(r.id)
        if r in self.queue:
            self.queue.remove(r)
        r.preempt()
        self.queue.add(r, self.prefill_time(r.prefill_target), seq=self._seq[r.id])

    # -- Outcome in ------------------------------------------------------------------------------------------
    def apply(self, plan: Plan, outcome: Outcome) -> list[Request]:
        """Advance state from an executed Plan; returns the requests that finished."""
        done = []
        for item in plan.items:
            r = self.requests.get(item.request_id)
            if r is None:  # aborted while its Plan ran
                continue
            tokens = outcome.tokens.get(r.id, ())
            computed = item.end  # tokens whose KV is written: a burst's row ends early where it stopped
            if item.phase is Phase.PREFILL:
                r.prefilled = max(r.prefilled, item.end)
            else:
                flying = self.decode_in_flight.get(r.id)
                if flying:
                    flying.pop(0)
                    if not flying:
                        del self.decode_in_flight[r.id]
                computed = item.start + len(tokens)
            if r.token_ids is not None:
                r.token_ids.extend(tokens)
                self.kv.commit(r.id, r.token_ids, computed)
            if item.phase is Phase.PREFILL and r.in_prefill:
                continue
            r.add_tokens(len(tokens), outcome.end_time)
            if r.id in outcome.stopped:
                r.finish(RequestStatus.FINISHED_STOPPED, outcome.end_time)
            if r.finished:
                self._finish(r)
                done.append(r)
            else:
                r.status = DECODING
        return done

    def _finish(self, r: Request) -> None:
        self.kv.free(r.id)
        self.running.pop(r.id, None)
        self.decode_in_flight.pop(r.id, None)
        if r in self.queue:  # stopped before its prompt was fully planned (an abort)
            self.queue.remove(r)
        del self.requests[r.id]
        del self._seq[r.id]
        self._predicted.pop(r.id, None)


def _promised(r: Request, decode: int) -> int:
    """KV tokens a request will hold if it decodes `decode` tokens (or as many as it has)."""
    return r.prompt_len + max(decode, r.generated)


def _held(r: Request) -> int:
    """KV tokens a request holds once its prompt is in: the prompt and every generated token fed back."""
    return r.prompt_len + max(r.generated - 1, 0)


def _granted(grants: dict[str, list[int]]) -> dict[str, tuple[int, ...]]:
    """A Plan's `blocks`: the requests granted any."""
    return {rid: tuple(ids) for rid, ids in grants.items() if ids}


class _Room:
    """The packer's view of free KV: a chunk may grow its request's blocks into what is free, and taking it
    allocates at once, so the next chunk sees what is left."""

    def __init__(self, kv: KVCacheManager, grants: dict[str, list[int]]):
        self.kv, self.grants = kv, grants

    def limit(self, r: Request) -> int:
        return (self.kv.num_blocks_held(r.id) + self.kv.num_free) * self.kv.block_size - r.planned

    def take(self, r: Request, n: int) -> None:
        new = self.kv.allocate(r.id, r.planned + n)
        assert new is not None, "limit() promised these blocks"
        self.grants.setdefault(r.id, []).extend(new)
