"""A prefill pool in simulation: requests arrive, a planner (CDSP, fixed SP, request-level SP) turns each into
chunks on instance groups given how long every instance is booked, and the booking advances (Tetris's own
profiler simulates prefill the same way, from Eq. (1)). TTFT is the end of a request's last chunk. Each
request is planned once, on arrival, as Tetris's dispatcher does. An Executor times the chunks with the function
the CDSP planner predicts with (Eq. (1) plus exposed cache balancing), so a planner blind to balancing pays it."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from jaxserve.sched.cdsp import Balancing, ChunkPlan, chunk_seconds
from jaxserve.sched.cluster import CDSPPolicy, Planner
from jaxserve.sched.decode_dispatch import PromptInfo
from jaxserve.sched.cost_models import TetrisPrefill
from jaxserve.config import SLO
from jaxserve.sim.capacity import highest_rate
from jaxserve.sim.workload import Workload


@dataclasses.dataclass
class PoolRun:
    ttft: np.ndarray  # seconds, per request in arrival order
    deadline: np.ndarray  # seconds after arrival
    chunks: np.ndarray  # chunks per request
    busy: float  # instance-seconds of prefill computed
    span: float  # first arrival to last first token
    plans: list[ChunkPlan]  # per request, chunk times relative to its arrival

    @property
    def slo_attainment(self) -> float:
        return float(np.mean(self.ttft <= self.deadline + 1e-9))

    def summary(self) -> dict[str, float]:
        p = np.percentile(self.ttft, [50, 90, 99])
        return {
            "ttft_p50": float(p[0]),
            "ttft_p90": float(p[1]),
            "ttft_p99": float(p[2]),
            "ttft_mean": float(self.ttft.mean()),
            "slo_attainment": self.slo_attainment,
            "chunks_mean": float(self.chunks.mean()),
        }


@dataclasses.dataclass(frozen=True)
class Executor:
    """Runs a plan's chunks in order, each once its group is free and the previous chunk is done, for Eq. (1)
    plus the cache balancing of its history onto its group that the fully-connected layers do not hide
    (cdsp.chunk_seconds). Only the times change: groups and chunk sizes are the planner's."""

    model: TetrisPrefill
    balancing: Balancing | None = None

    def __call__(self, plan: ChunkPlan, queues: np.ndarray) -> ChunkPlan:
        chunks, held, t = [], (), 0.0
        for c in plan.chunks:
            start = max(float(queues[list(c.group)].max()), t)
            balance = 0.0 if self.balancing is None else self.balancing.seconds(held, c.group, c.history)
            t = start + chunk_seconds(tuple(map(float, self.model.coef(c.sp))), c.tokens, c.history, balance)
            chunks.append(dataclasses.replace(c, start=start, end=t))
            held = c.group
        return ChunkPlan(tuple(chunks))


# Tetris and LoongServe call a load sustainable while latency stays within 25x of the light-load latency;
# per request, that is 25x its fastest isolated prefill.
SUSTAINABLE = SLO(ttft_slo=0.0, ttft_factor=25.0)


def run_pool(
    planner: Planner,
    workload: Workload,
    pool_size: int,
    best_latency: Callable[[int], float],
    slo: SLO = SUSTAINABLE,
    executor: Executor | None = None,
) -> PoolRun:
    """best_latency(tokens): the prompt's fastest isolated prefill, which its TTFT deadline scales with. The
    cluster scheduler's arrival decision plans and books each prompt (the planner sees every arrival time first).
    executor: times the chunks (default: as planned)."""
    scheduler = CDSPPolicy(planner, range(pool_size))
    n = len(workload)
    ttft, deadline, chunks = np.empty(n), np.empty(n), np.empty(n, np.int64)
    busy = 0.0
    plans = []
    for k, (t, tokens) in enumerate(zip(workload.arrivals.tolist(), workload.prompt_lens.tolist())):
        plan = scheduler.arrive(PromptInfo(tokens), t, retime=executor).plan
        plans.append(plan)
        ttft[k], chunks[k] = plan.ttft, len(plan.chunks)
        deadline[k] = slo.ttft(best_latency(tokens))
        busy += sum((c.end - c.start) * c.sp for c in plan.chunks)
    span = float(np.max(workload.arrivals + ttft) - workload.arrivals[0]) if n else 0.0
    return PoolRun(ttft, deadline, chunks, busy, span, plans)


def max_sustainable_rate(
    make_planner: Callable[[], Planner],
    workload_at: Callable[[float], Workload],
    pool_size: int,
    best_latency: Callable[[int], float],
    lo: float,
    hi: float,
    target: float = 0.9,
    iterations: int = 10,
    slo: SLO = SUSTAINABLE,
    executor: Executor | None = None,
) -> float:
    """Highest arrival rate in [lo, hi] with SLO attainment >= target."""

    def ok(rate: float) -> bool:
        run = run_pool(make_planner(), workload_at(rate), pool_size, best_latency, slo, executor)
        return run.slo_attainment >= target

    return highest_rate(ok, lo, hi, iterations)
