"""The cluster's policies: each makes one paper's cluster decisions, for the live cluster (cluster/engine.py,
cluster/tetriinfer.py, cluster/esp.py) and the simulators (sim/disagg.py, sim/prefill_pool.py, and the lab's
LoongServe model, lab/esp_cluster.py) alike. What they share is ClusterPolicy's: decode dispatch and the length
predictor.

- ClusterPolicy: decode dispatch (`dispatch`) by freeness or power of two, from the predicted decode length;
  a finished request teaches the length predictor what its prompt gave (`finish`). Alone: a cluster whose
  prefill is not planned.
- CDSPPolicy (Tetris 5.1-5.2): at arrival (`arrive`) the prompt's chunks on groups of the prefill pool, planned
  on each device's bookings, and its decode instance, chosen from the predicted decode length (never the true
  one); booked at once. Then (`add`, `plan` and `apply`, live and in sim/disagg.py): the chunks that can start
  now, each device's in booked order; a request's history is spread evenly over each later chunk's group first (a
  rebalance move); a chunk's measured end moves its devices' bookings. sim/prefill_pool.py takes the bookings.
- TetriInferPolicy (3.3.4, 3.5): a prompt joins the prefill instance with the fewest prompt tokens left
  (`arrive`); each `plan` gives every free instance's next fixed-size chunk (sched/prefill_batches.py) with the
  decode instance of each prompt it ends, and, with flips, the instances' role changes; a chunk's outcome
  advances its prompts (`apply`). The live cluster and the simulator execute the same ClusterPlans.
- ESPPolicy (LoongServe): the prompt waits in arrival order (`arrive`); each `plan` is one round: the waiting
  prompts admitted, allocated elastic instances and batched (sched/esp.py), each prompt's KV kept after its
  prefill on the fewest instances that hold it (scale-down) or gathered on one, and its decode instance;
  `apply` ends a batch. The live cluster and the simulator execute the same ClusterPlans. Where a full decode
  grows (`grow`: scale-up, migration or preemption) and the decode KV a prefill's instances shed first
  (`evacuate`) are its decisions too (the simulator runs them; live, the group's SpreadKV scales up).

Pool slots are the planner's instance indices; Plans name device ids (`pool_ids[slot]`). Slots marked
`unavailable` (a decode instance's devices, with flips) look busy forever to the planner.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import random
from typing import Callable, Collection, Mapping, Protocol, Sequence

import numpy as np

from jaxserve.sched.cdsp import Chunk, ChunkPlan
from jaxserve.sched import decode_ledger
from jaxserve.sched.decode_dispatch import HEAVY_DECODE, LengthPredictor, PromptInfo, by_freeness, power_of_two
from jaxserve.sched.decode_ledger import DecodeSide
from jaxserve.sched.esp import (
    ElasticInstance,
    ElasticPool,
    ESPBatch,
    ESPScheduler,
    RunningDecodes,
    isolated_room,
    keeper,
    predicted_growth,
)
from jaxserve.sched.flip import Flip, FlipController, FlipPolicy
from jaxserve.sched.plan import ClusterPlan, Dispatch, KVMove, MoveKind, Outcome, Phase, Plan, RoleChange, WorkItem
from jaxserve.sched.prefill_batches import PrefillBatchScheduler, least_queued
from jaxserve.sched.request import Request

UNAVAILABLE = 1e9  # queue seconds the planner sees for a slot that is not a prefill instance


class Planner(Protocol):
    def on_arrival(self, t: float) -> None:
        """Sees every arrival's time before its plan (an adaptive planner tracks the load)."""

    def plan(self, tokens: int, queues: Sequence[float]) -> ChunkPlan: ...

    def groups(self) -> list[tuple[int, ...]]:
        """Every group (pool slots) a chunk may take: what a live pool compiles."""


@dataclasses.dataclass(frozen=True)
class Arrival:
    dispatch: Dispatch | None  # None without a decode side (a prefill pool alone)
    plan: ChunkPlan  # chunk times relative to the arrival


@dataclasses.dataclass
class _Prefill:
    request_id: str
    chunks: tuple[Chunk, ...]  # groups as device ids
    arrival: float
    started: int = 0  # chunks handed to the executor
    done: int = 0  # chunks completed
    group: tuple[int, ...] = ()  # devices holding its history
    moved: np.ndarray | None = None  # CDSPPolicy._moved when its chunks were booked


