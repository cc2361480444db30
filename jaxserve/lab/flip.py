"""TetriInfer's instance flip policy (3.5): an instance whose load stayed under `idle` for a whole window
changes role when the other role is busy (mean load over `busy`). The mechanism (load windows, drain, then flip)
belongs to whoever runs the instances (sim/disagg.py, which takes the policy as its FlipRule)."""

from __future__ import annotations

import dataclasses
from typing import Sequence


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
