"""LoongServe's elastic sequence parallelism in simulation: a pool of elastic instances (each a full model copy
on `tp` GPUs) that prefill in batches on elastic groups and decode with their KV spread across instances, run by
sched/esp.py's ESPScheduler.

- Iterations: at every event the scheduler plans prefill batches on the idle instances (admission, elastic
  allocation, batching); then every decoding request whose instances are all idle takes one decode step, the
  requests that share instances stepping together and unconnected groups independently. An instance taken for
  prefill first moves the decode KV it holds to idle instances with room (the cost the allocation weighs);
  requests whose share finds no room wait for the prefill.
- Scale-down: a finished prefill keeps each request's KV on a few of its batch's instances (proactive migration:
  free; reactive: the leaving instances' shares move over NVLink before it decodes).
- Scale-up: a request whose tail instance is full grows onto the emptiest instance with room (multi-master:
  each step's masters spread over a group's instances); without scale-up it moves its whole KV to an instance
  that holds it. With no memory anywhere it is preempted: its KV is freed and it prefills again (prompt plus
  the tokens generated so far) ahead of new arrivals.
- Times come from the GPU profile (sched/profiles.py): prefill = linear ops over each instance's share of the
  batch + causal attention split over the group (the ring's K/V passing is hidden under compute); a decode step
  lasts as long as its slowest instance: linear ops for the requests it masters, attention over the KV it
  holds, and per layer a query/partials exchange for requests spread over several instances. The scheduler plans
  with LoongServe's model fitted to those prefill times.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
from tqdm.auto import tqdm

from jaxserve.sched.cost_models import LoongServePrefill
from jaxserve.sched.esp import ElasticInstance, ESPBatch, ESPScheduler
from jaxserve.sched.profiles import PROFILES, ProfileBatchCost, kv_capacity, model_shape, network
from jaxserve.sched.request import Request
from jaxserve.sched.slo import SLO
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
    max_sp: int | None = None  # 1: independent replicas (LoongServe without ESP)
    output_estimate: int = 512  # predicted decode length for admission and scale-down
    knee_tokens: int = 16384  # a prefill batch past this many tokens on one instance stops gaining from batching
    slo: SLO = SLO()
    memory_utilization: float = 0.9

    def label(self) -> dict:
        return dataclasses.asdict(self) | {"slo": dataclasses.asdict(self.slo)}


class ESPCost:
    """What the executor charges, from the GPU profile, for instances of `tp` GPUs."""

    def __init__(self, profile: str, tp: int):
        self.batch = ProfileBatchCost(profile, tp)
        self.layers = self.batch.layers
        self.link = network(PROFILES[profile][0])
        self.kv_bytes = model_shape(profile).kv_bytes_per_token()
        self.query_bytes = 2.0 * model_shape(profile).hidden  # bf16 query (and partial output) per layer

    def prefill(self, lengths: list[int], sp: int) -> float:
        per_instance = math.ceil(sum(lengths) / sp)
        return self.batch.linear_ops(per_instance) + sum(self.batch.prefill_attention(l, 0) for l in lengths) / sp

    def fastest_prefill(self, tokens: int, max_sp: int) -> float:
        return min(self.prefill([tokens], sp) for sp in range(1, max_sp + 1))

    def fit(self, max_sp: int, tp: int) -> LoongServePrefill:
        """LoongServe's model a + b sum(l) + c sum(l^2), fitted per SP size to this profile's prefill times."""
        rng = np.random.default_rng(0)
        samples = []
        for sp in range(1, max_sp + 1):
            for _ in range(60):
                lengths = np.exp(rng.uniform(np.log(256), np.log(1 << 19), rng.integers(1, 5))).astype(int).tolist()
                samples.append(((sp, tp), (sum(lengths), sum(l * l for l in lengths)), self.prefill(lengths, sp)))
        return LoongServePrefill.fit(samples)

    def exchange(self, requests: int) -> float:
        """Per step: each layer sends the queries of `requests` spread requests and gets their partials back."""
        return self.layers * 2 * self.link.predict("intra_node", requests * self.query_bytes)

    def migrate(self, tokens: int) -> float:
        return self.link.predict("intra_node", tokens * self.kv_bytes)


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
        self.capacity = kv_capacity(c.profile, c.tp, c.memory_utilization)
        model = self.cost.fit(c.instances, c.tp)
        self.scheduler = ESPScheduler(
            model, c.tp, knee=self.cost.prefill([c.knee_tokens], 1),
            migration_bandwidth=self.cost.link.bandwidth("intra_node"), kv_bytes_per_token=self.cost.kv_bytes,
            output_estimate=c.output_estimate, max_sp=c.max_sp)

    def run(self, workload: Workload, progress: bool = True) -> Results:
        return _Run(self, workload, progress).results()


class _Run:
    def __init__(self, sim: ESPSimulator, workload: Workload, progress: bool):
        self.sim, self.cfg, self.cost, self.esp = sim, sim.config, sim.cost, sim.scheduler
        self.instances = [ElasticInstance(i, sim.capacity) for i in range(self.cfg.instances)]
        self.requests, self.rejected = [], []
        self.pending: list[Request] = []  # what the scheduler sees (a preempted request comes back as a proxy)
        self.origin: dict[str, Request] = {}  # scheduled request id -> the workload's request
        self.prefilling: list[tuple[float, ESPBatch]] = []  # (end, batch)
        self.decoding: dict[str, _Decoding] = {}
        self.steps: list[tuple[float, set[int], list[_Decoding]]] = []  # decode steps in flight: end, instances
        self.preemptions = self.scale_ups = self.migrations = self.evacuations = self.finished = 0
        self.now = 0.0
        self.wall = time.perf_counter()
        self._build(workload)
        self._loop(progress)

    def _build(self, workload: Workload) -> None:
        cfg = self.cfg
        for k, (t, p, o) in enumerate(zip(workload.arrivals.tolist(), workload.prompt_lens.tolist(),
                                          workload.output_lens.tolist())):
            r = Request(str(k), t, p, o, tpot_slo=cfg.slo.tpot)
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
            times = [e for e, _ in self.prefilling] + [e for e, _, _ in self.steps]
            times += [d.ready_at for d in self.decoding.values() if d.ready_at > self.now]  # migrations landing
            if arrived < len(self.requests):
                times.append(self.requests[arrived].arrival)
            if not times:
                break
            self.now = now = min(times)
            while arrived < len(self.requests) and self.requests[arrived].arrival <= now:
                r = self.requests[arrived]
                self.pending.append(r)
                self.origin[r.id] = r
                arrived += 1
            for end, batch in [p for p in self.prefilling if p[0] <= now]:
                self.prefilling.remove((end, batch))
                self._prefilled(batch, end)
            for step in [s for s in self.steps if s[0] <= now]:
                self.steps.remove(step)
                self._stepped(step[0], step[2])
            self._schedule(now)
            bar.update(self.finished - bar.n)
        bar.close()
        if self.pending or self.decoding:
            raise RuntimeError(f"stuck: {len(self.pending)} waiting, {len(self.decoding)} decoding")

    def _idle(self) -> set[int]:
        """Instances neither prefilling nor in a decode step."""
        busy = {i for _, b in self.prefilling for i in b.instances} | {i for _, ins, _ in self.steps for i in ins}
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
        idle = self._idle()
        while self.pending and idle:  # rounds until nothing more starts (the knee bounds each round)
            growth = sum(max(min(self.cfg.output_estimate, d.request.output_len) - d.request.generated, 0)
                         for d in self.decoding.values())
            batches = self.esp.plan(self.pending, [self.instances[i] for i in sorted(idle)], growth)
            if not batches:
                break
            for batch in batches:
                self.prefilling.append((now + self.cost.prefill([r.prompt_len for r in batch.requests],
                                                                 len(batch.instances)), batch))
                planned = {r.id for r in batch.requests}
                self.pending = [r for r in self.pending if r.id not in planned]
                self._evacuate(set(batch.instances), now)
            idle = self._idle()

    def _evacuate(self, taken: set[int], now: float) -> None:
        """A prefill took instances holding decode KV: move those shares to idle instances with room (the cost the
        allocation weighed); a request whose share finds no room waits for the prefill instead."""
        idle = [e for e in self.instances if e.id in self._idle()]
        for d in self.decoding.values():
            for i in [i for i in d.shards if i in taken]:
                tokens = d.shards[i]
                room = [e for e in idle if e.id not in d.shards and e.free >= tokens + 1]
                if not room:
                    continue
                target = max(room, key=lambda e: e.free)
                self.evacuations += 1
                del d.shards[i]
                self.instances[i].kv_used -= tokens
                d.shards[target.id] = tokens  # last: it takes the new tokens
                target.kv_used += tokens
                d.ready_at = max(d.ready_at, now + self.cost.migrate(tokens))

    def _prefilled(self, batch: ESPBatch, end: float) -> None:
        shards = self.esp.scale_down(batch, self.instances)
        for r in batch.requests:
            original = self.origin.pop(r.id)
            original.prefilled = original.prompt_len
            moved = r.prompt_len * (1 - len(shards[r.id]) / len(batch.instances))
            ready = end if self.cfg.proactive or not moved else end + self.cost.migrate(int(moved))
            original.add_tokens(1, end)  # prefill (or the recompute of a preempted one) yields the next token
            if original.finished:
                self.finished += 1
                self._release(shards[r.id])
            else:
                self.decoding[original.id] = _Decoding(original, shards[r.id], ready)

    def _release(self, shards: dict[int, int]) -> None:
        for i, tokens in shards.items():
            self.instances[i].kv_used -= tokens

    # -- decode ----------------------------------------------------------------------------------------------
    def _start_steps(self, now: float, idle: set[int]) -> None:
        """One decode step for every request whose instances are all idle (growing a full one first), run as
        independent steps per connected group of instances (requests sharing an instance step together)."""
        stepping = [d for d in list(self.decoding.values())
                    if d.ready_at <= now and idle.issuperset(d.shards) and self._room_for_one(d, now, idle)]
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
            self.steps.append((now + self._step_time(members), instances, members))

    def _step_time(self, members: list[_Decoding]) -> float:
        """The slowest instance: linear ops for the requests it masters, attention over the KV it holds, and the
        per-layer query exchange for requests spread over several instances."""
        mastered: dict[int, int] = {}
        load: dict[int, list] = {}  # instance -> [requests mastered, attention seconds, spread requests]
        for d in members:
            m = self.esp.master(d.shards, mastered, self.cfg.multi_master)
            mastered[m] = mastered.get(m, 0) + 1
            for i, tokens in d.shards.items():
                row = load.setdefault(i, [0, 0.0, 0])
                row[1] += self.cost.batch.decode_attention(tokens)
                row[2] += len(d.shards) > 1
            load[m][0] += 1
        return max((self.cost.batch.linear_ops(b) if b else 0.0) + att
                   + (self.cost.exchange(spread) if spread else 0.0) for b, att, spread in load.values())

    def _room_for_one(self, d: _Decoding, now: float, idle: set[int]) -> bool:
        """Make room for the token this step appends; False if the request cannot step now."""
        tail = next(reversed(d.shards))
        if self.instances[tail].free > 0:
            self._book(d, tail)
            return True
        prefilling = {i for _, batch in self.prefilling for i in batch.instances}
        candidates = [e for e in self.instances if e.id not in prefilling]
        if self.cfg.scale_up:
            grow = self.esp.scale_up(d.shards, candidates)
            if grow is not None:  # it steps with grow's group, now if that is idle, else next time
                self.scale_ups += 1
                d.shards[grow] = 0
                if grow not in idle:
                    return False
                self._book(d, grow)
                return True
        else:  # move the whole KV to one instance that holds it and room to grow
            kv = sum(d.shards.values())
            need = kv + max(self.cfg.output_estimate - d.request.generated, 1)
            target = max((e for e in candidates if e.id not in d.shards and e.free >= need), default=None,
                         key=lambda e: e.free)
            if target is not None:
                self.migrations += 1
                self._release(d.shards)
                d.shards = {target.id: kv}
                target.kv_used += kv
                d.ready_at = now + self.cost.migrate(kv)
                return True
        self._preempt(d)
        return False

    def _book(self, d: _Decoding, instance: int) -> None:
        d.shards[instance] += 1
        self.instances[instance].kv_used += 1

    def _preempt(self, d: _Decoding) -> None:
        """Free its KV; it prefills prompt + generated tokens again, ahead of everyone waiting."""
        self.preemptions += 1
        self._release(d.shards)
        del self.decoding[d.request.id]
        r = d.request
        # prefilling the prompt and every token so far yields the next one, as its decode step would have
        proxy = Request(f"{r.id}/{self.preemptions}", r.arrival, r.prompt_len + r.generated,
                        r.output_len - r.generated)
        self.origin[proxy.id] = r
        self.pending.insert(0, proxy)

    def _stepped(self, end: float, stepping: list[_Decoding]) -> None:
        for d in stepping:
            d.request.add_tokens(1, end)
            if d.request.finished:
                self.finished += 1
                self._release(d.shards)
                del self.decoding[d.request.id]

    def results(self) -> Results:
        done = [r for r in self.requests if r.finished]
        span = (max(r.finished_at for r in done) - self.requests[0].arrival) if done else 0.0
        config = self.cfg.label() | {"preemptions": self.preemptions, "scale_ups": self.scale_ups,
                                     "migrations": self.migrations, "evacuations": self.evacuations,
                                     "kv_capacity_per_instance": self.sim.capacity,
                                     "kv_held_at_end": sum(e.kv_used for e in self.instances)}
        return Results(self.requests, self.rejected, span, time.perf_counter() - self.wall, config)