class ClusterPolicy:
    def __init__(
        self,
        pool_ids: Sequence[int],
        dispatch: str = "freeness",
        predictor: LengthPredictor | None = None,
        seed: int = 0,
    ):
        """pool_ids: the device id of each pool slot. dispatch: freeness or power_of_two. predictor: decode
        lengths (None: the caller's limit, the simulator's oracle). seed: power of two's sampling."""
        if dispatch not in ("freeness", "power_of_two"):
            raise ValueError(f"dispatch must be freeness or power_of_two, got {dispatch!r}")
        self.pool_ids, self.dispatch_rule, self.predictor = tuple(pool_ids), dispatch, predictor
        self.free_at = np.zeros(len(self.pool_ids))  # absolute time each slot's bookings end (updated in place)
        self.unavailable = np.zeros(len(self.pool_ids), bool)
        self._rng = random.Random(seed)
        self._prompts: dict[str, PromptInfo] = {}  # what the predictor read of each request not yet finished

    # ---- arrival ---------------------------------------------------------------------------------------------
    def predict(self, prompt: PromptInfo, limit: int | None = None, request_id: str | None = None) -> int:
        """Decode tokens to plan for: the predictor's upper end, at most `limit` (max_tokens); without a
        predictor, `limit` itself (the simulator's oracle). With `request_id` the prompt is kept until its
        `finish` teaches the predictor."""
        if self.predictor is None:
            if limit is None:
                raise ValueError("without a length predictor the caller gives the decode length")
            return limit
        if request_id is not None:
            self._prompts[request_id] = prompt
        hi = self.predictor.predict(prompt)[1]
        return hi if limit is None else min(hi, limit)

    def dispatch(
        self,
        prompt: PromptInfo,
        decoders: Mapping[int, DecodeSide],
        request_id: str,
        limit: int | None = None,
        admits: Callable[[Dispatch], bool] | None = None,
    ) -> Dispatch | None:
        """The decode instance for a prompt, among `decoders` (by their index in the cluster): by freeness
        (virtual usage counted in the loads), or power of two over the instances with room for prompt plus
        predicted decode. Unless `admits` refuses it (None is returned then), it is promised there (`promise`)."""
        hi = self.predict(prompt, limit, request_id)
        heavy = hi > HEAVY_DECODE
        keys = list(decoders)
        loads = [decode_ledger.load(decoders[k]) for k in keys]
        if self.dispatch_rule == "freeness":
            chosen = by_freeness(loads)
        else:
            chosen = power_of_two(loads, prompt.length + hi, heavy, self._rng)
        out = Dispatch(decoder=keys[chosen], predicted=hi, heavy=heavy)
        if admits is not None and not admits(out):
            return None
        self.promise(decoders[out.decoder], prompt, request_id, hi)
        return out

    def promise(self, side: DecodeSide, prompt: PromptInfo, request_id: str, predicted: int) -> None:
        """The prompt decodes on `side`: its KV and, with a length predictor, its `predicted` decode tokens are
        promised there (the simulator's oracle promises none); heavy past HEAVY_DECODE."""
        promised = predicted if self.predictor is not None else 0
        side.ledger.expect(request_id, prompt.length, promised, predicted > HEAVY_DECODE)

    def finish(self, request_id: str, generated: int) -> None:
        """The request ended (or was aborted, generated 0): a predictor that learns sees how long the decode
        of the prompt it read was."""
        prompt = self._prompts.pop(request_id, None)
        if self.predictor is not None and prompt is not None and generated:
            self.predictor.observe(prompt, generated)


