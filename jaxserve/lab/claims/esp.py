"""LoongServe's elastic sequence parallelism in simulation, with its ablations: ESP (elastic prefill groups,
scale-down with proactive migration, multi-master scale-up, decode-slot preemption by gain and cost) against ESP
without scale-up (a full request moves its whole KV), with a single master, with reactive migration, taking
decode slots without weighing the pause, with up to 8 admissions passing a request that does not fit (LoongServe's
code), and independent replicas (no ESP: each request prefills and decodes on
one instance). 4 instances of Llama-2-7B on 2 x H100 (TP=2, ESP=4, LoongServe's shape).

Two settings:
- Capacity (--trace, outputs up to --max_output): each variant's max sustainable rate (SLO attainment >= 90%:
  TTFT within 25x the prompt's fastest isolated prefill on the pool, LoongServe's normalisation, and TPOT <=
  100 ms), its ratio to the replicas, and a table at fractions of ESP's rate.
- Memory pressure (--memory_trace, a small KV pool per instance, outputs up to --memory_max_output): at fixed
  rates, SLO attainment (a request no replica can hold is rejected: a missed SLO), how often scale-up fired and
  how many decodes were paused by a prefill (decode-slot preemptions) or evicted to be recomputed; once over the
  whole trace and once over the requests that fit one instance, which every variant serves; and the share of
  the cluster's KV memory each workload would hold with nothing queued (decodes at the replicas' P50 TPOT). A
  variant whose admissions may pass a request that does not fit any number of times tests whether admission
  order is the cause of the collapse.

Writes P50 TTFT / P90 TPOT against load (capacity setting), SLO attainment against load (memory setting) and
esp.json to `out`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

from tqdm import tqdm

from jaxserve.lab.esp_cluster import ESPConfig, ESPSimulator
from jaxserve.config import SLO
from jaxserve.sim import plots
from jaxserve.sim.capacity import highest_rate
from jaxserve.sim.metrics import Results
from jaxserve.sim.workload import LONG_CONTEXT, Workload, long_context


@dataclasses.dataclass(frozen=True)
class Options:
    requests: int = 200
    trace: str = "medium"
    max_output: int = 2048
    memory_requests: int = 150
    memory_trace: str = "long"
    memory_max_output: int = 4096
    memory_utilization: float = 0.35  # leaves ~81K KV tokens per instance
    memory_rates: Sequence[str] = ("0.05", "0.1", "0.2", "0.3")
    out: str = "docs/figures"


HELP = {  # each option's help on the command line (python -m jaxserve.lab esp)
    "requests": "Requests per simulated run (capacity setting).",
    "trace": "Long-context prompt lengths (capacity setting).",
    "max_output": "Outputs are uniform in [64, max_output] tokens (capacity setting).",
    "memory_requests": "Requests per simulated run (memory setting).",
    "memory_trace": "Prompt lengths (memory setting).",
    "memory_max_output": "Outputs are uniform in [64, this] tokens (memory setting).",
    "memory_utilization": "GPU memory for weights + KV (memory setting): 0.35 leaves ~81K KV tokens per instance.",
    "memory_rates": "Arrival rates, requests/s (memory setting).",
    "out": "Where plots and esp.json go.",
}
CHOICES = {
    "trace": sorted(LONG_CONTEXT),
    "memory_trace": sorted(LONG_CONTEXT),
}  # the options that take one of a few values


TINY = Options(requests=20, memory_requests=15, memory_rates=("0.1",))

SLO25 = SLO(ttft_slo=0.0, ttft_factor=25.0, tpot_slo=0.1)
VARIANTS = {
    "ESP (LoongServe)": ESPConfig(slo=SLO25),
    "ESP, no scale-up": ESPConfig(scale_up=False, slo=SLO25),
    "ESP, single master": ESPConfig(multi_master=False, slo=SLO25),
    "ESP, reactive migration": ESPConfig(proactive=False, slo=SLO25),
    "ESP, slots taken unweighed": ESPConfig(decode_preemption=False, slo=SLO25),
    # LoongServe's code (not its slides) lets a bounded number of admissions pass a request that does not fit
    "ESP, out-of-order admission (8)": ESPConfig(max_overtakes=8, slo=SLO25),
    "replicas (no ESP)": ESPConfig(max_sp=1, scale_up=False, slo=SLO25),
}
MEMORY_VARIANTS = {
    name: VARIANTS[name]
    for name in (
        "ESP (LoongServe)",
        "ESP, slots taken unweighed",
        "ESP, out-of-order admission (8)",
        "replicas (no ESP)",
    )
}
# any number of later requests may pass one that does not fit: is admission order the cause of the collapse?
MEMORY_VARIANTS["ESP, out-of-order admission (any)"] = ESPConfig(max_overtakes=1 << 30, slo=SLO25)
COUNTS = ("preemptions", "scale_ups", "decode_pauses", "migrations", "evacuations")


def row(label: str, rate: float, res: Results) -> dict:
    return {
        "label": label,
        "rate": rate,
        **res.summary()["all"],
        **{k: res.config[k] for k in COUNTS},
        "scale_ups_per_s": res.config["scale_ups"] / res.span if res.span else 0.0,
    }


def kv_demand(w: Workload, tpot: float, capacity: int) -> float:
    """The share of the cluster's KV memory the workload holds on average if nothing queued: each request's
    prompt plus half its output, for its output's decode at `tpot`."""
    span = float(w.arrivals[-1] - w.arrivals[0])
    held = (w.prompt_lens + w.output_lens / 2) * w.output_lens * tpot
    return float(held.sum()) / span / capacity


