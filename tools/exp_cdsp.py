"""Tetris in simulation: CDSP vs fixed SP 8/16 vs request-level SP on 16 LLaMA3-8B prefill instances (2 nodes
x 8 A100, TP=1; Eq. (1) fitted to Tetris Table 1) over Tetris-shaped Short / Medium / Long traces and the Azure
LLM inference traces (conv, code: their own prompt lengths and burstiness, rescaled to each load).

For each trace: the offline improvement-rate profile (Section 5.1, on a separate sample), then each planner's
max sustainable rate (90% of requests within 25x their fastest isolated prefill, the light-load bound Tetris and
LoongServe normalise to), P50 TTFT across loads (Fig. 8), single-chunk vs CDSP (Fig. 13) and fixed improvement
rates vs the adaptive one (Fig. 11). Prints the CDSP / best-fixed-SP capacity ratio; writes plots and JSON.

    .venv/bin/python tools/exp_cdsp.py [--requests=600] [--out=docs/figures]
"""

from __future__ import annotations

import dataclasses
import json
import os

from absl import app, flags
from tqdm import tqdm

from jaxserve.sched.cdsp import CDSPPlanner, FixedSPPlanner, Pool
from jaxserve.sched.cost_models import TetrisPrefill
from jaxserve.sched.improvement_rate import AdaptiveCDSP
from jaxserve.sched.profiles import tetris_table1_samples
from jaxserve.sim import plots
from jaxserve.sim.prefill_pool import max_sustainable_rate, profile_improvement_rates, run_pool
from jaxserve.sim.workload import LONG_CONTEXT, Workload, load_trace, long_context

FLAGS = flags.FLAGS
flags.DEFINE_integer("requests", 600, "Requests per simulated run.")
AZURE = ("azure_conv", "azure_code")
flags.DEFINE_list("traces", sorted(LONG_CONTEXT) + list(AZURE), "Traces to run: long-context shapes or Azure.")
flags.DEFINE_string("out", "docs/figures", "Where plots and cdsp.json go.")

MODEL = TetrisPrefill.fit(tetris_table1_samples())
POOL = Pool(nodes=2, per_node=8)
PROFILE_RATES = [0.25 * 2 ** (i / 2) for i in range(11)]  # 0.25 .. 8 req/s


def main(argv):
    del argv
    results, load_rows, sweep_rows = {}, [], []
    for kind in FLAGS.traces:
        rates = [r * (16 if kind in AZURE else 1) for r in PROFILE_RATES]  # short prompts: far higher loads

        def workload_at(rate: float, seed: int = 0) -> Workload:
            if kind in AZURE:  # the profile sample is the next stretch of the trace
                trace = load_trace(kind, limit=(1 + seed) * FLAGS.requests)
                tail = dataclasses.replace(trace, arrivals=trace.arrivals[seed * FLAGS.requests:],
                                           prompt_lens=trace.prompt_lens[seed * FLAGS.requests:],
                                           output_lens=trace.output_lens[seed * FLAGS.requests:])
                return tail.scaled(tail.rate / rate)
            return long_context(kind, FLAGS.requests, rate, seed=seed)

        profile = {chunking: profile_improvement_rates(
            lambda r, c=chunking: CDSPPlanner(MODEL, POOL, r, chunking=c), lambda rate: workload_at(rate, seed=1),
            POOL.size, MODEL.fastest, rates) for chunking in (True, False)}
        planners = {
            "CDSP (Tetris)": lambda: AdaptiveCDSP(CDSPPlanner(MODEL, POOL), profile[True]),
            "request-level SP": lambda: AdaptiveCDSP(CDSPPlanner(MODEL, POOL, chunking=False), profile[False]),
            "greedy request-level SP": lambda: CDSPPlanner(MODEL, POOL, 0.0, chunking=False),
            "fixed SP 8": lambda: FixedSPPlanner(MODEL, POOL, 8),
            "fixed SP 16": lambda: FixedSPPlanner(MODEL, POOL, 16),
        }
        capacity = {name: max_sustainable_rate(make, workload_at, POOL.size, MODEL.fastest, rates[0] / 5,
                                               rates[-1] * 2.5)
                    for name, make in tqdm(planners.items(), desc=f"{kind}: max sustainable rate")}
        best_fixed = max(capacity["fixed SP 8"], capacity["fixed SP 16"])
        ratio = capacity["CDSP (Tetris)"] / best_fixed
        results[kind] = {"max_sustainable_rate": capacity, "cdsp_over_best_fixed": ratio,
                         "improvement_rate_table": json.loads(profile[True].to_json())}
        print(f"{kind}: max sustainable rate " + ", ".join(f"{k} {v:.2f}" for k, v in capacity.items())
              + f" req/s; CDSP / best fixed SP = {ratio:.2f}x")
        for frac in (0.25, 0.5, 0.75, 0.9):
            rate = frac * capacity["CDSP (Tetris)"]
            for name, make in planners.items():
                s = run_pool(make(), workload_at(rate), POOL.size, MODEL.fastest).summary()
                load_rows.append({"label": f"{kind}: {name}", "trace": kind, "rate": rate, **s})
            for r in (0.1, 0.3, 0.5, 0.7):
                s = run_pool(CDSPPlanner(MODEL, POOL, r), workload_at(rate), POOL.size, MODEL.fastest).summary()
                sweep_rows.append({"label": f"{kind}: rate {r}", "trace": kind, "rate": rate, **s})
    adaptive = {(r["trace"], r["rate"]): r["ttft_mean"] for r in load_rows if r["label"].endswith("CDSP (Tetris)")}
    for r in sweep_rows:
        r["vs_adaptive"] = r["ttft_mean"] / adaptive[(r["trace"], r["rate"])]
    print(f"{'trace / planner':40s} {'rate':>6s} {'P50':>8s} {'P99':>8s} {'chunks':>6s}")
    for r in load_rows:
        print(f"{r['label']:40s} {r['rate']:6.2f} {r['ttft_p50']:8.2f} {r['ttft_p99']:8.2f} {r['chunks_mean']:6.2f}")
    os.makedirs(FLAGS.out, exist_ok=True)
    for kind in FLAGS.traces:
        rows = [r | {"label": r["label"].split(": ", 1)[1]} for r in load_rows if r["trace"] == kind]
        plots.metric_vs_load(rows, os.path.join(FLAGS.out, f"cdsp_{kind}_p50_vs_load.png"), "ttft_p50",
                             "P50 TTFT (s)", title=f"{kind} trace, 16 x A100 LLaMA3-8B prefill")
        rows = [r | {"label": r["label"].split(": ", 1)[1]} for r in sweep_rows if r["trace"] == kind]
        plots.metric_vs_load(rows, os.path.join(FLAGS.out, f"cdsp_{kind}_rate_sweep.png"), "vs_adaptive",
                             "mean TTFT / adaptive rate's", title=f"{kind}: fixed improvement rates", log=False)
    with open(os.path.join(FLAGS.out, "cdsp.json"), "w") as f:
        json.dump({"results": results, "load": load_rows, "sweep": sweep_rows}, f, indent=1)
    print(f"wrote {FLAGS.out}/cdsp_*_p50_vs_load.png, cdsp_*_rate_sweep.png, cdsp.json")


if __name__ == "__main__":
    app.run(main)