class CDSPPolicy(ClusterPolicy):
    def __init__(
        self,
        planner: Planner,
        pool_ids: Sequence[int],
        dispatch: str = "freeness",
        predictor: LengthPredictor | None = None,
        seed: int = 0,
    ):
        super().__init__(pool_ids, dispatch, predictor, seed)
        self.planner = planner
        self._prefills: dict[str, _Prefill] = {}
        self._moved = np.zeros(len(self.pool_ids))  # how far chunks' ends have moved each slot's bookings

    def arrive(
        self,
        prompt: PromptInfo,
        now: float,
        decoders: Mapping[int, DecodeSide] | None = None,
        limit: int | None = None,
        admits: Callable[[Dispatch], bool] | None = None,
        retime: Callable[[ChunkPlan, np.ndarray], ChunkPlan] | None = None,
        request_id: str | None = None,
    ) -> Arrival | None:
        """The arrival decision: the planner sees the time, the decode instance is chosen (if `decoders`), and,
        unless `admits` refuses it (None is returned then), the chunks are planned and booked. retime: times
        the plan's chunks otherwise before booking (the simulator's executor). As `dispatch` otherwise."""
        self.planner.on_arrival(now)
        chosen = None
        if decoders is not None:
            if request_id is None:
                raise ValueError("a dispatch promises KV for a request: name it (request_id)")
            chosen = self.dispatch(prompt, decoders, request_id, limit, admits)
            if chosen is None:
                return None
        queues = np.where(self.unavailable, UNAVAILABLE, np.maximum(self.free_at - now, 0.0))
        plan = self.planner.plan(prompt.length, queues)
        if retime is not None:
            plan = retime(plan, queues)
        if plan.ttft >= UNAVAILABLE:
            raise RuntimeError("the prefill planner used a slot that is not a prefill instance")
        self.free_at[:] = np.where(self.unavailable, self.free_at, now + plan.commit(queues))
        return Arrival(chosen, plan)

    # ---- chunk order and outcomes (live) -----------------------------------------------------------------------
    def add(self, request_id: str, arrival: Arrival, now: float) -> None:
        """Run an admitted arrival's chunks (their groups become device ids, in id order)."""
        if request_id in self._prefills:
            raise ValueError(f"request id {request_id} is already in use")
        chunks = tuple(
            dataclasses.replace(c, group=tuple(sorted(self.pool_ids[i] for i in c.group))) for c in arrival.plan.chunks
        )
        self._prefills[request_id] = _Prefill(request_id, chunks, now, moved=self._moved.copy())

    def plan(self, now: float, decoders: Mapping[int, DecodeSide] | None = None) -> ClusterPlan:
        """The chunks that start now: each request's next chunk (its previous one done), in booked order, where its
        devices are free of every chunk running or booked before it, started or not (each device runs its chunks
        in booked order). A chunk after the first comes with its rebalance move: the history spread evenly over
        the chunk's group (onto a larger group, or evened out on the same one: the stores' room is planned for
        even shares, Stores). now and decoders: read by other policies (CDSP decides at arrival)."""
        del now, decoders
        taken = {d for p in self._prefills.values() if p.started > p.done for d in p.chunks[p.done].group}
        unstarted = sorted(
            (
                (p.arrival + c.start, p.arrival, k, p)
                for p in self._prefills.values()
                for k, c in enumerate(p.chunks)
                if k >= p.started
            ),
            key=lambda x: x[:3],
        )
        items, moves = [], []
        for _, _, k, p in unstarted:
            c = p.chunks[k]
            if k == p.done and not set(c.group) & taken:
                if p.group:
                    moves.append(
                        KVMove(
                            request_id=p.request_id, src=p.group, dst=c.group, tokens=c.history, kind=MoveKind.REBALANCE
                        )
                    )
                items.append(
                    WorkItem(
                        request_id=p.request_id,
                        start=c.history,
                        end=c.history + c.tokens,
                        phase=Phase.PREFILL,
                        group=c.group,
                        chunk_index=p.done,
                        history=c.history,
                    )
                )
                p.started += 1
                p.group = c.group
            taken |= set(c.group)
        return ClusterPlan(items=tuple(items), moves=tuple(moves))

    def apply(self, group: tuple[int, ...], items: Sequence[WorkItem], outcome: Outcome) -> list[str]:
        """The chunk on `group` (one item) ended at outcome.end_time: its devices' bookings move by how late or
        early it ended, against its booked end as already moved by the chunks before it on each device (a lateness
        that delayed its start counts once). Returns its request's id if that was its last chunk (it leaves the
        prefill side)."""
        (item,) = items
        p = self._prefills[item.request_id]
        c = p.chunks[item.chunk_index]
        slots = [self.pool_ids.index(d) for d in group]
        end = outcome.end_time
        expected = p.arrival + c.end + self._moved[slots] - p.moved[slots]
        free_at = np.maximum(self.free_at[slots] + (end - expected), end)
        self._moved[slots] += free_at - self.free_at[slots]
        self.free_at[slots] = free_at
        p.done += 1
        if p.done < len(p.chunks):
            return []
        del self._prefills[item.request_id]
        return [item.request_id]

    def booked(self, item: WorkItem) -> tuple[float, float]:
        """The booked (start, end) of a scheduled chunk, in the clock's time."""
        p = self._prefills[item.request_id]
        c = p.chunks[item.chunk_index]
        return p.arrival + c.start, p.arrival + c.end

    def finish(self, request_id: str, generated: int) -> None:
        self._prefills.pop(request_id, None)
        super().finish(request_id, generated)