def one_instance(w: Workload, tokens: int) -> Workload:
    """The requests whose prompt and output fit one instance's KV memory (those replicas serve)."""
    keep = w.prompt_lens + w.output_lens <= tokens
    return Workload(w.arrivals[keep], w.prompt_lens[keep], w.output_lens[keep], f"{w.name}, fits one instance")


def capacity_setting(opts: Options) -> dict:
    def workload_at(rate: float) -> Workload:
        return long_context(opts.trace, opts.requests, rate, output=(64, opts.max_output))

    def attainment(cfg: ESPConfig, rate: float) -> float:
        return ESPSimulator(cfg).run(workload_at(rate), progress=False).summary()["all"]["slo_attainment"]

    capacity = {
        name: highest_rate(lambda rate, c=cfg: attainment(c, rate) >= 0.9, 0.02, 4.0, iterations=10)
        for name, cfg in tqdm(VARIANTS.items(), desc="max sustainable rate")
    }
    base = capacity["replicas (no ESP)"]
    print(f"Capacity: {opts.trace} prompts, outputs up to {opts.max_output}, {opts.requests} requests")
    for name, rate in capacity.items():
        ratio = f"{rate / base:.2f}x replicas" if base else "replicas sustain no load"
        print(f"{name:27s} max sustainable rate {rate:6.3f} req/s  ({ratio})")
    rows = []
    top = capacity["ESP (LoongServe)"]
    for frac in (0.25, 0.5, 0.75, 1.0, 1.25):
        for name, cfg in VARIANTS.items():
            rows.append(row(name, frac * top, ESPSimulator(cfg).run(workload_at(frac * top), progress=False)))
    print(
        f"{'variant':27s} {'rate':>6s} {'TTFT P50':>9s} {'TTFT P90':>9s} {'TPOT P90':>9s} {'SLO':>6s} "
        f"{'scale-ups':>9s} {'moves':>6s} {'paused':>6s} {'evicted':>7s}"
    )
    for r in rows:
        print(
            f"{r['label']:27s} {r['rate']:6.3f} {r['ttft_p50']:9.3f} {r['ttft_p90']:9.3f} {r['tpot_p90']:9.4f} "
            f"{r['slo_attainment']:6.1%} {r['scale_ups']:9d} {r['migrations'] + r['evacuations']:6d} "
            f"{r['decode_pauses']:6d} {r['preemptions']:7d}"
        )
    title = f"{opts.trace} prompts, 4 x (2 x H100) Llama-2-7B"
    plots.metric_vs_load(
        rows, os.path.join(opts.out, "esp_ttft_p50_vs_load.png"), "ttft_p50", "P50 TTFT (s)", title=title
    )
    plots.metric_vs_load(
        rows, os.path.join(opts.out, "esp_tpot_p90_vs_load.png"), "tpot_p90", "P90 TPOT (s)", title=title
    )
    return {
        "trace": opts.trace,
        "requests": opts.requests,
        "max_output": opts.max_output,
        "max_sustainable_rate": capacity,
        "load": rows,
    }


