"""Medha's KV-cache parallelism in simulation, two claims:

- Fig. 19 / B.2: decode-only time per output token of one very long context (1M-10M tokens, Llama-3-8B, TP8 A100
  profile) with 1, 2 and 4 KVP workers (the paper: ~40% less at 10M with KVP 2).
- Fig. 12: 2D (TP8 x SPP8) against 3D (TP8 x SPP4 x KVP2) at equal GPUs (64), Llama-70B on H100 (the built-in
  Llama-2-70B profile; Medha ran Llama-3-70B), 5% long requests of 2M tokens among Azure conv ones, LARS + space
  sharing, 0.25-1.75 QPS (the paper: 3D cuts P50 and P90 TPOT by over 2x at 1.75 QPS, TTFT comparable).

Prints both tables; writes kvp.json and two plots to `out`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

from matplotlib.figure import Figure
from tqdm import tqdm

from jaxserve.sched.profiles import ProfileBatchCost
from jaxserve.sim import plots, run as sim
from jaxserve.sim.workload import synthetic_mix


@dataclasses.dataclass(frozen=True)
class Options:
    # at seed 0, 100 requests hold 5 long ones, whose 10M KV tokens fit both layouts (~13M); 200 hold 7, which do
    # not: the long prompts are preempted and recomputed over and over
    requests: int = 100
    rates: Sequence[str] = ("0.25", "0.75", "1.25", "1.75")
    long_tokens: int = 2_000_000
    kvp_tokens: int = 1 << 20
    seed: int = 0
    out: str = "docs/figures"


HELP = {  # each option's help on the command line (python -m jaxserve.lab kvp)
    "requests": "Requests per run of the Fig. 12 comparison.",
    "rates": "Arrival rates, requests/s.",
    "long_tokens": "Prompt length of the long requests.",
    "kvp_tokens": "Tokens of one sequence a KVP worker holds before the next joins.",
    "seed": "Workload seed.",
    "out": "Where kvp.json and the plots go.",
}


TINY = Options(requests=20, rates=("0.5",), long_tokens=300_000, kvp_tokens=200_000)

CONTEXTS = (1 << 20, 2 << 20, 4 << 20, 10 << 20)
LAYOUTS = {"2D: TP8 x SPP8": dict(stages=8, kvp=1), "3D: TP8 x SPP4 x KVP2": dict(stages=4, kvp=2)}


def decode_only() -> list[dict]:
    """One sequence decoding alone: its context spread evenly over the workers (the paper's fixed KVP degree)."""
    rows = []
    for kvp in (1, 2, 4):
        for context in CONTEXTS:
            cost = ProfileBatchCost("a100_llama3_8b", tp=8, kvp=kvp, kvp_tokens=-(-context // kvp))
            rows.append({"kvp": kvp, "context": context, "tpot": cost.batch_time([], [context])})
    return rows


def layout_runs(opts: Options, rates: list[float]) -> list[dict]:
    rows = []
    for rate in tqdm(rates, desc="rates"):
        work = synthetic_mix(
            opts.requests,
            rate,
            long_range=(opts.long_tokens, opts.long_tokens + 1),
            seed=opts.seed,
            long_output=(128, 1024),
        )
        for label, layout in LAYOUTS.items():
            config = sim.config_for(
                "lars",
                profile="h100_llama2_70b",
                tp=8,
                space_sharing=True,
                kvp_tokens=opts.kvp_tokens if layout["kvp"] > 1 else None,
                **layout,
            )
            s = sim.simulate(work, config, progress=False).summary()
            rows.append(
                {
                    "label": label,
                    "rate": rate,
                    "tpot_p50": s["all"]["tpot_p50"],
                    "tpot_p90": s["all"]["tpot_p90"],
                    "long_tpot_p50": s["long"]["tpot_p50"],
                    "ttft_p50": s["all"]["ttft_p50"],
                    "long_ttft_p50": s["long"]["ttft_p50"],
                    "slo_attainment": s["all"]["slo_attainment"],
                }
            )
    return rows


def plot_decode(rows: list[dict], path: str) -> None:
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for kvp in (1, 2, 4):
        pts = [(r["context"] / 2**20, r["tpot"] * 1e3) for r in rows if r["kvp"] == kvp]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"KVP {kvp}")
    ax.set_xlabel("context (M tokens)")
    ax.set_ylabel("decode-only time per token (ms)")
    ax.set_title("Llama-3-8B, TP8 A100 profile, one sequence")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_layouts(rows: list[dict], out: str) -> None:
    for metric, label, name in (
        ("tpot_p90", "P90 TPOT, all requests (s)", "kvp_tpot_p90_vs_load.png"),
        ("long_tpot_p50", "P50 TPOT, 2M-token requests (s)", "kvp_long_tpot_vs_load.png"),
    ):
        plots.metric_vs_load(
            rows, os.path.join(out, name), metric, label, title="2D vs 3D, Llama-70B, 64 H100", log=False
        )


def run(opts: Options) -> dict:
    decode = decode_only()
    print("decode-only time per token, ms (Llama-3-8B, TP8 A100)")
    print(f"{'KVP':>3s} " + " ".join(f"{c >> 20:>6d}M" for c in CONTEXTS))
    for kvp in (1, 2, 4):
        print(f"{kvp:3d} " + " ".join(f"{r['tpot'] * 1e3:7.1f}" for r in decode if r["kvp"] == kvp))
    at = {(r["kvp"], r["context"]): r["tpot"] for r in decode}
    for kvp in (2, 4):
        print(f"at 10M, KVP {kvp} saves {1 - at[(kvp, CONTEXTS[-1])] / at[(1, CONTEXTS[-1])]:.0%} of KVP 1's time")
    rates = [float(r) for r in opts.rates]
    layouts = layout_runs(opts, rates)
    print(f"\n2D vs 3D, Llama-70B on 64 H100, {opts.requests} requests, 5% of {opts.long_tokens} tokens")
    print(
        f"{'layout':24s} {'rate':>5s} {'TPOT P50':>9s} {'TPOT P90':>9s} {'long TPOT':>9s} {'TTFT P50':>9s} "
        f"{'long TTFT':>9s} {'SLO met':>7s}"
    )
    for r in layouts:
        print(
            f"{r['label']:24s} {r['rate']:5.2f} {r['tpot_p50'] * 1e3:7.1f}ms {r['tpot_p90'] * 1e3:7.1f}ms "
            f"{r['long_tpot_p50'] * 1e3:7.1f}ms {r['ttft_p50']:9.3f} {r['long_ttft_p50']:9.1f} "
            f"{r['slo_attainment']:7.1%}"
        )
    two, three = LAYOUTS
    by = {(r["label"], r["rate"]): r for r in layouts}
    for rate in rates:
        a, b = by[(two, rate)], by[(three, rate)]
        print(
            f"at {rate} req/s, 2D / 3D: TPOT P50 {a['tpot_p50'] / b['tpot_p50']:.2f}x, P90 "
            f"{a['tpot_p90'] / b['tpot_p90']:.2f}x, long TPOT {a['long_tpot_p50'] / b['long_tpot_p50']:.2f}x, "
            f"TTFT P50 {a['ttft_p50'] / b['ttft_p50']:.2f}x"
        )
    os.makedirs(opts.out, exist_ok=True)
    plot_decode(decode, os.path.join(opts.out, "kvp_decode_only.png"))
    plot_layouts(layouts, opts.out)
    results = {
        "decode_only": decode,
        "layouts": layouts,
        "requests": opts.requests,
        "long_tokens": opts.long_tokens,
        "kvp_tokens": opts.kvp_tokens,
    }
    with open(os.path.join(opts.out, "kvp.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {opts.out}/kvp_decode_only.png, kvp_tpot_p90_vs_load.png, kvp_long_tpot_vs_load.png, kvp.json")
    return results
