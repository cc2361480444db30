"""Tetris's load-aware improvement rate (Section 5.1), online: a sliding-window arrival-rate estimate selects, from
a table profiled offline (lab/improvement_rate.py: for each arrival rate, the improvement rate with the lowest mean
TTFT in simulation), the rate recorded for the load closest to what is observed, refreshed every `update_every`
seconds (Tetris: 30 s). Live: `--improvement_rates=FILE` (cluster/build.py); the simulator wraps its planner the
same way.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import json
import math
import pathlib
from typing import Sequence

import numpy as np

from jaxserve.sched.cdsp import CDSPPlanner, ChunkPlan


@dataclasses.dataclass(frozen=True)
class RateTable:
    arrival_rates: tuple[float, ...]  # ascending, requests/s
    improvement_rates: tuple[float, ...]  # the best one at each arrival rate

    def __post_init__(self):
        if not self.arrival_rates or len(self.arrival_rates) != len(self.improvement_rates):
            raise ValueError("a rate table needs one improvement rate per arrival rate, and at least one")
        if list(self.arrival_rates) != sorted(self.arrival_rates) or not all(
            0 <= r < float("inf") for r in self.arrival_rates
        ):
            raise ValueError("arrival rates must be ascending, finite and >= 0")
        if not all(0 <= r < 1 for r in self.improvement_rates):
            raise ValueError(f"improvement rates must be in [0, 1), got {self.improvement_rates}")

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


def read_rate_table(path: pathlib.Path) -> RateTable:
    """The table in `path`; ValueError naming the file if it is not one."""
    try:
        return RateTable.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--improvement_rates={path}: not an improvement-rate table ({type(e).__name__}: {e})") from e


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
        """The estimate, or None before two arrivals (nothing to measure yet); arrivals all at one instant (a
        burst the cluster took between two steps) read as an unbounded rate."""
        if self.warm(now):
            return len(self._times) / self.window
        if len(self._times) < 2:
            return None
        if now <= self._first:
            return math.inf
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

    def groups(self) -> list[tuple[int, ...]]:
        return self.planner.groups()
