"""The simulator's front door, shared by `python -m jaxserve simulate` and notebooks: build a workload, run it
under a cluster config, search for the highest load that still meets the SLOs."""

from __future__ import annotations

import os
from typing import Any, Callable

from jaxserve.config import SimConfig, replace
from jaxserve.sim.capacity import highest_rate
from jaxserve.sim.metrics import Results
from jaxserve.sim.simulator import Simulator
from jaxserve.sim.workload import TRACES, Workload, load_trace, read_trace_file, synthetic_mix

WORKLOADS = TRACES + ("mix",)


def make_workload(
    trace: str,
    rate: float | None,
    requests: int | None = None,
    seed: int = 0,
    long_fraction: float = 0.05,
    max_len: int | None = None,
    arrival: str = "poisson",
    cv: float = 1.0,
) -> Workload:
    """A packaged trace or a trace file (CSV or JSON Lines: workload.read_trace_file), rescaled to `rate` when
    given, or 'mix': short requests from Azure conv plus `long_fraction` long ones of 128K-1M tokens, arriving
    as a Poisson or gamma (coefficient of variation `cv`) process."""
    if trace == "mix":
        if rate is None or requests is None:
            raise ValueError("the 'mix' workload needs --rate and --requests")
        return synthetic_mix(requests, rate, long_fraction=long_fraction, seed=seed, arrival=arrival, cv=cv)
    if trace not in TRACES:
        if trace.endswith((".csv", ".jsonl", ".json")) or os.sep in trace:
            return read_trace_file(trace, rate=rate, seed=seed, limit=requests, max_len=max_len)
        raise ValueError(f"unknown trace {trace!r}; choose from {list(WORKLOADS)}, or give a .csv or .jsonl file")
    return load_trace(trace, rate=rate, seed=seed, limit=requests, max_len=max_len)


def simulate(workload: Workload, config: SimConfig = SimConfig(), progress: bool = True) -> Results:
    return Simulator(config).run(workload, progress=progress)


def config_for(policy: str = "lars", **settings: Any) -> SimConfig:
    """A simulated cluster by its settings' names (jaxserve/config.py: SimConfig and its scheduler's), e.g.
    config_for("lars", tp=8, stages=2, space_sharing=True); the rest are SimConfig's defaults."""
    return replace(SimConfig(), policy=policy, **settings)


def max_sustainable_rate(
    config: SimConfig,
    workload_at: Callable[[float], Workload],
    lo: float,
    hi: float,
    target: float = 0.9,
    iterations: int = 8,
) -> tuple[float, list[dict]]:
    """Highest arrival rate in [lo, hi] whose SLO attainment stays >= target, by geometric bisection (attainment
    falls as load rises). Returns the rate and every probe (rate, attainment)."""
    probes = []

    def ok(rate: float) -> bool:
        att = Simulator(config).run(workload_at(rate), progress=False).summary()["all"]["slo_attainment"]
        probes.append({"rate": rate, "slo_attainment": att})
        return att >= target

    return highest_rate(ok, lo, hi, iterations), probes
