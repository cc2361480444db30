"""TetriInfer's instance flip policy (3.5): an instance whose load stayed under `idle` for a whole window
changes role when the other role is busy (mean load over `busy`). The mechanism (drain, then flip) belongs to
whoever runs the instances (cluster/tetriinfer.py live, sim/disagg.py simulated); both measure load in
LoadWindows."""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence


class LoadWindow:
    """Load samples of one unit; their mean over the last `window` seconds once that much has been seen."""

    def __init__(self, window: float):
        self.window = window
        self.samples: collections.deque[tuple[float, float]] = collections.deque()
        self.since: float | None = None

    def add(self, t: float, load: float) -> None:
        if self.since is None:
            self.since = t
        self.samples.append((t, load))
        while self.samples[0][0] < t - self.window:
            self.samples.popleft()

    def mean(self, now: float) -> float | None:
        if self.since is None or now - self.since < self.window:
            return None
        return sum(v for _, v in self.samples) / len(self.samples)


@dataclasses.dataclass(frozen=True)
class FlipPolicy:
    idle: float = 0.1
    busy: float = 0.8
    window: float = 60.0
    check_every: float = 5.0

    def choose(self, prefill: Sequence[float | None], decode: Sequence[float | None]) -> tuple[str, int] | None:
        """prefill / decode: each unit's mean load over the window (None until a whole window is seen).
        Returns ("to_decode", prefill unit) or ("to_prefill", decode unit), keeping one unit of each role."""
        known_p = [x for x in prefill if x is not None]
        known_d = [x for x in decode if x is not None]
        if len(prefill) > 1 and known_d and sum(known_d) / len(known_d) > self.busy:
            idle = [(x, i) for i, x in enumerate(prefill) if x is not None and x < self.idle]
            if idle:
                return "to_decode", min(idle)[1]
        if len(decode) > 1 and known_p and sum(known_p) / len(known_p) > self.busy:
            idle = [(x, i) for i, x in enumerate(decode) if x is not None and x < self.idle]
            if idle:
                return "to_prefill", min(idle)[1]
        return None
