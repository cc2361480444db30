"""TetriInfer's instance flip (3.5): an instance whose load stayed under `idle` for a whole window changes role
when the other role is busy (mean load over `busy`). FlipPolicy chooses; FlipController is the mechanism both
executors run (cluster/tetriinfer.py live, sim/disagg.py simulated): one flip at a time, the unit drains first
(no new work; what it has finishes), then changes role. What a unit is and how it drains is the executor's."""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Callable, Hashable, Sequence


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


class Flip(enum.Enum):
    """Which way a unit changes role."""

    TO_DECODE = "to_decode"  # a prefill unit joins the decode side
    TO_PREFILL = "to_prefill"  # a decode unit joins the prefill side


@dataclasses.dataclass(frozen=True)
class FlipPolicy:
    idle: float = 0.1
    busy: float = 0.8
    window: float = 60.0
    check_every: float = 5.0

    def choose(self, prefill: Sequence[float | None], decode: Sequence[float | None]) -> tuple[Flip, int] | None:
        """prefill / decode: each unit's mean load over the window (None until a whole window is seen).
        Returns (TO_DECODE, prefill unit) or (TO_PREFILL, decode unit), keeping one unit of each role."""
        known_p = [x for x in prefill if x is not None]
        known_d = [x for x in decode if x is not None]
        if len(prefill) > 1 and known_d and sum(known_d) / len(known_d) > self.busy:
            idle = [(x, i) for i, x in enumerate(prefill) if x is not None and x < self.idle]
            if idle:
                return Flip.TO_DECODE, min(idle)[1]
        if len(decode) > 1 and known_p and sum(known_p) / len(known_p) > self.busy:
            idle = [(x, i) for i, x in enumerate(decode) if x is not None and x < self.idle]
            if idle:
                return Flip.TO_PREFILL, min(idle)[1]
        return None


def decode_busy(kv_committed: int, kv_capacity: int, running: int, max_num_seqs: int) -> float:
    """A decode instance's load for the flip policy: the fuller of its KV memory (what its admission policy
    counts as taken: ReplicaScheduler.committed) and its batch."""
    return max(kv_committed / kv_capacity, running / max_num_seqs)


class FlipController:
    """Flips units between the prefill and the decode role, one at a time. Each check, `finish` ends the flip
    whose unit has drained, then `start` samples the load of every unit in its role (the draining one aside)
    into a LoadWindow per (role, unit) and, if no flip is under way, starts the one the policy chooses."""

    def __init__(self, policy: FlipPolicy):
        self.policy = policy
        self.joining: Hashable | None = None  # a prefill unit draining before it decodes
        self.leaving: Hashable | None = None  # a decode unit draining before it prefills
        self._windows: dict[tuple[str, Hashable], LoadWindow] = {}

    def finish(
        self, prefill_drained: Callable[[Hashable], bool], decode_drained: Callable[[Hashable], bool]
    ) -> list[tuple[Flip, Hashable]]:
        """The flips done now that their unit has drained: (TO_DECODE, unit) and (TO_PREFILL, unit)."""
        done = []
        if self.joining is not None and prefill_drained(self.joining):
            done.append((Flip.TO_DECODE, self.joining))
            self._windows.pop(("prefill", self.joining), None)
            self.joining = None
        if self.leaving is not None and decode_drained(self.leaving):
            done.append((Flip.TO_PREFILL, self.leaving))
            self._windows.pop(("decode", self.leaving), None)
            self.leaving = None
        return done

    def start(
        self, now: float, prefill: dict[Hashable, float], decode: dict[Hashable, float]
    ) -> tuple[Flip, Hashable] | None:
        """prefill / decode: each unit's load now, by unit (in the order the policy should see them). The flip
        started, (TO_DECODE, a prefill unit) or (TO_PREFILL, a decode unit), or None."""
        for role, loads in (("prefill", prefill), ("decode", decode)):
            for unit, load in loads.items():
                self._window(role, unit).add(now, load)
        if self.joining is not None or self.leaving is not None:
            return None
        choice = self.policy.choose(
            [self._window("prefill", u).mean(now) for u in prefill],
            [self._window("decode", u).mean(now) for u in decode],
        )
        if choice is None:
            return None
        kind, i = choice
        if kind is Flip.TO_DECODE:
            self.joining = list(prefill)[i]
            return kind, self.joining
        self.leaving = list(decode)[i]
        return kind, self.leaving

    def _window(self, role: str, unit: Hashable) -> LoadWindow:
        if (role, unit) not in self._windows:
            self._windows[role, unit] = LoadWindow(self.policy.window)
        return self._windows[role, unit]
