"""Medha Fig. 13 in simulation: scheduling policies on a mix of short requests (Azure conv lengths) and 5% long
ones (128K-1M tokens), Llama-3-8B on A100s, across arrival rates and seeds.

Settings: `medha` is the paper's (TP8 x 2 stream-pipeline stages on 16 A100, 0.25-1.75 QPS); `tp8` is one TP8
replica (8 A100, no pipeline) at 0.1-0.4 req/s. Variants: FCFS, EDF, LRS and LARS batching one prefill per
iteration (Medha 6.4's baselines), then the controls that separate LARS from multi-prefill batching (EDF and
LARS with several prefills per batch), then Medha's full scheduler (LARS + multi-prefill + space sharing).

Prints per-rate means over the seeds, the Fig. 13 ratio (LRS / Medha, P50 TTFT normalised by each request's
deadline) beside the same ratio for the EDF + multi-prefill control, FCFS / Medha short-request P50 (marked where
FCFS is past its capacity: its queue then grows with the run and so does the ratio), and the max sustainable rate
(SLO attainment >= 90%) of FCFS, LRS, EDF + multi-prefill and Medha. Writes plots and policies_<setting>.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import numpy as np
from tqdm import tqdm

from jaxserve.sim import plots, run as sim
from jaxserve.sim.metrics import Results
from jaxserve.config import SimConfig


@dataclasses.dataclass(frozen=True)
class Options:
    setting: str = "medha"
    requests: int = 600
    seeds: int = 2
    rates: Sequence[str] | None = None  # None: the setting's
    capacity: bool = True
    out: str = "docs/figures"


HELP = {  # each option's help on the command line (python -m jaxserve.lab policies)
    "setting": "medha: TP8 x SPP2, 0.25-1.75 QPS; tp8: one TP8 replica.",
    "requests": "Requests per run.",
    "seeds": "Workload seeds per point (0..seeds-1).",
    "rates": "Arrival rates, requests/s (default: the setting's).",
    "capacity": "Also search the max sustainable rate of FCFS, LRS, EDF + multi-prefill, Medha.",
    "out": "Where plots and policies_<setting>.json go.",
}
CHOICES = {"setting": ["medha", "tp8"]}  # the options that take one of a few values


TINY = Options(requests=30, seeds=1, rates=("0.5",), capacity=False)

SETTINGS = {
    "medha": dict(stages=2, rates=(0.25, 0.75, 1.25, 1.75), cluster="TP8 x SPP2, 16 A100"),
    "tp8": dict(stages=1, rates=(0.1, 0.2, 0.3, 0.4), cluster="TP8, 8 A100"),
}
MEDHA = "Medha (LARS + multi-prefill + space sharing)"
# label -> (policy, multi-prefill batching, space sharing)
VARIANTS = {
    "FCFS": ("fcfs", False, False),
    "EDF": ("edf", False, False),
    "LRS": ("lrs", False, False),
    "LARS": ("lars", False, False),
    "EDF + multi-prefill": ("edf", True, False),
    "LARS + multi-prefill": ("lars", True, False),
    MEDHA: ("lars", True, True),
}
CAPACITY = ("FCFS", "LRS", "EDF + multi-prefill", MEDHA)
METRICS = ("short_ttft_p50", "short_ttft_p99", "long_ttft_p50", "ttft_norm_p50", "ttft_norm_p90", "slo_attainment")


def config(label: str, setting: str) -> SimConfig:
    policy, multi, sharing = VARIANTS[label]
    return sim.config_for(policy, tp=8, stages=SETTINGS[setting]["stages"], multi_prefill=multi, space_sharing=sharing)


def measure(opts: Options, label: str, rate: float, seed: int) -> tuple[dict, Results]:
    res = sim.simulate(
        sim.make_workload("mix", rate, opts.requests, seed=seed), config(label, opts.setting), progress=False
    )
    s = res.summary()
    row = {
        "label": label,
        "rate": rate,
        "seed": seed,
        "short_ttft_p50": s["short"]["ttft_p50"],
        "short_ttft_p99": s["short"]["ttft_p99"],
        "long_ttft_p50": s["long"]["ttft_p50"],
        "ttft_norm_p50": s["all"]["ttft_norm_p50"],
        "ttft_norm_p90": s["all"]["ttft_norm_p90"],
        "slo_attainment": s["all"]["slo_attainment"],
    }
    return row, res


def means(rows: list[dict]) -> list[dict]:
    """One row per (label, rate): each metric's mean over the seeds, and its min and max."""
    out = []
    for label in VARIANTS:
        for rate in sorted({r["rate"] for r in rows}):
            runs = [r for r in rows if r["label"] == label and r["rate"] == rate]
            row = {"label": label, "rate": rate}
            for m in METRICS:
                values = [r[m] for r in runs]
                row |= {m: float(np.mean(values)), f"{m}_min": min(values), f"{m}_max": max(values)}
            out.append(row)
    return out