class TetriInferPolicy(ClusterPolicy):
    def __init__(
        self,
        instances: Sequence[PrefillBatchScheduler],
        pool_ids: Sequence[int],
        decoders: int,
        dispatch: str = "freeness",
        predictor: LengthPredictor | None = None,
        seed: int = 0,
        flip: FlipPolicy | None = None,
        prefilling: int | None = None,
    ):
        """instances: one prefill scheduler per pool slot, in pool order. decoders: how many decode instances.
        flip: instances flip between roles; then decode instance k is pool instance k, and the first `prefilling`
        instances start in the prefill role, the others in the decode role."""
        super().__init__(pool_ids, dispatch, predictor, seed)
        if not instances:
            raise ValueError("TetriInfer's cluster needs its prefill instances")
        self.instances = list(instances)
        n = len(self.instances)
        if flip is None:
            self.prefilling, self.decoding = set(range(n)), set(range(decoders))
        else:
            if decoders != n or prefilling is None or not 0 < prefilling < n:
                raise ValueError(
                    f"flipping instances prefill and decode: {n} of each, some in each role; got "
                    f"{decoders} decode instances, {prefilling} prefilling"
                )
            self.prefilling, self.decoding = set(range(prefilling)), set(range(prefilling, n))
        self.flips = FlipController(flip) if flip is not None else None  # units: instance indices
        self._next_check = -math.inf
        self._queued_on: dict[str, int] = {}  # request id -> its prefill instance
        self._limits: dict[str, tuple[PromptInfo, int | None]] = {}  # what dispatch reads, until prefilled

    def arrive(self, request: Request, prompt: PromptInfo, now: float, limit: int | None = None) -> int:
        """The request joins the prefill instance (in the prefill role) with the fewest prompt tokens left to
        prefill. prompt and limit: what its dispatch reads (`dispatch`). Returns the instance's index."""
        del now  # queues are balanced by tokens, not time
        open_ = sorted(self.prefilling)
        k = open_[least_queued([self.instances[i] for i in open_])]
        self.instances[k].add(request)
        self._queued_on[request.id] = k
        self._limits[request.id] = prompt, limit
        return k

    def plan(self, now: float, decoders: Mapping[int, DecodeSide]) -> ClusterPlan:
        """Role changes (with flips, every check_every seconds), then each free instance's next fixed-size chunk
        (sched/prefill_batches.py; a flipping instance finishes its queue), and the decode instance of each prompt
        whose last piece is in one, among the decode instances in that role. decoders: every decode instance."""
        roles = self._roles(now, decoders) if self.flips is not None and now >= self._next_check else ()
        items, dispatch = [], {}
        for k, instance in enumerate(self.instances):
            chunk = instance.schedule(now)
            for item in chunk.items if chunk is not None else ():
                if instance.yields_token(item):
                    prompt, limit = self._limits[item.request_id]
                    dispatch[item.request_id] = self.dispatch(
                        prompt, {i: decoders[i] for i in sorted(self.decoding)}, item.request_id, limit
                    )
                items.append(item)
        return ClusterPlan(items=tuple(items), dispatch=dispatch, roles=roles)

    def cancel(self, group: tuple[int, ...], items: Sequence[WorkItem]) -> None:
        """A chunk the executor could not start: its instance stays usable, its prompts stay queued (a dispatch
        the plan made stays promised: the executor ends those requests)."""
        self._instance(group).cancel(Plan(tuple(items)))

    def apply(self, group: tuple[int, ...], items: Sequence[WorkItem], outcome: Outcome) -> list[str]:
        """The chunk on `group` ended; `items`: its pieces that ran (not aborted meanwhile). Returns the ids of
        the requests whose prefill it finished."""
        done = self._instance(group).apply(Plan(tuple(items)), outcome)
        for r in done:
            self._queued_on.pop(r.id, None)
            self._limits.pop(r.id, None)
        return [r.id for r in done]

    def _instance(self, group: tuple[int, ...]) -> PrefillBatchScheduler:
        (device,) = group
        return self.instances[self.pool_ids.index(device)]

    def _roles(self, now: float, decoders: Mapping[int, DecodeSide]) -> tuple[RoleChange, ...]:
        """Finish a drained flip, sample every instance's load, and start the flip the policy chooses (one at a
        time): a prefill instance drains its queue, a decode instance what was dispatched to it."""
        self._next_check = now + self.flips.policy.check_every
        changes = []
        for kind, k in self.flips.finish(lambda k: not self._prefill_load(k), lambda k: not decoders[k].ledger.heavy):
            (self.decoding if kind is Flip.TO_DECODE else self.prefilling).add(k)
            changes.append(RoleChange(flip=kind, unit=k, done=True))
        started = self.flips.start(
            now,
            {k: self._prefill_load(k) for k in sorted(self.prefilling)},
            {k: decode_ledger.busy(decoders[k]) for k in sorted(self.decoding)},
        )
        if started is not None:  # no new prompts (its queue drains), or no new dispatches (its requests finish)
            kind, k = started
            (self.prefilling if kind is Flip.TO_DECODE else self.decoding).discard(k)
            changes.append(RoleChange(flip=kind, unit=k, done=False))
        return tuple(changes)

    def _prefill_load(self, k: int) -> float:
        instance = self.instances[k]
        return float(instance.in_flight or instance.queued_tokens() > 0)

    def finish(self, request_id: str, generated: int) -> None:
        if (k := self._queued_on.pop(request_id, None)) is not None:
            self.instances[k].remove(request_id)
        self._limits.pop(request_id, None)
        super().finish(request_id, generated)


