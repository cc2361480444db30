"""LoongServe's elastic sequence parallelism (ESP) scheduler: which pending requests start prefill now, on which
elastic instances, and split into which batches (LoongServe Section 5).

- Admission: pending requests in FCFS order while (memory) the KV they hold now plus what they will grow to
  (prompt + predicted output) fits the pool, and (compute) one iteration over the admitted set stays under the
  profiled knee, past which batching more stops paying.
- Preempting decode slots (admission, slides "2. GPU计算约束", second page): requests past the memory the pool
  would have free if the decoding requests' KV were packed onto as few instances as possible (LoongServe's
  isolated idle slots) need the free KV slots of instances that decodes run on, and pause those decodes for the
  prefill. They are admitted only while Gain > Cost (see preemption_gain / preemption_cost for the reading).
- Elastic instance allocation: start from the instances holding no KV; add the emptiest busy instance e while
  the chosen instances' free memory cannot hold the requests (slides: "当KV不够或需要提升性能", when the KV does
  not fit or to speed up), then while the time it saves, Gain = sum_r (T(R, E) - T(R, E + e)) / l_r, exceeds
  the time to move its KV away, Cost = sum_r V(e) / (bandwidth * l_r) (both per prompt token, so long prompts
  weigh less per token). A live cluster (no bandwidth given) pauses e's decodes instead of moving their KV: its
  Cost is their wait, T(R, E + e) per token each has generated (admission's preemption cost).
- Batching by dynamic programming: requests sorted longest first, instances emptiest first;
  f[i][k] = min over j, l of f[j][l] + (i - j) T(R[j..i], E[l..k]) (the summed prefill time of the requests) with
  the batch's tokens fitting those instances' free KV. Evaluated over contiguous ranges with numpy along one axis
  (O(n^2 m) Python steps). A live cluster may allow only some instance sets (`groups`: those it has compiled
  programs for); the DP skips the ranges that are not one.
- Scale-down after prefill with proactive migration: a request decodes on the fewest of its batch's instances
  whose free memory holds its prompt plus room to grow; while the prefill ring circulates K/V, each block is kept
  by the instance that will decode it, so nothing moves after the prefill ends (reactive migration would move the
  shares of the instances that leave).
- Multi-master scale-up in decode: a request whose KV tail instance is full grows its group by the emptiest other
  instance, which takes the new tokens; no KV moves. Each request has a master (computes its query and
  non-attention layers); with several masters per group the masters spread over the group's instances.

T(R, E) is LoongServe's model a + b*sum(l) + c*sum(l^2) at SP = |E|; SP sizes between fitted ones interpolate
in log2(SP). A request's l is what it prefills (`prefill_target`: its prompt, or a preempted request's recompute).
Pure Python + numpy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Collection, Iterable, Sequence

import numpy as np

from jaxserve.sched.cost_models import LoongServePrefill
from jaxserve.sched.request import Request


@dataclasses.dataclass
class ElasticInstance:
    id: int
    kv_capacity: int  # tokens
    kv_used: int = 0  # tokens held by requests decoding on it
    generated: tuple[int, ...] = ()  # tokens each request decoding on it has generated (live: what a prefill pauses)

    @property
    def free(self) -> int:
        return self.kv_capacity - self.kv_used


@dataclasses.dataclass(frozen=True, kw_only=True)
class ElasticPool:
    """The pool as an executor reports it to the ESP policy before a round."""

    instances: Sequence[ElasticInstance]  # every instance, by index (`id`); the policy books kept KV on them
    available: Collection[int]  # the instances the executor can start a prefill on now (a simulated one in a
    # decode step or a KV move cannot)
    generated: Sequence[int]  # tokens each decoding request has generated so far
    step_time: float  # seconds per decode iteration, measured


@dataclasses.dataclass(frozen=True)
class RunningDecodes:
    """What admission knows of the decoding requests, which a prefill sharing their instances would pause."""

    room: int  # KV tokens a prefill can take without sharing an instance with them (isolated_room of the pool)
    generated: tuple[int, ...]  # tokens each has generated so far (>= 1: prefill yields the first)
    avg_output: float  # mean output length of finished requests (a prior when none has finished)
    step_time: float  # seconds per decode iteration


def predicted_growth(estimate: float, generated: Iterable[int]) -> int:
    """KV tokens the decoding requests are predicted to add before they finish: each grows to the decode-length
    estimate (live and simulated alike: neither knows a request's true length)."""
    return int(sum(max(estimate - g, 0) for g in generated))


@dataclasses.dataclass(frozen=True)
class ESPBatch:
    requests: tuple[Request, ...]
    instances: tuple[int, ...]
    time: float


class ESPScheduler:
    def __init__(
        self,
        model: LoongServePrefill,
        tp: int,
        knee: float,
        migration_bandwidth: float | None,
        kv_bytes_per_token: float,
        output_estimate: int = 1024,
        max_sp: int | None = None,
        max_overtakes: int = 0,
        groups: Sequence[Sequence[int]] | None = None,
    ):
        """knee: seconds per prefill iteration past which admitting more stops paying (profiled);
        migration_bandwidth: bytes/s of one link (None: a busy instance's decodes pause, their KV stays);
        kv_bytes_per_token: the bytes of a token's KV that one link carries (an instance's GPUs move their TP
        shards over their own links at once); output_estimate: predicted decode length;
        max_sp: the most instances one batch may span (1 = independent replicas, the no-ESP baseline);
        max_overtakes: how many later requests may be admitted ahead of one the memory cannot take yet (0: the
        slides' strict FCFS; LoongServe's code bounds such out-of-order admissions, `max_num_ooe`);
        groups: the instance id sets a batch may run on (None: any)."""
        self.tp, self.bandwidth, self.max_sp = tp, migration_bandwidth, max_sp
        self.groups = None if groups is None else {frozenset(g) for g in groups}
        self.max_overtakes = max_overtakes
        self._overtaken: dict[str, int] = {}  # request id -> admissions that went ahead of it
        self.kv_bytes, self.output_estimate = kv_bytes_per_token, output_estimate
        self.use(model, knee)

    def use(self, model: LoongServePrefill, knee: float) -> None:
        """Plan with `model` and `knee` from now on (a pool's measured model in place of the prior it started
        with: cluster/build.py)."""
        sizes = sorted(sp for sp, t in model.coefficients if t == self.tp)
        if not sizes:
            raise ValueError(f"the model has no fit at TP={self.tp}")
        self.model, self.knee, self._sp = model, knee, sizes
        self._coef = np.array([model.coef((sp, self.tp)) for sp in sizes])  # [sizes, (a, b, c)]
        self._log_sp = np.log2(sizes)

    @staticmethod
    def served_knee(model: LoongServePrefill, tp: int, context: int) -> float:
        """The live cluster's knee: a batch is admitted while one iteration takes at most a `context`-token
        prompt's time on one instance."""
        return model.predict(1, tp, [context])

    def coef(self, sp: int) -> np.ndarray:
        """(a, b, c) at SP size sp, interpolated in log2(sp) between fitted sizes (held flat outside them)."""
        x = math.log2(sp)
        return np.array([np.interp(x, self._log_sp, self._coef[:, i]) for i in range(3)])

    def latency(self, lengths: Sequence[int], sp: int) -> float:
        a, b, c = self.coef(sp)
        lengths = np.asarray(lengths, np.float64)
        return float(a + b * lengths.sum() + c * (lengths**2).sum())

    def kv_need(self, r: Request) -> int:
        """KV tokens a request is predicted to hold at its end: what it prefills plus the predicted output, at most
        what it may still generate (max_tokens)."""
        return r.prefill_target + min(self.output_estimate, r.output_len - r.generated)

    # -- admission -------------------------------------------------------------------------------------------
    def admit(
        self,
        pending: Sequence[Request],
        instances: Sequence[ElasticInstance],
        growth: int = 0,
        decodes: RunningDecodes | None = None,
    ) -> list[Request]:
        """growth: tokens the requests already decoding are predicted to add before they finish; decodes: those
        requests (None: requests past the isolated memory take decode slots without weighing it, the ablation)."""
        capacity = sum(e.kv_capacity for e in instances)
        held = sum(e.kv_used for e in instances) + growth
        admitted: list[Request] = []
        direct = 0  # admitted[:direct] fit the isolated memory; the rest preempt decode slots
        for r in pending:  # FCFS: stop at the first that does not fit, unless it may still be overtaken
            need = sum(map(self.kv_need, admitted + [r]))
            if held + need > capacity:
                if self._overtaken.get(r.id, 0) < self.max_overtakes:
                    continue
                break
            lengths = [x.prefill_target for x in admitted + [r]]
            if admitted and self.latency(lengths, len(instances)) > self.knee:
                break
            if decodes is None or need <= decodes.room or not decodes.generated:
                direct += 1
            else:
                extra = admitted[direct:] + [r]
                prefill = self.latency(lengths, len(instances))
                if self.preemption_gain(extra, decodes) <= self.preemption_cost(prefill, decodes.generated):
                    break
            admitted.append(r)
        return admitted

    @staticmethod
    def preemption_gain(extra: Sequence[Request], decodes: RunningDecodes) -> float:
        """Slides: Gain = sum_{r in R'} (AvgLat_d - min(B.exec_time))^+ / r.input_len, "(平均Decode时延 - 最小执行
        时间) / 请求X的输入token长度". Read as: R' = `extra`, the requests that need the decode slots; AvgLat_d = the
        average decode time (avg_output steps) and B.exec_time = each paused decode's time so far (generated
        steps), so the positive part is how long R' would otherwise wait for the least advanced decode to end.
        The waiting time saved, per prompt token."""
        wait = decodes.step_time * max(decodes.avg_output - min(decodes.generated), 0.0)
        return wait * sum(1.0 / r.prefill_target for r in extra)

    @staticmethod
    def preemption_cost(prefill_time: float, generated: Sequence[int]) -> float:
        """Slides: Cost = sum_{r in B} T(R_p + R', E_p + G) / r.output_len, "T(所有加入的请求, 占据的GPU) / 被抢占的
        请求已经生成的token长度": each paused decode waits out the prefill of every admitted request on every
        offered instance (`prefill_time`), per token it has generated so far."""
        return prefill_time * sum(1.0 / g for g in generated)

    # -- elastic instance allocation -------------------------------------------------------------------------
    def allocate(self, requests: Sequence[Request], instances: Sequence[ElasticInstance]) -> list[ElasticInstance]:
        chosen = [e for e in instances if e.kv_used == 0]
        busy = sorted((e for e in instances if e.kv_used), key=lambda e: e.kv_used)
        lengths = [r.prefill_target for r in requests]
        inv = sum(1.0 / l for l in lengths)
        need = sum(map(self.kv_need, requests))
        for e in busy:
            if chosen and sum(x.free for x in chosen) >= need:  # till then e is taken whatever it costs
                gain = (self.latency(lengths, len(chosen)) - self.latency(lengths, len(chosen) + 1)) * inv
                if self.bandwidth is None:  # its decodes wait out the prefill
                    cost = self.preemption_cost(self.latency(lengths, len(chosen) + 1), e.generated)
                else:
                    cost = e.kv_used * self.kv_bytes / self.bandwidth * inv
                if gain <= cost:
                    break
            chosen.append(e)
        return chosen

    # -- batching --------------------------------------------------------------------------------------------
    def batch(self, requests: Sequence[Request], instances: Sequence[ElasticInstance]) -> list[ESPBatch]:
        """Contiguous batches of the requests (longest first) on contiguous instance ranges (emptiest first)
        minimising the requests' summed prefill time (each waits for its whole batch, so a batch's time counts
        once per request in it: side-by-side batches beat one stacked on a single instance); every request is
        placed or ValueError says why it cannot be."""
        reqs = sorted(requests, key=lambda r: -r.prefill_target)
        ins = sorted(instances, key=lambda e: e.kv_used)
        n, m = len(reqs), len(ins)
        if not n:
            return []
        if not m:
            raise ValueError("no instances to batch onto")
        lens = np.array([self.kv_need(r) for r in reqs], np.float64)
        p1 = np.concatenate([[0.0], np.cumsum([r.prefill_target for r in reqs])])
        p2 = np.concatenate([[0.0], np.cumsum([float(r.prefill_target) ** 2 for r in reqs])])
        pk = np.concatenate([[0.0], np.cumsum(lens)])
        free = np.concatenate([[0.0], np.cumsum([e.free for e in ins])])
        coef = np.array([self.coef(sp) for sp in range(1, m + 1)])  # [sp - 1, (a, b, c)]
        f = np.full((n + 1, m + 1), np.inf)
        f[0, :] = 0.0  # nothing placed yet (instances may stay unused)
        arg = {}
        for i in range(1, n + 1):
            for k in range(1, m + 1):
                best, where = f[i, k - 1], None  # instance k unused
                for j in range(i):  # batch = requests j+1..i
                    s1, s2, need = p1[i] - p1[j], p2[i] - p2[j], pk[i] - pk[j]
                    ls = np.arange(0 if self.max_sp is None else max(k - self.max_sp, 0), k)  # instances l+1..k
                    sp = k - ls
                    fits = free[k] - free[ls] >= need
                    if self.groups is not None:
                        fits &= np.array([frozenset(e.id for e in ins[l:k]) in self.groups for l in ls], bool)
                    cand = f[j, ls] + (i - j) * (coef[sp - 1, 0] + coef[sp - 1, 1] * s1 + coef[sp - 1, 2] * s2)
                    cand = np.where(fits, cand, np.inf)
                    l_best = int(np.argmin(cand))
                    if cand[l_best] < best:
                        best, where = float(cand[l_best]), (j, int(ls[l_best]))
                f[i, k] = best
                if where is not None:
                    arg[(i, k)] = where
        if not math.isfinite(f[n, m]):
            raise ValueError("the requests' KV does not fit the instances' free memory")
        out, i, k = [], n, m
        while i > 0:
            if (i, k) not in arg:
                k -= 1
                continue
            j, l = arg[(i, k)]
            group = tuple(e.id for e in ins[l:k])
            out.append(ESPBatch(tuple(reqs[j:i]), group, self.latency([r.prefill_target for r in reqs[j:i]], k - l)))
            i, k = j, l
        return out[::-1]

    def plan(
        self,
        pending: Sequence[Request],
        instances: Sequence[ElasticInstance],
        growth: int = 0,
        decodes: RunningDecodes | None = None,
    ) -> list[ESPBatch]:
        """One scheduling round: admit, allocate, batch. Admission checks memory over the whole pool; when the
        allocated instances' free memory cannot hold every admitted request, the latest admitted wait."""
        admitted = self.admit(pending, instances, growth, decodes)
        while admitted:
            try:
                batches = self.batch(admitted, self.allocate(admitted, instances))
            except ValueError:
                admitted.pop()
                continue
            self._count_overtakes(pending, admitted)
            return batches
        return []

    def _count_overtakes(self, pending: Sequence[Request], admitted: Sequence[Request]) -> None:
        """Each waiting request passed over by a later admitted one has been overtaken once more."""
        chosen = {r.id for r in admitted}
        last = max(i for i, r in enumerate(pending) if r.id in chosen)
        for r in pending[:last]:
            if r.id not in chosen:
                self._overtaken[r.id] = self._overtaken.get(r.id, 0) + 1
        for r in admitted:
            self._overtaken.pop(r.id, None)

    # -- decode: scale-down and scale-up ---------------------------------------------------------------------
    def scale_down(self, batch: ESPBatch, instances: Sequence[ElasticInstance]) -> dict[str, dict[int, int]]:
        """Where each request of a finished prefill batch keeps its KV to decode: request id -> {instance id:
        prompt tokens held}, on the fewest of the batch's instances (most free first) that hold the prompt plus
        the predicted output, split evenly; with no such set, on all of them. Updates the instances' kv_used."""
        by_id = {e.id: e for e in instances}
        out = {}
        for r in sorted(batch.requests, key=lambda r: -r.prefill_target):
            group = sorted((by_id[i] for i in batch.instances), key=lambda e: -e.free)
            need, room, size = self.kv_need(r), 0, len(group)
            for k, e in enumerate(group):
                room += e.free
                if room >= need:
                    size = k + 1
                    break
            out[r.id] = split_evenly(r.prefill_target, group[:size])
            for i, tokens in out[r.id].items():
                by_id[i].kv_used += tokens
        return out

    @staticmethod
    def scale_up(shards: dict[int, int], instances: Sequence[ElasticInstance]) -> int | None:
        """The instance a decoding request grows onto when its tail instance is full: the emptiest one outside
        its group with room; None when there is none (the request must wait or be preempted)."""
        outside = [e for e in instances if e.id not in shards and e.free > 0]
        return max(outside, key=lambda e: e.free).id if outside else None

    @staticmethod
    def master(shards: dict[int, int], mastered: dict[int, int], multi_master: bool = True) -> int:
        """The instance that runs a request's query and non-attention layers this step: with multi-master, the
        group's instance mastering the fewest requests so far (ties: the one holding more of its KV); otherwise
        the first instance of its group."""
        if not multi_master:
            return next(iter(shards))
        return min(shards, key=lambda i: (mastered.get(i, 0), -shards[i]))


def aligned_groups(n: int) -> list[tuple[int, ...]]:
    """The instance index sets a live cluster's batches may use (what it has programs for): power-of-two sizes,
    aligned (0-1, 2-3, 0-3, ...)."""
    sizes = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return [tuple(range(j, j + s)) for s in sizes for j in range(0, n - s + 1, s)]


def keeper(group: Sequence[ElasticInstance]) -> ElasticInstance:
    """The instance of a batch's group that keeps a prompt's whole KV after its prefill (the live cluster's
    scale-down): the one with the most free KV, ties to the lowest id."""
    return max(group, key=lambda e: (e.free, -e.id))


def isolated_room(instances: Sequence[ElasticInstance]) -> int:
    """KV tokens free on the instances left empty if the KV in use were packed onto the largest instances (the
    memory a prefill can take without sharing an instance with a decode; the packing is allocation's KV moves)."""
    left, out = sum(e.kv_used for e in instances), 0
    for e in sorted(instances, key=lambda e: -e.kv_capacity):
        if left > 0:
            left -= e.kv_capacity
        else:
            out += e.kv_capacity
    return out


def split_evenly(tokens: int, group: Sequence[ElasticInstance]) -> dict[int, int]:
    """Spread tokens over the group as evenly as each member's free memory allows (members with little room take
    what they can, the rest share the remainder); anything still left goes to the first member."""
    out, left = {}, tokens
    for k, e in enumerate(sorted(group, key=lambda e: e.free)):
        share = min(max(e.free, 0), -(-left // (len(group) - k)))
        out[e.id] = share
        left -= share
    out[group[0].id] += left
    room = {e.id: e.free - out[e.id] for e in group}
    return dict(sorted(out.items(), key=lambda kv: room[kv[0]]))  # the most room left goes last: it takes new tokens