def run(opts: Options) -> dict:
    setting = SETTINGS[opts.setting]
    rates = [float(r) for r in opts.rates] if opts.rates else list(setting["rates"])
    rows, at_top = [], {}
    points = [(rate, label, seed) for rate in rates for label in VARIANTS for seed in range(opts.seeds)]
    for rate, label, seed in tqdm(points, desc="runs"):
        row, res = measure(opts, label, rate, seed)
        rows.append(row)
        if rate == max(rates) and seed == 0:
            at_top[label] = res
    table = means(rows)
    at = {(r["label"], r["rate"]): r for r in table}
    print(f"{setting['cluster']}, {opts.requests} requests, seeds 0-{opts.seeds - 1} (means)")
    print(
        f"{'variant':46s} {'rate':>5s} {'short P50':>9s} {'short P99':>9s} {'long P50':>8s} {'norm P50':>8s} "
        f"{'norm P90':>8s} {'SLO met':>7s}"
    )
    for r in table:
        print(
            f"{r['label']:46s} {r['rate']:5.2f} {r['short_ttft_p50']:9.3f} {r['short_ttft_p99']:9.2f} "
            f"{r['long_ttft_p50']:8.1f} {r['ttft_norm_p50']:8.3f} {r['ttft_norm_p90']:8.2f} "
            f"{r['slo_attainment']:7.1%}"
        )
    ratios = []
    for rate in rates:
        medha = at[(MEDHA, rate)]
        fcfs = at[("FCFS", rate)]
        ratio = {
            "rate": rate,
            "lrs_over_medha_norm_p50": at[("LRS", rate)]["ttft_norm_p50"] / medha["ttft_norm_p50"],
            "edf_multi_over_medha_norm_p50": at[("EDF + multi-prefill", rate)]["ttft_norm_p50"]
            / medha["ttft_norm_p50"],
            "fcfs_over_medha_short_p50": fcfs["short_ttft_p50"] / medha["short_ttft_p50"],
            "fcfs_overloaded": fcfs["slo_attainment"] < 0.9,
        }
        ratios.append(ratio)
        print(
            f"at {rate} req/s, P50 normalised TTFT: LRS / Medha {ratio['lrs_over_medha_norm_p50']:.2f}x, "
            f"EDF + multi-prefill / Medha {ratio['edf_multi_over_medha_norm_p50']:.2f}x; short P50 FCFS / Medha "
            f"{ratio['fcfs_over_medha_short_p50']:.1f}x"
            + (" (FCFS past its capacity: grows with the run's length)" if ratio["fcfs_overloaded"] else "")
        )
    capacity = {}
    if opts.capacity:
        for label in tqdm(CAPACITY, desc="max sustainable rate"):
            capacity[label], _ = sim.max_sustainable_rate(
                config(label, opts.setting),
                lambda rate: sim.make_workload("mix", rate, opts.requests, seed=0),
                lo=0.02,
                hi=4.0,
                iterations=6,
            )
            print(f"max sustainable rate (SLO attainment >= 90%, seed 0), {label}: {capacity[label]:.3f} req/s")
        print(
            f"capacity Medha / FCFS: {capacity[MEDHA] / max(capacity['FCFS'], 1e-9):.1f}x, "
            f"Medha / EDF + multi-prefill: {capacity[MEDHA] / max(capacity['EDF + multi-prefill'], 1e-9):.2f}x"
        )
    os.makedirs(opts.out, exist_ok=True)
    name = f"policies_{opts.setting}"
    plots.ttft_cdf(
        at_top,
        os.path.join(opts.out, f"{name}_ttft_cdf.png"),
        which="short",
        title=f"short requests, {max(rates)} req/s, {setting['cluster']}",
    )
    plots.metric_vs_load(
        table,
        os.path.join(opts.out, f"{name}_norm_p50_vs_load.png"),
        "ttft_norm_p50",
        "P50 TTFT / deadline",
        title=f"5% long mix, {setting['cluster']}",
    )
    plots.metric_vs_load(
        table,
        os.path.join(opts.out, f"{name}_slo_vs_load.png"),
        "slo_attainment",
        "SLO attainment",
        title=f"5% long mix, {setting['cluster']}",
        log=False,
    )
    results = {
        "setting": opts.setting,
        "requests": opts.requests,
        "seeds": opts.seeds,
        "runs": rows,
        "means": table,
        "ratios": ratios,
        "max_sustainable_rate": capacity,
    }
    with open(os.path.join(opts.out, f"{name}.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {opts.out}/{name}_ttft_cdf.png, {name}_norm_p50_vs_load.png, {name}_slo_vs_load.png, {name}.json")
    return results