def elastic_pool(
    instances: Sequence[DecodeSide],
    group: DecodeSide | None,
    generated: Callable[[str], int],
    available: Collection[int],
    step_time: float,
) -> ElasticPool:
    """The pool as ESPPolicy reads it, from the decode sides of its instances (instances[k]: instance k's) and of
    the multi-master group over them (its KV a SpreadKV; None: no group): each instance's KV in use, promised KV
    included (a dispatched prompt's, and a spread prompt's share placed there to land), and the tokens each request
    decoding there (its KV landed) has generated so far, generated(request id)."""

    def decoding(side: DecodeSide) -> list[int]:
        return [generated(rid) for rid in side.ledger.heavy if rid not in side.ledger.incoming]

    views = []
    for k, side in enumerate(instances):
        kv = side.scheduler.kv
        tokens = kv.capacity * kv.block_size
        placed = group.scheduler.kv.promised(k) if group is not None else 0
        used = tokens - decode_ledger.load(side).free_slots + placed
        views.append(ElasticInstance(k, tokens, used, tuple(decoding(side))))
    sides = [*instances, *([group] if group is not None else [])]
    return ElasticPool(
        instances=views, available=available, generated=[g for d in sides for g in decoding(d)], step_time=step_time
    )


def averaged_step(average: float, seconds: float) -> float:
    """The decode step time an ESP pool reports (ElasticPool.step_time): a moving average of the steps measured
    so far, the first taken as it is."""
    return seconds if not average else 0.9 * average + 0.1 * seconds


class GrowthKind(enum.Enum):
    TAIL = "tail"  # on its last instance
    SCALE_UP = "scale_up"  # onto another instance, which joins its group
    MIGRATE = "migrate"  # its whole KV to one instance with room
    PREEMPT = "preempt"  # nowhere: its KV is freed, it recomputes


@dataclasses.dataclass(frozen=True, kw_only=True)
class Growth:
    """Where a decoding request's next token goes (ESPPolicy.grow)."""

    kind: GrowthKind
    instance: int | None