def memory_setting(opts: Options) -> dict:
    rates = [float(r) for r in opts.memory_rates]
    configs = {
        name: dataclasses.replace(cfg, memory_utilization=opts.memory_utilization)
        for name, cfg in MEMORY_VARIANTS.items()
    }
    tokens = ESPSimulator(configs["replicas (no ESP)"]).capacity
    instances = configs["replicas (no ESP)"].instances
    rows, demand = [], []
    for rate in tqdm(rates, desc="memory pressure"):
        whole = long_context(opts.memory_trace, opts.memory_requests, rate, output=(64, opts.memory_max_output))
        for workload, w in (("all", whole), ("fits 1", one_instance(whole, tokens))):
            for name, cfg in configs.items():
                rows.append({"workload": workload, **row(name, rate, ESPSimulator(cfg).run(w, progress=False))})
            # at the replicas' P50 TPOT on this workload: about the fastest decode, nothing queued
            tpot = next(r["tpot_p50"] for r in reversed(rows) if r["label"] == "replicas (no ESP)")
            demand.append({"workload": workload, "rate": rate, "kv_demand": kv_demand(w, tpot, instances * tokens)})
    print(
        f"\nMemory pressure: {opts.memory_trace} prompts, outputs up to {opts.memory_max_output}, "
        f"{tokens} KV tokens per instance, {opts.memory_requests} requests ('fits 1': only those whose prompt "
        f"and output fit one instance)"
    )
    print(
        f"{'workload':8s} {'variant':27s} {'rate':>5s} {'SLO':>6s} {'reject':>6s} {'TTFT P50':>9s} {'TTFT P90':>9s} "
        f"{'TPOT P90':>9s} {'scale-ups':>9s} {'/s':>5s} {'paused':>6s} {'evicted':>7s} {'moves':>5s}"
    )
    for r in rows:
        print(
            f"{r['workload']:8s} {r['label']:27s} {r['rate']:5.2f} {r['slo_attainment']:6.1%} {r['rejected']:6d} "
            f"{r['ttft_p50']:9.2f} {r['ttft_p90']:9.2f} {r['tpot_p90']:9.4f} {r['scale_ups']:9d} "
            f"{r['scale_ups_per_s']:5.2f} {r['decode_pauses']:6d} {r['preemptions']:7d} "
            f"{r['migrations'] + r['evacuations']:5d}"
        )
    print(
        "KV memory the workload would hold on average with no queueing (share of the instances'): "
        + ", ".join(f"{d['workload']} at {d['rate']:g} req/s {d['kv_demand']:.2f}" for d in demand)
    )
    plots.metric_vs_load(
        [r for r in rows if r["workload"] == "all"],
        os.path.join(opts.out, "esp_memory_slo_vs_load.png"),
        "slo_attainment",
        "SLO attainment",
        title=f"{opts.memory_trace} prompts, {tokens} KV tokens per instance",
        log=False,
    )
    return {
        "trace": opts.memory_trace,
        "requests": opts.memory_requests,
        "max_output": opts.memory_max_output,
        "memory_utilization": opts.memory_utilization,
        "kv_capacity_per_instance": tokens,
        "load": rows,
        "kv_demand": demand,
    }


def run(opts: Options) -> dict:
    os.makedirs(opts.out, exist_ok=True)
    results = capacity_setting(opts) | {"memory_pressure": memory_setting(opts)}
    with open(os.path.join(opts.out, "esp.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {opts.out}/esp_ttft_p50_vs_load.png, esp_tpot_p90_vs_load.png, esp_memory_slo_vs_load.png, esp.json")
    return results
