"""Tetris's load-aware improvement rate (Section 5.1), offline: a simulator sweep (profile_improvement_rates) picks,
for each arrival rate, the improvement rate with the lowest mean TTFT. The table it makes is read online by
sched/improvement_rate.py's AdaptiveCDSP (live: `--improvement_rates=FILE`; tools/profile/improvement_rates.py
writes one for a live pool's measured Eq. (1))."""

from __future__ import annotations

from typing import Callable, Sequence

from jaxserve.sched.cluster import Planner
from jaxserve.sched.improvement_rate import RateTable
from jaxserve.sim.prefill_pool import Executor, run_pool
from jaxserve.sim.workload import Workload


# the improvement rates the offline profiler tries: Tetris 7.1's range, 0.05 to 0.75
IMPROVEMENT_RATES = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75)


def profile_improvement_rates(
    make_planner: Callable[[float], Planner],
    workload_at: Callable[[float], Workload],
    pool_size: int,
    best_latency: Callable[[int], float],
    arrival_rates: Sequence[float],
    candidates: Sequence[float] = IMPROVEMENT_RATES,
    executor: Executor | None = None,
) -> RateTable:
    """Tetris's offline profiler: at each arrival rate, the improvement rate with the lowest mean TTFT.
    make_planner(improvement_rate) builds a fresh planner; workload_at(rate) samples the length distribution."""
    best = []
    for rate in arrival_rates:
        workload = workload_at(rate)
        ttft = {
            r: run_pool(make_planner(r), workload, pool_size, best_latency, executor=executor).ttft.mean()
            for r in candidates
        }
        best.append(min(candidates, key=ttft.__getitem__))
    return RateTable(tuple(arrival_rates), tuple(best))
