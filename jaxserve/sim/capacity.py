"""Max sustainable load: the highest arrival rate at which a run still meets its SLO target."""

from __future__ import annotations

from typing import Callable


def highest_rate(ok: Callable[[float], bool], lo: float, hi: float, iterations: int = 8) -> float:
    """Highest rate in [lo, hi] for which ok(rate) holds, by geometric bisection (ok is assumed to turn false
    once, as load rises); 0 if even lo fails."""
    if not ok(lo):
        return 0.0
    if ok(hi):
        return hi
    for _ in range(iterations):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
