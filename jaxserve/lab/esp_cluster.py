"""LoongServe's elastic sequence parallelism in simulation, the paper's whole design on a GPU profile: a pool of
elastic instances (each a full model copy on `tp` GPUs) that prefill in batches on elastic groups and decode with
their KV spread across instances, run by sched/cluster.py's ESPPolicy (sched/esp.py's ESPScheduler), as the live
cluster runs it, and with what the live cluster does not do yet: KV evacuation, proactive scale-down, per-instance
shares of a request's KV moving between instances. The paper's model, in the lab: its instances keep their own KV
counts (a share per request), not ReplicaSchedulers. ESP as served is simulated by sim/disagg.py's elastic
instances (`simulate --cluster_policy=esp`, a live run's replay), which decode on the live scheduler.

- Iterations: at every event the scheduler plans prefill batches on the idle instances (admission, elastic
  allocation, batching); then every decoding request whose instances are all idle takes one decode step, the
  requests that share instances stepping together and unconnected groups independently. An instance taken for
  prefill first moves the decode KV it holds to idle instances with room, and the prefill starts when that is
  done (the cost the allocation weighs); requests whose share finds no room are paused until the prefill ends
  (a decode-slot preemption, which admission weighs unless `decode_preemption` is off).
- Scale-down: a finished prefill keeps each request's KV on a few of its batch's instances. Proactive migration:
  the ring passed every K/V block by every instance, so a keeper only stores the blocks it keeps, a copy into
  its own memory; reactive: the leaving instances' shares move over the links after the prefill.
- KV moves (evacuation, reactive scale-down, whole-KV migration) are charged from the network profile: each
  GPU of an instance sends or receives its TP shard over its own link, NVLink within a node; the busiest
  instance's traffic sets the time, and the instances involved are busy until it is done.
- Scale-up: a request whose tail instance is full grows onto the emptiest instance with room (multi-master:
  each step's masters spread over a group's instances); without scale-up it moves its whole KV to an instance
  that holds it. With no memory anywhere it is preempted (Request.preempt): its KV is freed and it prefills again
  (everything but its last token, which its next decode step feeds) ahead of new arrivals.
- Times come from the GPU profile (sched/profiles.py): prefill = linear ops over each instance's share of the
  batch + causal attention split over the group + the ring's K/V passing where one ring step's compute does not
  hide it (per layer, sp - 1 sends of the instance's share, each hidden up to 1/sp of its attention); a decode step
  lasts as long as its slowest instance: linear ops for the requests it masters, attention over the KV it
  holds, and per layer a query/partials exchange for requests spread over several instances. The scheduler plans
  with LoongServe's model fitted to those prefill times.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from tqdm.auto import tqdm

from jaxserve.sched.cluster import ESPPolicy, GrowthKind
from jaxserve.sched.decode_dispatch import ObservedLengths, PromptInfo
from jaxserve.sched.esp import ElasticInstance, ElasticPool, ESPScheduler
from jaxserve.sched.plan import Outcome, WorkItem
from jaxserve.sched.profiles import kv_capacity
from jaxserve.sched.request import Request
from jaxserve.config import SLO
from jaxserve.sim.esp_cost import ESPCost
from jaxserve.sim.metrics import Results
from jaxserve.sim.workload import Workload


@dataclasses.dataclass(frozen=True)
class ESPConfig:
    instances: int = 4  # LoongServe's TP=2, ESP=4 on one 8-GPU node
    tp: int = 2
    profile: str = "h100_llama2_7b"  # LoongServe serves LWM-1M, a Llama-2-7B (MHA: 512 KiB of KV per token)
    scale_up: bool = True  # multi-master growth of a full request's group
    multi_master: bool = True
    proactive: bool = True  # scale-down migration hidden in the prefill ring
    decode_preemption: bool = True  # weigh pausing decodes before a prefill takes their free KV slots (False: always)
    max_overtakes: int = 0  # later requests admitted ahead of one that does not fit (0: strict FCFS, the slides)
    max_sp: int | None = None  # 1: independent replicas (LoongServe without ESP)
    output_estimate: int = 512  # the decode-length prior: the running mean of finished lengths replaces it (as live)
    knee_tokens: int = 16384  # a prefill batch past this many tokens on one instance stops gaining from batching
    slo: SLO = SLO()
    memory_utilization: float = 0.9
    kv_tokens: int | None = None  # KV one instance holds (None: the profile's GPUs at memory_utilization)

    def label(self) -> dict:
        return dataclasses.asdict(self) | {"slo": dataclasses.asdict(self.slo)}


@dataclasses.dataclass(frozen=True)
class _Prefilling:
    """A batch in flight."""

    end: float
    group: tuple[int, ...]  # instance indices
    items: tuple[WorkItem, ...]  # its prompts, in order
    shards: dict[str, dict[int, int]]  # request id -> where its KV stays (its dispatch's)


@dataclasses.dataclass
class _Decoding:
    request: Request  # the original request (metrics)
    shards: dict[int, int]  # instance -> KV tokens held; the last instance takes new tokens
    ready_at: float = 0.0  # a KV migration in flight holds it back until then


class ESPSimulator:
    def __init__(self, config: ESPConfig = ESPConfig()):
        c = self.config = config
        if c.instances < 1 or c.tp < 1:
            raise ValueError(f"instances and tp must be >= 1, got {c.instances}, {c.tp}")
        self.cost = ESPCost(c.profile, c.tp)
        self.capacity = c.kv_tokens or kv_capacity(c.profile, c.tp, c.memory_utilization)
        model = self.cost.fit(c.instances, c.tp)
        self.scheduler = ESPScheduler(
            model,
            c.tp,
            knee=self.cost.prefill([c.knee_tokens], 1),
            migration_bandwidth=self.cost.migration_bandwidth,
            kv_bytes_per_token=self.cost.shard_bytes,
            output_estimate=c.output_estimate,
            max_sp=c.max_sp,
            max_overtakes=c.max_overtakes,
        )

    def run(self, workload: Workload, progress: bool = True) -> Results:
        return _Run(self, workload, progress).results()


class _Run:
    def __init__(self, sim: ESPSimulator, workload: Workload, progress: bool):
        self.sim, self.cfg, self.cost, self.esp = sim, sim.config, sim.cost, sim.scheduler
        self.instances = [ElasticInstance(i, sim.capacity) for i in range(self.cfg.instances)]
        self.requests, self.rejected = [], []
        # arrivals wait in it (a preempted request comes back to recompute); its elastic planner is the simulator's;
        # decode lengths are predicted as live: the running mean of finished requests, from the configured prior
        self.scheduler = ESPPolicy(
            sim.scheduler,
            range(self.cfg.instances),
            predictor=ObservedLengths(prior=self.cfg.output_estimate),
            spread=True,
            weigh_pauses=self.cfg.decode_preemption,
            scale_up=self.cfg.scale_up,
        )
        self.origin: dict[str, Request] = {}  # request id -> the workload's request, while it waits or prefills
        self.prefilling: list[_Prefilling] = []
        self.prefills: list[tuple[tuple[str, ...], tuple[int, ...], float, float]] = []  # every batch as run
        self.decoders: dict[str, int] = {}  # each request's decode instance, as dispatched (last: its recompute's)
        self.decoding: dict[str, _Decoding] = {}
        self.steps: list[tuple[float, set[int], list[_Decoding]]] = []  # decode steps in flight: end, instances
        self.moves: list[tuple[float, set[int]]] = []  # KV moves in flight: end, instances busy until then
        self.preemptions = self.scale_ups = self.migrations = self.evacuations = self.finished = 0
        self.decode_pauses = 0  # decoding requests paused by a prefill taking an instance that holds their KV
        self.step_sum, self.step_count = 0.0, 0  # decode step durations so far
        self.now = 0.0
        self.wall = time.perf_counter()
        self._build(workload)
        self._loop(progress)

    def _build(self, workload: Workload) -> None:
        cfg = self.cfg
        for k, (t, p, o) in enumerate(
            zip(workload.arrivals.tolist(), workload.prompt_lens.tolist(), workload.output_lens.tolist())
        ):
            r = Request(str(k), t, p, o, tpot_slo=cfg.slo.tpot_slo)
            # one deadline whatever the variant: the fastest prefill the whole pool could give it
            r.ttft_deadline = t + cfg.slo.ttft(self.cost.fastest_prefill(p, cfg.instances))
            # a request whose prompt and max_tokens outgrow the KV it may span could never finish
            fits = p + o <= self.sim.capacity * (cfg.max_sp or cfg.instances)
            (self.requests if fits else self.rejected).append(r)

    # -- the loop --------------------------------------------------------------------------------------------
    def _loop(self, progress: bool) -> None:
        bar = tqdm(total=len(self.requests), desc="esp", unit="req", disable=not progress, leave=False)
        arrived = 0
        while True:
            times = [p.end for p in self.prefilling] + [e for e, _, _ in self.steps] + [e for e, _ in self.moves]
            times += [d.ready_at for d in self.decoding.values() if d.ready_at > self.now]  # migrations landing
            if arrived < len(self.requests):
                times.append(self.requests[arrived].arrival)
            if not times:
                break
            self.now = now = min(times)
            self.moves = [m for m in self.moves if m[0] > now]
            while arrived < len(self.requests) and self.requests[arrived].arrival <= now:
                r = self.requests[arrived]
                self.scheduler.arrive(r, PromptInfo(r.prompt_len))
                self.origin[r.id] = r
                arrived += 1
            for p in [p for p in self.prefilling if p.end <= now]:
                self.prefilling.remove(p)
                self._prefilled(p)
            for step in [s for s in self.steps if s[0] <= now]:
                self.steps.remove(step)
                self._stepped(step[0], step[2])
            self._schedule(now)
            bar.update(self.finished - bar.n)
        bar.close()
        if self.scheduler.waiting or self.decoding:
            raise RuntimeError(f"stuck: {len(self.scheduler.waiting)} waiting, {len(self.decoding)} decoding")

    def _idle(self) -> set[int]:
        """Instances neither prefilling, in a decode step nor moving KV."""
        busy = {i for p in self.prefilling for i in p.group} | {i for _, ins, _ in self.steps for i in ins}
        busy |= {i for _, ins in self.moves for i in ins}
        return {e.id for e in self.instances} - busy

    def _schedule(self, now: float) -> None:
        """Prefill rounds, then decode steps; a preemption while starting the steps frees memory and re-queues a
        request, so planning runs again (else, with nothing in flight, no later event would wake it)."""
        preempted = -1
        while preempted != self.preemptions:
            preempted = self.preemptions
            self._plan_prefills(now)
            self._start_steps(now, self._idle())

    def _plan_prefills(self, now: float) -> None:
        while self.scheduler.waiting:  # rounds until one starts nothing (the knee bounds each round)
            generated = [d.request.generated for d in self.decoding.values()]
            for e in self.instances:  # what a prefill taking it pauses (allocation's cost without evacuation)
                e.generated = tuple(d.request.generated for d in self.decoding.values() if e.id in d.shards)
            pool = ElasticPool(
                instances=self.instances,
                available=self._idle(),
                generated=generated,
                step_time=self.step_sum / max(self.step_count, 1),
            )
            plan = self.scheduler.plan(now, pool)
            if not plan.items:
                break
            reserved = {i for group in plan.chunks() for i in group}
            for group, items in plan.chunks().items():
                start = self._evacuate(set(group), reserved, now)
                end = start + self.cost.prefill([i.tokens for i in items], len(group), self.cost.link_of(group))
                shards = {i.request_id: dict(plan.dispatch[i.request_id].shards) for i in items}
                self.decoders |= {i.request_id: plan.dispatch[i.request_id].decoder for i in items}
                self.prefilling.append(_Prefilling(end, group, items, shards))
                self.prefills.append((tuple(i.request_id for i in items), group, start, end))

    def _evacuate(self, taken: set[int], reserved: set[int], now: float) -> float:
        """A prefill takes instances holding decode KV: the policy's moves take those shares to idle instances
        outside this round's prefills, busy receiving until done; a request with a share left is paused until
        the prefill ends. Returns when the prefill can start."""
        idle = [e for e in self.instances if e.id in self._idle() - reserved]
        moves, paused = self.scheduler.evacuate(taken, idle, {rid: d.shards for rid, d in self.decoding.items()})
        self.decode_pauses += len(paused)
        sent: collections.Counter[int] = collections.Counter()
        received: collections.Counter[int] = collections.Counter()
        for m in moves:
            d, (src,), (dst,) = self.decoding[m.request_id], m.src, m.dst
            del d.shards[src]
            d.shards[dst] = m.tokens  # last: it takes the new tokens
            self.instances[src].kv_used -= m.tokens
            self.instances[dst].kv_used += m.tokens
            sent[src] += m.tokens
            received[dst] += m.tokens
        self.evacuations += len(moves)
        end = now + self.cost.moves(sent, received)
        for rid in {m.request_id for m in moves}:
            self.decoding[rid].ready_at = max(self.decoding[rid].ready_at, end)
        if received:
            self.moves.append((end, set(received)))
        return end

    def _prefilled(self, p: _Prefilling) -> None:
        first, ready = self._scale_down(p)
        self.scheduler.apply(p.group, p.items, Outcome(p.end, (), {}))
        for item in p.items:
            original = self.origin.pop(item.request_id)
            original.prefilled = original.prefill_target
            if not original.generated:  # a prefill yields the first token; a recompute's next comes from a decode
                original.add_tokens(1, first)
            shards = p.shards[item.request_id]
            if original.finished:
                self._finish(original, shards)
            else:
                self.decoding[original.id] = _Decoding(original, shards, ready)

    def _scale_down(self, p: _Prefilling) -> tuple[float, float]:
        """When the batch's first tokens come out and its requests can decode: the ring left 1/sp of each
        prompt's KV on every instance of the batch and the keepers need their shares. Proactive (LoongServe's
        scale-down, slides: "在轮转的过程中保存KV"): every block passed by every instance during the ring, so a keeper
        stores what it keeps as it passes, a copy into its memory that lengthens the lockstep forward pass (the
        paper measures < 2%); reactive: after the forward pass the shares move over the links. The instances
        involved are busy until it is done."""
        end, sp = p.end, len(p.group)
        sent: collections.Counter[int] = collections.Counter()
        received: collections.Counter[int] = collections.Counter()
        for item in p.items:
            shards = p.shards[item.request_id]
            for i in p.group:
                delta = round(shards.get(i, 0) - item.tokens / sp)
                if delta:
                    (received if delta > 0 else sent)[i] += abs(delta)
        if self.cfg.proactive:
            done = end + max(map(self.cost.copy, received.values()), default=0.0)
            first, busy = done, set(p.group)
        else:
            done = end + self.cost.moves(sent, received)
            first, busy = end, set(sent) | set(received)
        if done > end:
            self.moves.append((done, busy))
        return first, done

    def _finish(self, request: Request, shards: dict[int, int]) -> None:
        self.finished += 1
        self.scheduler.finish(request.id, request.generated)  # the predictor learns its length
        self._release(shards)

    def _release(self, shards: dict[int, int]) -> None:
        for i, tokens in shards.items():
            self.instances[i].kv_used -= tokens

    # -- decode ----------------------------------------------------------------------------------------------
    def _start_steps(self, now: float, idle: set[int]) -> None:
        """One decode step for every request whose instances are all idle (growing a full one first), run as
        independent steps per connected group of instances (requests sharing an instance step together)."""
        stepping = [
            d
            for d in list(self.decoding.values())
            if d.ready_at <= now and idle.issuperset(d.shards) and self._room_for_one(d, now, idle)
        ]
        stepping = [d for d in stepping if d.ready_at <= now]  # a whole-KV move started this instant waits
        parent = {i: i for d in stepping for i in d.shards}

        def root(i: int) -> int:
            while parent[i] != i:
                i = parent[i]
            return i

        for d in stepping:
            first, *rest = d.shards
            for i in rest:
                parent[root(i)] = root(first)
        groups: dict[int, list[_Decoding]] = {}
        for d in stepping:
            groups.setdefault(root(next(iter(d.shards))), []).append(d)
        for members in groups.values():
            instances = {i for d in members for i in d.shards}
            seconds = self._step_time(members)
            self.step_sum += seconds
            self.step_count += 1
            self.steps.append((now + seconds, instances, members))

    def _step_time(self, members: list[_Decoding]) -> float:
        """The slowest instance: linear ops for the requests it masters, attention over the KV it holds, and the
        per-layer query exchange for requests spread over several instances."""
        mastered: dict[int, int] = {}
        load: dict[int, list] = {}  # instance -> [requests mastered, KV tokens held of each, spread requests]
        for d in members:
            m = self.esp.master(d.shards, mastered, self.cfg.multi_master)
            mastered[m] = mastered.get(m, 0) + 1
            for i, tokens in d.shards.items():
                row = load.setdefault(i, [0, [], 0])
                row[1].append(tokens)
                row[2] += len(d.shards) > 1
            load[m][0] += 1
        return max(self.cost.decode_step(*row) for row in load.values())

    def _room_for_one(self, d: _Decoding, now: float, idle: set[int]) -> bool:
        """Make room for the token this step appends where the policy grows it; False if it cannot step now."""
        growth = self.scheduler.grow(d.shards, d.request.generated, self.instances)
        if growth.kind is GrowthKind.TAIL:
            self._book(d, growth.instance)
            return True
        if growth.kind is GrowthKind.SCALE_UP:  # it steps with the grown group, now if that is idle, else next time
            self.scale_ups += 1
            d.shards[growth.instance] = 0
            if growth.instance not in idle:
                return False
            self._book(d, growth.instance)
            return True
        if growth.kind is GrowthKind.MIGRATE:  # its instances and the target are busy with the move from now on
            kv, target = sum(d.shards.values()), growth.instance
            self.migrations += 1
            self._release(d.shards)
            seconds = self.cost.moves(d.shards, {target: kv})
            self.moves.append((now + seconds, set(d.shards) | {target}))
            idle.difference_update(self.moves[-1][1])
            d.shards = {target: kv}
            self.instances[target].kv_used += kv
            d.ready_at = now + seconds
            return True
        self._preempt(d)
        return False

    def _book(self, d: _Decoding, instance: int) -> None:
        d.shards[instance] += 1
        self.instances[instance].kv_used += 1

    def _preempt(self, d: _Decoding) -> None:
        """Free its KV; it recomputes everything but its last token (Request.preempt), ahead of everyone waiting."""
        self.preemptions += 1
        self._release(d.shards)
        del self.decoding[d.request.id]
        r = d.request
        r.preempt()
        self.origin[r.id] = r
        self.scheduler.arrive(r, PromptInfo(r.prompt_len), first=True)

    def _stepped(self, end: float, stepping: list[_Decoding]) -> None:
        for d in stepping:
            d.request.add_tokens(1, end)
            if d.request.finished:
                self._finish(d.request, d.shards)
                del self.decoding[d.request.id]

    def results(self) -> Results:
        done = [r for r in self.requests if r.finished]
        span = (max(r.finished_at for r in done) - self.requests[0].arrival) if done else 0.0
        config = self.cfg.label() | {
            "preemptions": self.preemptions,
            "scale_ups": self.scale_ups,
            "migrations": self.migrations,
            "evacuations": self.evacuations,
            "decode_pauses": self.decode_pauses,
            "kv_capacity_per_instance": self.sim.capacity,
            "kv_held_at_end": sum(e.kv_used for e in self.instances),
        }
        return Results(
            self.requests,
            self.rejected,
            span,
            time.perf_counter() - self.wall,
            config,
            prefills=self.prefills,
            decoders=self.decoders,
        )
