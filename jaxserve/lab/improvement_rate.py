"""Tetris's load-aware improvement rate (Section 5.1): an offline simulator sweep (profile_improvement_rates)
picks, for each arrival rate, the improvement rate with the lowest mean TTFT; online, a sliding-window
arrival-rate estimate selects the recorded rate closest to what is observed, refreshed every `update_every`
seconds (Tetris: 30 s)."""

from __future__ import annotations

import bisect
import collections
import dataclasses
import json
from typing import Callable, Sequence

import numpy as np

from jaxserve.sched.cdsp import CDSPPlanner, ChunkPlan
from jaxserve.sched.cluster import Planner
from jaxserve.sim.prefill_pool import Executor, run_pool
from jaxserve.sim.workload import Workload


@dataclasses.dataclass(frozen=True)
class RateTable:
    arrival_rates: tuple[float, ...]  # ascending, requests/s
    improvement_rates: tuple[float, ...]  # the best one at each arrival rate

    def __post_init__(self):
        if not self.arrival_rates or len(self.arrival_rates) != len(self.improvement_rates):
            raise ValueError("a rate table needs one improvement rate per arrival rate, and at least one")
        if list(self.arrival_rates) != sorted(self.arrival_rates):
            raise ValueError("arrival rates must be ascending")

    def lookup(self, arrival_rate: float) -> float:
        """The improvement rate recorded for the arrival rate closest to `arrival_rate`."""
        rates = self.arrival_rates
        i = bisect.bisect_left(rates, arrival_rate)
        if i == len(rates) or (i > 0 and arrival_rate - rates[i - 1] <= rates[i] - arrival_rate):
            i -= 1
        return self.improvement_rates[i]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RateTable":
        raw = json.loads(text)
        return cls(tuple(raw["arrival_rates"]), tuple(raw["improvement_rates"]))


class ArrivalRate:
    """Requests per second over the last `window` seconds; until `window` seconds have been seen, the arrivals so
    far over the intervals between them (n - 1 over the span: n over the span would read 2 arrivals 1 s apart as
    2 req/s)."""

    def __init__(self, window: float = 30.0):
        if window <= 0:
            raise ValueError(f"window must be > 0, got {window}")
        self.window = window
        self._times: collections.deque[float] = collections.deque()
        self._first: float | None = None

    def observe(self, t: float) -> None:
        if self._first is None:
            self._first = t
        self._times.append(t)
        while self._times[0] < t - self.window:
            self._times.popleft()

    def warm(self, now: float) -> bool:
        """A whole window has been seen."""
        return self._first is not None and now - self._first >= self.window

    def rate(self, now: float) -> float | None:
        """The estimate, or None before two arrivals (nothing to measure yet)."""
        if self.warm(now):
            return len(self._times) / self.window
        if len(self._times) < 2 or now <= self._first:
            return None
        return (len(self._times) - 1) / (now - self._first)


class AdaptiveCDSP:
    """A CDSP planner whose improvement rate follows the observed load through a RateTable.

    Until a whole window has been seen, the rate is re-read at every arrival (the first lookup would otherwise
    come from one arrival and hold for `update_every`: Tetris's 30 s of a light-load rate under any load)."""

    def __init__(self, planner: CDSPPlanner, table: RateTable, window: float = 30.0, update_every: float = 30.0):
        self.planner, self.table, self.update_every = planner, table, update_every
        self.arrivals = ArrivalRate(window)
        self._next_update = -np.inf
        planner.improvement_rate = table.lookup(0.0)

    def on_arrival(self, t: float) -> None:
        self.arrivals.observe(t)
        rate = self.arrivals.rate(t)
        if rate is not None and (t >= self._next_update or not self.arrivals.warm(t)):
            self.planner.improvement_rate = self.table.lookup(rate)
            self._next_update = t + self.update_every

    def plan(self, tokens: int, queues: Sequence[float]) -> ChunkPlan:
        return self.planner.plan(tokens, queues)


# the improvement rates the offline profiler tries: Tetris 7.1's range, 0.05 to 0.75
IMPROVEMENT_RATES = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75)


def profile_improvement_rates(make_planner: Callable[[float], Planner], workload_at: Callable[[float], Workload],
                              pool_size: int, best_latency: Callable[[int], float], arrival_rates: Sequence[float],
                              candidates: Sequence[float] = IMPROVEMENT_RATES, executor: Executor | None = None
                              ) -> RateTable:
    """Tetris's offline profiler: at each arrival rate, the improvement rate with the lowest mean TTFT.
    make_planner(improvement_rate) builds a fresh planner; workload_at(rate) samples the length distribution."""
    best = []
    for rate in arrival_rates:
        workload = workload_at(rate)
        ttft = {r: run_pool(make_planner(r), workload, pool_size, best_latency, executor=executor).ttft.mean()
                for r in candidates}
        best.append(min(candidates, key=ttft.__getitem__))
    return RateTable(tuple(arrival_rates), tuple(best))
