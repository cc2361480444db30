"""LoongServe's elastic sequence parallelism (ESP) scheduler: which pending requests start prefill now, on which
elastic instances, and split into which batches (LoongServe Section 5; slides in ../shared/seeds/002).

- Admission: pending requests in FCFS order while (memory) the KV they hold now plus what they will grow to
  (prompt + predicted output) fits the pool, and (compute) one iteration over the admitted set stays under the
  profiled knee, past which batching more stops paying.
- Elastic instance allocation: start from the idle instances; add the emptiest busy instance e while the time
  it saves, Gain = sum_r (T(R, E) - T(R, E + e)) / l_r, exceeds the time to move its KV away,
  Cost = sum_r V(e) / (bandwidth * l_r) (both per prompt token, so long prompts weigh less per token).
- Batching by dynamic programming: requests sorted longest first, instances emptiest first;
  f[i][k] = min over j, l of f[j][l] + T(R[j..i], E[l..k]) with the batch's tokens fitting those instances' free
  KV. Evaluated over contiguous ranges with numpy along one axis (O(n^2 m) Python steps).

T(R, E) is LoongServe's model a + b*sum(l) + c*sum(l^2) at SP = |E|; SP sizes between fitted ones interpolate
in log2(SP). Pure Python + numpy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from jaxserve.sched.cost_models import LoongServePrefill
from jaxserve.sched.request import Request


@dataclasses.dataclass
class ElasticInstance:
    id: int
    kv_capacity: int  # tokens
    kv_used: int = 0  # tokens held by requests decoding on it

    @property
    def free(self) -> int:
        return self.kv_capacity - self.kv_used


@dataclasses.dataclass(frozen=True)
class ESPBatch:
    requests: tuple[Request, ...]
    instances: tuple[int, ...]
    time: float


class ESPScheduler:
    def __init__(self, model: LoongServePrefill, tp: int, knee: float, migration_bandwidth: float,
                 kv_bytes_per_token: float, output_estimate: int = 1024):
        """knee: seconds per prefill iteration past which admitting more stops paying (profiled);
        migration_bandwidth: bytes/s an instance's KV moves at; output_estimate: predicted decode length."""
        self.tp, self.knee, self.bandwidth = tp, knee, migration_bandwidth
        self.kv_bytes, self.output_estimate = kv_bytes_per_token, output_estimate
        self._sp = sorted(sp for sp, t in model.coefficients if t == tp)
        if not self._sp:
            raise ValueError(f"the model has no fit at TP={tp}")
        self._coef = np.array([model.coef((sp, tp)) for sp in self._sp])  # [sizes, (a, b, c)]
        self._log_sp = np.log2(self._sp)

    def coef(self, sp: int) -> np.ndarray:
        """(a, b, c) at SP size sp, interpolated in log2(sp) between fitted sizes (held flat outside them)."""
        x = math.log2(sp)
        return np.array([np.interp(x, self._log_sp, self._coef[:, i]) for i in range(3)])

    def latency(self, lengths: Sequence[int], sp: int) -> float:
        a, b, c = self.coef(sp)
        lengths = np.asarray(lengths, np.float64)
        return float(a + b * lengths.sum() + c * (lengths**2).sum())

    # -- admission -------------------------------------------------------------------------------------------
    def admit(self, pending: Sequence[Request], instances: Sequence[ElasticInstance]) -> list[Request]:
        capacity = sum(e.kv_capacity for e in instances)
        held = sum(e.kv_used for e in instances)
        admitted: list[Request] = []
        for r in pending:  # FCFS: stop at the first that does not fit, so nobody is overtaken
            future = held + sum(x.prompt_len + self.output_estimate for x in admitted + [r])
            if future > capacity:
                break
            if admitted and self.latency([x.prompt_len for x in admitted + [r]], len(instances)) > self.knee:
                break
            admitted.append(r)
        return admitted

    # -- elastic instance allocation -------------------------------------------------------------------------
    def allocate(self, requests: Sequence[Request], instances: Sequence[ElasticInstance]) -> list[ElasticInstance]:
        chosen = [e for e in instances if e.kv_used == 0]
        busy = sorted((e for e in instances if e.kv_used), key=lambda e: e.kv_used)
        lengths = [r.prompt_len for r in requests]
        inv = sum(1.0 / l for l in lengths)
        for e in busy:
            if chosen:  # with no idle instance the emptiest busy one is taken whatever it costs
                gain = (self.latency(lengths, len(chosen)) - self.latency(lengths, len(chosen) + 1)) * inv
                cost = e.kv_used * self.kv_bytes / self.bandwidth * inv
                if gain <= cost:
                    break
            chosen.append(e)
        return chosen

    # -- batching --------------------------------------------------------------------------------------------
    def batch(self, requests: Sequence[Request], instances: Sequence[ElasticInstance]) -> list[ESPBatch]:
        """Contiguous batches of the requests (longest first) on contiguous instance ranges (emptiest first)
        minimising the summed batch time; every request is placed or ValueError says why it cannot be."""
        reqs = sorted(requests, key=lambda r: -r.prompt_len)
        ins = sorted(instances, key=lambda e: e.kv_used)
        n, m = len(reqs), len(ins)
        if not n:
            return []
        if not m:
            raise ValueError("no instances to batch onto")
        lens = np.array([r.prompt_len + self.output_estimate for r in reqs], np.float64)  # KV each will hold
        p1 = np.concatenate([[0.0], np.cumsum([r.prompt_len for r in reqs])])
        p2 = np.concatenate([[0.0], np.cumsum([float(r.prompt_len) ** 2 for r in reqs])])
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
                    ls = np.arange(k)  # instances l+1..k
                    sp = k - ls
                    fits = free[k] - free[ls] >= need
                    cand = f[j, ls] + coef[sp - 1, 0] + coef[sp - 1, 1] * s1 + coef[sp - 1, 2] * s2
                    cand = np.where(fits, cand, np.inf)
                    l_best = int(np.argmin(cand))
                    if cand[l_best] < best:
                        best, where = float(cand[l_best]), (j, l_best)
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
            out.append(ESPBatch(tuple(reqs[j:i]), group, self.latency([r.prompt_len for r in reqs[j:i]], k - l)))
            i, k = j, l
        return out[::-1]

    def plan(self, pending: Sequence[Request], instances: Sequence[ElasticInstance]) -> list[ESPBatch]:
        """One scheduling round: admit, allocate, batch."""
        admitted = self.admit(pending, instances)
        if not admitted:
            return []
        return self.batch(admitted, self.allocate(admitted, instances))
