"""Tetris in simulation: CDSP vs fixed SP 8/16 vs request-level SP on 16 LLaMA3-8B prefill instances (2 nodes
x 8 A100, TP=1; Eq. (1) fitted to Tetris Table 1) over Tetris-shaped Short / Medium / Long traces and the Azure
LLM inference traces (conv, code: their own prompt lengths and burstiness, rescaled to each load). Chunks pay the
cache balancing their FC layers do not hide (A100 send/recv profile), and the CDSP planner plans for it.

Controls: request-level SP is Algorithm 2 alone (one SP size per request, the same load-aware rule, no chunking:
Tetris's Fig. 13 ablation), once with CDSP's improvement-rate table and once with a table profiled for it;
greedy request-level SP (rate 0); fixed SP 8 and 16 (Tetris 7.1's baselines).

For each trace: the offline improvement-rate profile (Section 5.1, on a separate sample), then each planner's
max sustainable rate (90% of requests within 25x their fastest isolated prefill, the light-load bound Tetris and
LoongServe normalise to), P50 TTFT across loads (Fig. 8), single-chunk vs CDSP (Fig. 13) and fixed improvement
rates vs the adaptive one (Fig. 11). Prints capacities, CDSP's capacity over the best fixed SP and over
request-level SP, and each control's P50 / P99 TTFT over CDSP's at 25-90% of CDSP's capacity and at fixed SP 8's
(Fig. 9's critical load); writes plots and JSON.

model="70b": Tetris ran LLaMA3-70B on 8 nodes of A100 with TP-4 prefill instances, 1:1 P/D, and no Table 1 for it.
The closest here is 8 TP-4 instances (2 per node) of the Llama-2-70B H100 profile, Eq. (1) fitted to the ring-SP
prefill times that profile gives (linear ops of each instance's share, attention over SP, the ring's unhidden
sends); fixed SP 4 and 8 are the baselines (all 8 instances: Tetris's over-provisioned SP-8).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

from tqdm import tqdm

from jaxserve.lab.improvement_rate import profile_improvement_rates
from jaxserve.sched.cdsp import Balancing, CDSPPlanner, FixedSPPlanner, Pool
from jaxserve.sched.cost_models import TetrisPrefill
from jaxserve.sched.improvement_rate import AdaptiveCDSP
from jaxserve.sched.profiles import tetris_table1_samples
from jaxserve.sim import plots
from jaxserve.sim.cluster import pool_eq1
from jaxserve.sim.prefill_pool import Executor, max_sustainable_rate, run_pool
from jaxserve.sim.workload import LONG_CONTEXT, Workload, load_trace, long_context

AZURE = ("azure_conv", "azure_code")


@dataclasses.dataclass(frozen=True)
class Options:
    requests: int = 600
    traces: Sequence[str] = (*sorted(LONG_CONTEXT), *AZURE)
    model: str = "8b"  # or "70b"
    out: str = "docs/figures"


HELP = {  # each option's help on the command line (python -m jaxserve.lab cdsp)
    "requests": "Requests per simulated run.",
    "traces": "Traces to run: long-context shapes or Azure.",
    "out": "Where plots and cdsp.json (cdsp_70b.json) go.",
    "model": "8b: Tetris Table 1 on 16 TP-1 A100 instances; 70b: 8 TP-4 Llama-2-70B instances on H100 (the closest "
    "profile to Tetris's A100 70B), Eq. (1) fitted to ring-SP prefill times from the profile (sim/esp_cost.ESPCost).",
}
CHOICES = {"model": ["8b", "70b"]}  # the options that take one of a few values


TINY = Options(requests=40, traces=("short",))


@dataclasses.dataclass(frozen=True)
class Setup:
    model: TetrisPrefill
    pool: Pool
    balancing: Balancing
    fixed: tuple[int, int]  # the fixed-SP baselines' sizes
    name: str  # for titles
    tag: str  # for file names

    @property
    def run(self) -> Executor:
        return Executor(self.model, self.balancing)


def setup(model: str) -> Setup:
    if model == "8b":
        pool = Pool(nodes=2, per_node=8)
        return Setup(
            TetrisPrefill.fit(tetris_table1_samples()),
            pool,
            Balancing.from_profile("a100_llama3_8b", pool.per_node),
            (8, 16),
            "16 x A100 LLaMA3-8B",
            "",
        )
    # Tetris's 70B: 8 nodes, P/D 1:1, TP-4 prefill instances: 8 instances, 2 per node
    profile, tp, pool = "h100_llama2_70b", 4, Pool(nodes=4, per_node=2)
    return Setup(
        pool_eq1(profile, tp, pool),
        pool,
        Balancing.from_profile(profile, pool.per_node, tp),
        (4, 8),
        "8 x (4 x H100) Llama-2-70B",
        "_70b",
    )


CDSP, SAME, OWN = "CDSP (Tetris)", "request-level SP (CDSP's rates)", "request-level SP (own rates)"
PROFILE_RATES = [0.25 * 2 ** (i / 2) for i in range(11)]  # 0.25 .. 8 req/s


def run(opts: Options) -> dict:
    su = setup(opts.model)
    MODEL, POOL, BALANCING, RUN = su.model, su.pool, su.balancing, su.run
    small, large = su.fixed
    results, load_rows, sweep_rows = {}, [], []
    for kind in opts.traces:
        rates = [r * (16 if kind in AZURE else 1) for r in PROFILE_RATES]  # short prompts: far higher loads

        def workload_at(rate: float, seed: int = 0) -> Workload:
            if kind in AZURE:  # the profile sample is the next stretch of the trace
                trace = load_trace(kind, limit=(1 + seed) * opts.requests)
                tail = dataclasses.replace(
                    trace,
                    arrivals=trace.arrivals[seed * opts.requests :],
                    prompt_lens=trace.prompt_lens[seed * opts.requests :],
                    output_lens=trace.output_lens[seed * opts.requests :],
                )
                return tail.scaled(tail.rate / rate)
            return long_context(kind, opts.requests, rate, seed=seed)

        profile = {
            chunking: profile_improvement_rates(
                lambda r, c=chunking: CDSPPlanner(MODEL, POOL, r, chunking=c, balancing=BALANCING),
                lambda rate: workload_at(rate, seed=1),
                POOL.size,
                MODEL.fastest,
                rates,
                executor=RUN,
            )
            for chunking in (True, False)
        }
        planners = {
            CDSP: lambda: AdaptiveCDSP(CDSPPlanner(MODEL, POOL, balancing=BALANCING), profile[True]),
            SAME: lambda: AdaptiveCDSP(CDSPPlanner(MODEL, POOL, chunking=False), profile[True]),
            OWN: lambda: AdaptiveCDSP(CDSPPlanner(MODEL, POOL, chunking=False), profile[False]),
            "greedy request-level SP": lambda: CDSPPlanner(MODEL, POOL, 0.0, chunking=False),
            f"fixed SP {small}": lambda: FixedSPPlanner(MODEL, POOL, small),
            f"fixed SP {large}": lambda: FixedSPPlanner(MODEL, POOL, large),
        }
        capacity = {
            name: max_sustainable_rate(
                make, workload_at, POOL.size, MODEL.fastest, rates[0] / 5, rates[-1] * 2.5, executor=RUN
            )
            for name, make in tqdm(planners.items(), desc=f"{kind}: max sustainable rate")
        }
        best_fixed = max(capacity[f"fixed SP {small}"], capacity[f"fixed SP {large}"])
        ratios = {
            "best fixed SP": capacity[CDSP] / best_fixed,
            SAME: capacity[CDSP] / capacity[SAME],
            OWN: capacity[CDSP] / capacity[OWN],
        }
        results[kind] = {
            "max_sustainable_rate": capacity,
            "cdsp_over": ratios,
            "improvement_rate_table": {
                "CDSP": json.loads(profile[True].to_json()),
                "request-level": json.loads(profile[False].to_json()),
            },
        }
        print(
            f"{kind}: max sustainable rate "
            + ", ".join(f"{k} {v:.2f}" for k, v in capacity.items())
            + " req/s; CDSP capacity over "
            + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
        )
        loads = [(f"{frac:.0%} of CDSP", frac * capacity[CDSP]) for frac in (0.25, 0.5, 0.75, 0.9)]
        critical = [(f"fixed SP {small}'s", capacity[f"fixed SP {small}"])] if capacity[f"fixed SP {small}"] > 0 else []
        for load, rate in loads + critical:
            for name, make in planners.items():
                s = run_pool(make(), workload_at(rate), POOL.size, MODEL.fastest, executor=RUN).summary()
                load_rows.append({"label": f"{kind}: {name}", "trace": kind, "load": load, "rate": rate, **s})
        for load, rate in loads:
            for r in (0.1, 0.3, 0.5, 0.7):
                s = run_pool(
                    CDSPPlanner(MODEL, POOL, r, balancing=BALANCING),
                    workload_at(rate),
                    POOL.size,
                    MODEL.fastest,
                    executor=RUN,
                ).summary()
                sweep_rows.append({"label": f"{kind}: rate {r}", "trace": kind, "load": load, "rate": rate, **s})
    cdsp = {(r["trace"], r["load"]): r for r in load_rows if r["label"].endswith(CDSP)}
    for r in sweep_rows:
        r["vs_adaptive"] = r["ttft_mean"] / cdsp[(r["trace"], r["load"])]["ttft_mean"]
    # Fig. 13 / Fig. 9 style: a control's TTFT over CDSP's at the same load (> 1: CDSP is faster)
    print(
        f"\n{'trace / planner':45s} {'load':>13s} {'rate':>7s} {'P50':>7s} {'P99':>7s} {'chunks':>6s} "
        f"{'P50/CDSP':>8s} {'P99/CDSP':>8s}"
    )
    for r in load_rows:
        c = cdsp[(r["trace"], r["load"])]
        print(
            f"{r['label']:45s} {r['load']:>13s} {r['rate']:7.2f} {r['ttft_p50']:7.2f} {r['ttft_p99']:7.2f} "
            f"{r['chunks_mean']:6.2f} {r['ttft_p50'] / c['ttft_p50']:8.2f} {r['ttft_p99'] / c['ttft_p99']:8.2f}"
        )
    os.makedirs(opts.out, exist_ok=True)
    for kind in opts.traces:
        rows = [
            r | {"label": r["label"].split(": ", 1)[1]}
            for r in load_rows
            if r["trace"] == kind and r["load"].endswith("of CDSP")
        ]
        plots.metric_vs_load(
            rows,
            os.path.join(opts.out, f"cdsp{su.tag}_{kind}_p50_vs_load.png"),
            "ttft_p50",
            "P50 TTFT (s)",
            title=f"{kind} trace, {su.name} prefill",
        )
        rows = [r | {"label": r["label"].split(": ", 1)[1]} for r in sweep_rows if r["trace"] == kind]
        plots.metric_vs_load(
            rows,
            os.path.join(opts.out, f"cdsp{su.tag}_{kind}_rate_sweep.png"),
            "vs_adaptive",
            "mean TTFT / adaptive rate's",
            title=f"{kind}: fixed improvement rates",
            log=False,
        )
    out = {"results": results, "load": load_rows, "sweep": sweep_rows}
    with open(os.path.join(opts.out, f"cdsp{su.tag}.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {opts.out}/cdsp{su.tag}_*_p50_vs_load.png, cdsp{su.tag}_*_rate_sweep.png, cdsp{su.tag}.json")
    return out
