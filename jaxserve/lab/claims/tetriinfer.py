"""TetriInfer's headline comparison (5.1, Figs. 11-15) in simulation: a colocated baseline against TetriInfer's
disaggregated cluster, on TetriInfer's workload classes built from Azure conv (prompt, output) pairs.

- Colocated (the baseline, and a control with more GPUs): `--colocated` TP-1 replicas of sim/simulator.py,
  FCFS, chunked prefill mixed with decodes in each iteration (several prefills per batch within a 50 ms budget,
  ~512-700 prefill tokens, like vLLM's chunked-prefill token budget). The paper's baseline is 2023 vLLM without
  chunked prefill, which the paper blames for prefill/decode interference, and with a fixed batch of 16 (5.2.1;
  5.1 credits TetriInfer's "variable decode batch size over vLLM's fixed batch size"): `--capped` adds the
  baseline with at most that many requests running per replica, so a burst queues for batch slots.
- The paper's TetriInfer has twice the baseline's GPUs (one prefill + one decode instance against one vLLM
  instance): its "38% less resources" is instance wall time, not fewer GPUs. Layouts here: the same GPUs
  (2+2 against 4), the paper's 2x (4+4), fewer (1+2); the colocated control on 8 GPUs separates what
  disaggregation buys from what 2x the GPUs buys.
- TetriInfer: sim/disagg.py with `prefill="tetriinfer"`: P TP-1 prefill instances (SJF over scheduling batches
  of 16, fixed 512-token padded chunks; 512 is where A100 Llama-3-8B prefill saturates), request-level KV
  transfer, power of two with the length predictor (sched/decode_dispatch.BucketPredictor, fitted on the
  workload's own population), D TP-1 decode instances with reserve-dynamic admission. No instance flips.
- Workloads (5.1): prompts over 512 tokens are heavy prefill, outputs over 128 tokens heavy decode; `mixed`
  samples the whole trace, `lpld` / `lphd` / `hpld` / `hphd` one class. Rates: Poisson requests/s, or `burst`:
  `--burst_requests` (the paper's 128) all at t=0, the closest to its runs, whose arrival process it omits.
- Resources (5.1's resource usage time): GPU-seconds from the first arrival to each instance's last work; the
  colocated cluster's is its GPUs times the whole run, as the paper counts vLLM.

Prints per (workload, rate): average TTFT and JCT, GPU-seconds, and their ratios to the first colocated
cluster; then per workload the paper's claim beside the burst run of the paper's layout (against the baseline
and the capped one). Writes tetriinfer.json and tetriinfer.png to `out`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import numpy as np
from matplotlib.figure import Figure

from jaxserve.sched.decode_dispatch import BucketPredictor, PromptInfo, accuracy
from jaxserve.sched.profiles import ProfileBatchCost
from jaxserve.sim import run as sim
from jaxserve.sim.disagg import DisaggConfig, DisaggSimulator
from jaxserve.sim.metrics import Results
from jaxserve.sim.workload import Workload, load_trace, poisson_arrivals


@dataclasses.dataclass(frozen=True)
class Options:
    workloads: Sequence[str] = ("mixed", "lpld", "lphd", "hpld", "hphd")
    rates: Sequence[str] = ("burst", "8", "16", "32")
    requests: int = 400
    burst_requests: int = 128
    colocated: Sequence[str] = ("4", "8")
    capped: int = 16
    layouts: Sequence[str] = ("2+2", "4+4", "1+2")
    seed: int = 0
    out: str = "docs/figures"


HELP = {  # each option's help on the command line (python -m jaxserve.lab tetriinfer)
    "workloads": "TetriInfer 5.1's workload classes.",
    "rates": "Poisson rates (requests/s), or burst: all at t=0.",
    "requests": "Requests per Poisson run.",
    "burst_requests": "Requests of the burst run (the paper's 128).",
    "colocated": "Colocated clusters, TP-1 replicas; the first is the baseline.",
    "capped": "Also the baseline with at most this many running per replica (0: no).",
    "layouts": "TetriInfer layouts, prefill+decode TP-1 instances.",
    "seed": "Workload and power-of-two seed.",
    "out": "Where tetriinfer.json and tetriinfer.png go.",
}


TINY = Options(workloads=("mixed",), rates=("burst",), burst_requests=16, layouts=("1+1",), colocated=("2",))

PROFILE = "a100_llama3_8b"
HEAVY_PREFILL, HEAVY_DECODE = 512, 128  # TetriInfer 5.1's class boundaries, tokens
# TetriInfer 5.1 (Figs. 11-15), its TetriInfer against vLLM on twice the GPUs: average TTFT, average JCT and
# resource usage time, relative change (None: not stated)
PAPER = {
    "lpld": (-0.44, -0.40, None),
    "lphd": (-0.97, -0.47, -0.38),
    "hpld": (-0.09, -0.23, 0.43),
    "hphd": (None, -0.19, 0.07),
    "mixed": (-0.85, -0.50, -0.21),
}


def population(name: str) -> tuple[np.ndarray, np.ndarray]:
    """The Azure conv (prompt, output) pairs a workload samples from."""
    trace = load_trace("azure_conv")
    p, o = trace.prompt_lens, trace.output_lens
    if name == "mixed":
        return p, o
    heavy_p, heavy_d = {"lpld": (False, False), "lphd": (False, True), "hpld": (True, False), "hphd": (True, True)}[
        name
    ]
    keep = ((p > HEAVY_PREFILL) == heavy_p) & ((o > HEAVY_DECODE) == heavy_d)
    return p[keep], o[keep]


def workload(opts: Options, name: str, rate: str) -> Workload:
    p, o = population(name)
    rng = np.random.default_rng(opts.seed)
    n = opts.burst_requests if rate == "burst" else opts.requests
    pick = rng.integers(0, len(p), size=n)
    arrivals = np.zeros(n) if rate == "burst" else poisson_arrivals(n, float(rate), rng)
    return Workload(arrivals, p[pick], o[pick], f"{name}@{rate}")


def row(label: str, res: Results, gpus: int, gpu_seconds: float) -> dict:
    done = [r for r in res.requests if r.finished]
    return {
        "label": label,
        "gpus": gpus,
        "finished": len(done),
        "requests": len(res.requests) + len(res.rejected),
        "ttft_mean": float(np.mean([r.first_token_at - r.arrival for r in done])),
        "jct_mean": float(np.mean([r.finished_at - r.arrival for r in done])),
        "gpu_seconds": gpu_seconds,
        "span": res.span,
    }


def colocated(w: Workload, gpus: int, max_num_seqs: int = 256) -> dict:
    cfg = sim.config_for(
        "fcfs", profile=PROFILE, tp=1, replicas=gpus, multi_prefill=True, space_sharing=False, max_num_seqs=max_num_seqs
    )
    res = sim.simulate(w, cfg, progress=False)
    label = f"colocated {gpus} GPUs" + (f" <={max_num_seqs}" if max_num_seqs != 256 else "")
    return row(label, res, gpus, gpus * res.span)


def tetriinfer(w: Workload, layout: str, predictor: BucketPredictor, seed: int) -> dict:
    p, d = (int(x) for x in layout.split("+"))
    cfg = DisaggConfig(
        prefill="tetriinfer",
        prefill_instances=p,
        decode_instances=d,
        decode_tp=1,
        profile=PROFILE,
        dispatch="power_of_two",
        admission="reserve_dynamic",
        seed=seed,
    )
    cost = ProfileBatchCost(PROFILE, 1)
    res = DisaggSimulator(None, lambda n: cost.batch_time([(n, 0)]), cfg, predictor).run(w, progress=False)
    return row(f"TetriInfer {p}P+{d}D", res, p + d, res.config["gpu_seconds"])


def plot(rows: list[dict], path: str) -> None:
    """Average TTFT and JCT against the Poisson rate, one column per workload."""
    names = list(dict.fromkeys(r["workload"] for r in rows))
    fig = Figure(figsize=(5 * len(names), 7))
    axes = fig.subplots(2, len(names), squeeze=False)
    for col, name in enumerate(names):
        for ax, metric, ylabel in (
            (axes[0][col], "ttft_mean", "average TTFT (s)"),
            (axes[1][col], "jct_mean", "average JCT (s)"),
        ):
            for label in dict.fromkeys(r["label"] for r in rows):
                pts = sorted(
                    (float(r["rate"]), r[metric])
                    for r in rows
                    if r["workload"] == name and r["label"] == label and r["rate"] != "burst"
                )
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
            ax.set_yscale("log")
            ax.set_xlabel("arrival rate (requests/s)")
            ax.set_ylabel(ylabel)
            ax.set_title(name)
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(opts: Options) -> dict:
    rows = []
    print(
        f"Llama-3-8B on A100 (TP 1), Azure conv pairs, {opts.requests} requests per Poisson run, "
        f"{opts.burst_requests} per burst, seed {opts.seed}; ratios to colocated {opts.colocated[0]} GPUs"
    )
    print(
        f"{'workload':8s} {'rate':>5s} {'system':24s} {'GPUs':>4s} {'avg TTFT':>9s} {'avg JCT':>8s} "
        f"{'GPU-s':>7s} {'TTFT x':>7s} {'JCT x':>6s} {'GPU-s x':>7s}",
        flush=True,
    )
    for name in opts.workloads:
        p, o = population(name)
        predictor = BucketPredictor.fit(p, o)
        hits = accuracy(predictor, [PromptInfo(int(n)) for n in p], o)
        for rate in opts.rates:
            w = workload(opts, name, rate)
            runs = [colocated(w, int(g)) for g in opts.colocated]
            runs += [colocated(w, int(opts.colocated[0]), opts.capped)] if opts.capped else []
            runs += [tetriinfer(w, layout, predictor, opts.seed) for layout in opts.layouts]
            base = runs[0]
            for r in runs:
                r |= {
                    "workload": name,
                    "rate": rate,
                    "predictor_accuracy": hits,
                    "ttft_ratio": r["ttft_mean"] / base["ttft_mean"],
                    "jct_ratio": r["jct_mean"] / base["jct_mean"],
                    "gpu_seconds_ratio": r["gpu_seconds"] / base["gpu_seconds"],
                }
                rows.append(r)
                print(
                    f"{name:8s} {rate:>5s} {r['label']:24s} {r['gpus']:4d} {r['ttft_mean']:9.3f} "
                    f"{r['jct_mean']:8.2f} {r['gpu_seconds']:7.1f} {r['ttft_ratio']:7.2f} {r['jct_ratio']:6.2f} "
                    f"{r['gpu_seconds_ratio']:7.2f}",
                    flush=True,
                )
    g = int(opts.colocated[0])
    paper_label = f"TetriInfer {g}P+{g}D"
    for name in opts.workloads:
        hit_share = next(x["predictor_accuracy"] for x in rows if x["workload"] == name)
        print(f"{name}: length predictor accuracy {hit_share:.2f} (200-token buckets; the paper's 0.75)")
        burst = {x["label"]: x for x in rows if x["workload"] == name and x["rate"] == "burst"}
        if paper_label not in burst:
            continue
        change = lambda x: "n/a" if x is None else f"{x:+.0%}"  # noqa: E731
        print(
            f"  paper: TTFT {change(PAPER[name][0])}, JCT {change(PAPER[name][1])}, resources {change(PAPER[name][2])}"
        )
        t = burst[paper_label]
        for label, b in burst.items():
            if label.startswith("colocated") and b["gpus"] == g:
                print(
                    f"  burst, {paper_label} vs {label}: TTFT {change(t['ttft_mean'] / b['ttft_mean'] - 1)}, "
                    f"JCT {change(t['jct_mean'] / b['jct_mean'] - 1)}, "
                    f"GPU-s {change(t['gpu_seconds'] / b['gpu_seconds'] - 1)}"
                )
    os.makedirs(opts.out, exist_ok=True)
    plot(rows, os.path.join(opts.out, "tetriinfer.png"))
    results = {
        "requests": opts.requests,
        "burst_requests": opts.burst_requests,
        "seed": opts.seed,
        "colocated": opts.colocated,
        "capped": opts.capped,
        "layouts": opts.layouts,
        "profile": PROFILE,
        "runs": rows,
    }
    with open(os.path.join(opts.out, "tetriinfer.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {opts.out}/tetriinfer.json, tetriinfer.png")
    return results