class ESPPolicy(ClusterPolicy):
    def __init__(
        self,
        elastic: ESPScheduler,
        pool_ids: Sequence[int],
        dispatch: str = "freeness",
        predictor: LengthPredictor | None = None,
        seed: int = 0,
        *,
        spread: bool = False,
        instance_context: int | None = None,
        weigh_pauses: bool = True,
        scale_up: bool = True,
    ):
        """spread: a prompt's KV stays where scale-down keeps it (`ESPScheduler.scale_down`): one instance
        decodes it if it keeps it all and (instance_context: the longest context one instance's engine serves;
        None: any) its context fits there, else the multi-master group (decoder index len(pool_ids)). Otherwise
        its whole KV gathers on its batch's `keeper`, which decodes it. weigh_pauses: admission weighs pausing
        the decodes whose free KV slots a prefill takes (False: it takes them unweighed, the ablation). scale_up: a
        decode whose last instance is full grows onto another (False: its KV migrates whole, `grow`)."""
        super().__init__(pool_ids, dispatch, predictor, seed)
        self.elastic, self.spread, self.instance_context = elastic, spread, instance_context
        self.weigh_pauses, self.scale_up = weigh_pauses, scale_up
        self._waiting: dict[str, tuple[Request, PromptInfo]] = {}  # the waiting prompts, in arrival order
        # pool slots -> the prompts of its batch in flight, each with its decode instance
        self._running: dict[tuple[int, ...], list[tuple[Request, PromptInfo, int]]] = {}

    def arrive(self, request: Request, prompt: PromptInfo, first: bool = False) -> None:
        """The prompt waits in arrival order (first: at the head, a preempted request's recompute: its
        prefill_target, Request.preempt). request's output_len: the most it may generate; prompt: what the length
        predictor reads."""
        self._waiting[request.id] = request, prompt
        if first:
            self._waiting = {request.id: (request, prompt)} | self._waiting

    @property
    def waiting(self) -> list[Request]:
        return [r for r, _ in self._waiting.values()]

    def plan(self, now: float, pool: ElasticPool, decoders: Mapping[int, DecodeSide] | None = None) -> ClusterPlan:
        """One ESP round over the pool's available instances no batch holds: the waiting prompts admitted,
        allocated elastic instances and batched (sched/esp.py's plan), each batch's prompts one chunk each on its
        group; every prompt's dispatch says where its KV stays and which instance decodes it, promised there
        (with `decoders`; the lab's LoongServe model keeps its own counts). The kept KV is booked on
        pool.instances. With a length predictor its estimate sizes each request's KV."""
        del now  # ESP admits in arrival order whenever instances are free
        busy = self._prefilling
        free = [pool.instances[k] for k in sorted(pool.available) if k not in busy]
        if not self._waiting or not free:
            return ClusterPlan()
        estimate = self.elastic.output_estimate = self._estimate()
        decodes = None
        if self.weigh_pauses:
            outside = [e for e in pool.instances if e.id not in busy]
            decodes = RunningDecodes(isolated_room(outside), tuple(pool.generated), estimate, pool.step_time)
        batches = self.elastic.plan(self.waiting, free, predicted_growth(estimate, pool.generated), decodes)
        items, dispatch = [], {}
        for batch in batches:
            slots = tuple(sorted(batch.instances))
            kept = self._keep(batch, pool.instances)
            self._running[slots] = []
            for r in batch.requests:
                request, prompt = self._waiting.pop(r.id)
                dispatch[r.id] = self._dispatch(request, prompt, kept[r.id], decoders)
                self._running[slots].append((request, prompt, dispatch[r.id].decoder))
                items.append(
                    WorkItem(
                        request_id=r.id,
                        start=0,
                        end=r.prefill_target,
                        phase=Phase.PREFILL,
                        group=tuple(self.pool_ids[k] for k in slots),
                    )
                )
        return ClusterPlan(items=tuple(items), dispatch=dispatch)

    def evacuate(
        self, taken: Collection[int], free: Sequence[ElasticInstance], decoding: Mapping[str, Mapping[int, int]]
    ) -> tuple[list[KVMove], set[str]]:
        """A prefill takes the `taken` instances (LoongServe: a busy instance's decode KV moves away first, what
        allocation weighs with the link's bandwidth): each decoding request's share there (decoding: request id
        -> instance -> tokens) moves to the instance of `free` with the most room that holds none of its KV;
        a request with a share no instance takes pauses until the prefill ends. Returns the moves and the paused
        requests."""
        room = {e.id: e.free for e in free}
        moves, paused = [], set()
        for rid, shards in decoding.items():
            held = set(shards)
            for i in [i for i in shards if i in taken]:
                fits = [k for k in room if k not in held and room[k] >= shards[i] + 1]
                if not fits:
                    paused.add(rid)
                    continue
                target = max(fits, key=lambda k: room[k])
                room[target] -= shards[i]
                held.add(target)
                moves.append(KVMove(request_id=rid, src=(i,), dst=(target,), tokens=shards[i], kind=MoveKind.MIGRATE))
        return moves, paused

    def grow(self, shards: Mapping[int, int], generated: int, instances: Sequence[ElasticInstance]) -> Growth:
        """Where a decoding request's next token goes (shards: instance -> tokens, the last taking new ones;
        instances: every instance, by index): its last instance while it has room; else, among the instances no
        batch holds, with scale-up the emptiest other one (multi-master, no KV moves), without it the one with the
        most room for its whole KV and predicted rest (a migration); else nowhere: it is preempted."""
        tail = next(reversed(shards))
        if instances[tail].free > 0:
            return Growth(kind=GrowthKind.TAIL, instance=tail)
        candidates = [e for e in instances if e.id not in self._prefilling]
        if self.scale_up:
            grown = self.elastic.scale_up(dict(shards), candidates)
            if grown is not None:
                return Growth(kind=GrowthKind.SCALE_UP, instance=grown)
        else:
            need = sum(shards.values()) + max(self._estimate() - generated, 1)
            target = max(
                (e for e in candidates if e.id not in shards and e.free >= need), default=None, key=lambda e: e.free
            )
            if target is not None:
                return Growth(kind=GrowthKind.MIGRATE, instance=target.id)
        return Growth(kind=GrowthKind.PREEMPT, instance=None)

    @property
    def _prefilling(self) -> set[int]:
        """The pool slots a planned batch holds until it is applied."""
        return {k for slots in self._running for k in slots}

    def _estimate(self) -> int:
        """Every decode's predicted length (one for all: the predictor's for an empty prompt)."""
        return self.predict(PromptInfo(0)) if self.predictor is not None else self.elastic.output_estimate

    def _keep(self, batch: ESPBatch, instances: Sequence[ElasticInstance]) -> dict[str, dict[int, int]]:
        """Where each prompt's KV stays after the batch's prefill (request id -> instance -> tokens), booked."""
        if self.spread:
            return self.elastic.scale_down(batch, instances)
        out = {}
        for r in batch.requests:
            e = keeper([instances[k] for k in batch.instances])
            e.kv_used += r.prefill_target
            out[r.id] = {e.id: r.prefill_target}
        return out

    def _dispatch(
        self, request: Request, prompt: PromptInfo, shards: dict[int, int], decoders: Mapping[int, DecodeSide] | None
    ) -> Dispatch:
        (one, *more) = shards
        alone = self.instance_context is None or request.prompt_len + request.output_len <= self.instance_context
        decoder = one if not more and (alone or not self.spread) else len(self.pool_ids)
        hi = self.predict(prompt, request.output_len, request.id)
        if decoders is not None:
            self.promise(decoders[decoder], prompt, request.id, hi)
        return Dispatch(decoder=decoder, predicted=hi, heavy=hi > HEAVY_DECODE, shards=shards)

    def cancel(
        self, group: tuple[int, ...], items: Sequence[WorkItem], decoders: Mapping[int, DecodeSide] | None = None
    ) -> None:
        """A batch the executor could not start: its prompts wait again, at the head in order, and their decode
        promises (on `decoders`) are taken back."""
        del items  # a batch is cancelled whole
        for request, prompt, decoder in reversed(self._running.pop(self._slots(group))):
            if decoders is not None:
                decoders[decoder].ledger.forget(request.id)
            self.arrive(request, prompt, first=True)

    def apply(self, group: tuple[int, ...], items: Sequence[WorkItem], outcome: Outcome) -> list[str]:
        """The batch on `group` ended (items: its prompts that ran): each prompt's prefill is done."""
        del outcome
        self._running.pop(self._slots(group))
        return [item.request_id for item in items]

    def _slots(self, group: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted(self.pool_ids.index(d) for d in group))

    def finish(self, request_id: str, generated: int) -> None:
        self._waiting.pop(request_id, None)
        super().finish(request_id, generated)
