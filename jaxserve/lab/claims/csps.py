"""CSPS's headline comparison (§5.3, Figs. 14-17) in simulation: Sarathi-Serve against CSPS on 64 A100 (8 nodes),
an 8B model (the built-in Llama-3-8B profile; CSPS served GLM-4-9B-1M and InternLM2.5-7B-1M), prompts of 1K to
1M tokens.

- Sarathi-Serve (the paper's baseline): 8 replicas of TP4 x PP2, FCFS, chunked prefill with a 256-token budget
  per iteration, prefill chunks and decodes mixed (sim/simulator.py).
- CSPS: a prefill pool of `--prefill_gpus` GPUs (sched/csps.py: SP-NTP over as many GPUs as SPTs of at most
  `--spts` tokens need, all-to-alls pipelined with attention, CSA dropping `--cut` of the attention pairs, the
  paper's measured 28%) and the rest as
  TP-`--decode_tp` decode instances (sim/disagg.py). CSPS decodes apart from prefill with the KV spread over
  GPUs, the query moving to it; here a TP decode instance spreads the KV the same way (each GPU reads 1/TP of
  it), but on GPUs of its own, so the KV moves once, prefill to decode, over the inter-node link: a cost CSPS
  does not pay (it pays prefill/decode sharing of its GPUs instead, which this split does not model).
- SPT sizes: the paper's 64K-128K (one GPU per 128K tokens: a 64K prompt gets one GPU, 1M gets 8) and smaller
  ones (more GPUs per prompt, at most the model's 32 query heads: a 1M prompt gets 32 GPUs at 16K). Controls at
  the smallest: CSPS without CSA (dense SP-NTP), without pipelining.
- Workload: NeedleBench's spread of input lengths, log-uniform over [1K, 1M] tokens (the paper's groups 1K ... 1M),
  outputs log-uniform over [32, 512]; Poisson arrivals.

Prints, per rate, average TTFT, TBT and response time of each system and Sarathi-Serve's over CSPS's (the paper:
6.8-7.5x, 1.8-1.92x and 9.2-9.8x at 1 req/s), per input-length group at the first rate, and each system's
capacity per seed: the highest rate whose average response time stays within 2x Sarathi-Serve's at --light
(Fig. 17: the rate each sustains at the same latency; the paper: CSPS 1.6-2.5x Sarathi-Serve's), by 10 steps of
geometric bisection over [--light, 2] req/s (each a lower bound within 1%). Writes csps.json and csps.png to `out`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Callable, Sequence

import numpy as np
from matplotlib.figure import Figure
from tqdm import tqdm

from jaxserve.sched.csps import CSPSPlanner, CSPSPrefill
from jaxserve.sched.cdsp import Pool
from jaxserve.sim.capacity import highest_rate
from jaxserve.sim.disagg import DisaggConfig, DisaggSimulator
from jaxserve.sim.metrics import Results
from jaxserve.sim.run import config_for
from jaxserve.sim.simulator import Simulator
from jaxserve.sim.workload import Workload, poisson_arrivals


@dataclasses.dataclass(frozen=True)
class Options:
    requests: int = 200
    rates: Sequence[str] = ("0.05", "0.15", "0.25", "0.35")
    prefill_gpus: int = 48
    decode_tp: int = 8
    spts: Sequence[str] = ("131072", "16384")
    cut: float = 0.28
    light: float = 0.005
    seeds: Sequence[str] = ("0", "1")
    out: str = "docs/figures"


HELP = {  # each option's help on the command line (python -m jaxserve.lab csps)
    "requests": "Requests per run.",
    "rates": "Poisson arrival rates, requests/s.",
    "prefill_gpus": "CSPS's prefill pool (whole nodes of 8); the rest of 64 decode.",
    "decode_tp": "GPUs per CSPS decode instance.",
    "spts": "Most tokens of one SPT (the paper: 64K-128K), one CSPS each.",
    "cut": "CSA's share of attention pairs dropped (the paper: 28% less computation).",
    "light": "The light load capacities are measured against, requests/s.",
    "seeds": "Workload seeds.",
    "out": "Where csps.json and csps.png go.",
}


TINY = Options(requests=12, rates=("0.1",), seeds=("0",), light=0.05)

PROFILE, GPUS, PER_NODE = "a100_llama3_8b", 64, 8
GROUPS = (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20)  # Fig. 14's x axis, coarser: lengths in (previous, this]
SARATHI = "Sarathi-Serve (8 x TP4-PP2)"


def workload(n: int, rate: float, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    prompts = np.exp(rng.uniform(np.log(1 << 10), np.log(1 << 20), n)).astype(np.int64)
    outputs = np.exp(rng.uniform(np.log(32), np.log(512), n)).astype(np.int64)
    return Workload(poisson_arrivals(n, rate, rng), prompts, outputs, f"needlebench-like@{rate}")


def systems(opts: Options) -> dict[str, Callable[[Workload], Results]]:
    """name -> run(workload) for Sarathi-Serve and the CSPS variants."""
    sarathi = config_for(
        "fcfs",
        replicas=GPUS // 8,
        profile=PROFILE,
        tp=4,
        stages=2,
        iteration_budget=1e3,
        max_num_batched_tokens=256,
        space_sharing=False,
    )
    decode = DisaggConfig(
        prefill_instances=opts.prefill_gpus,
        decode_instances=(GPUS - opts.prefill_gpus) // opts.decode_tp,
        decode_tp=opts.decode_tp,
        profile=PROFILE,
    )
    pool = Pool(opts.prefill_gpus // PER_NODE, PER_NODE)

    def csps(spt: int, **model) -> Callable[[Workload], Results]:
        planner = CSPSPlanner(CSPSPrefill(PROFILE, PER_NODE, **model), pool, spt)
        return lambda w: DisaggSimulator(planner, planner.fastest, decode).run(w, progress=False)

    spts = sorted((int(s) for s in opts.spts), reverse=True)
    out = {SARATHI: lambda w: Simulator(sarathi).run(w, progress=False)}
    out |= {f"CSPS, SPT <= {spt // 1024}K": csps(spt, cut=opts.cut) for spt in spts}
    return out | {
        f"CSPS, SPT <= {spts[-1] // 1024}K, dense SP-NTP": csps(spts[-1], cut=0.0),
        f"CSPS, SPT <= {spts[-1] // 1024}K, not pipelined": csps(spts[-1], cut=opts.cut, pipelined=False),
    }


def averages(res: Results, lo: int = 0, hi: int = 1 << 62) -> dict[str, float]:
    done = [r for r in res.requests if r.finished and lo < r.prompt_len <= hi]
    gaps = [g for r in done for g in r.token_gaps]
    return {
        "requests": len(done),
        "rejected": sum(lo < r.prompt_len <= hi for r in res.rejected),
        "ttft": float(np.mean([r.first_token_at - r.arrival for r in done])) if done else float("nan"),
        "tbt": float(np.mean(gaps)) if gaps else float("nan"),
        "response": float(np.mean([r.finished_at - r.arrival for r in done])) if done else float("nan"),
    }


def run(opts: Options) -> dict:
    runs = systems(opts)
    rates, seeds = [float(r) for r in opts.rates], [int(s) for s in opts.seeds]
    table, groups = [], []
    for seed in seeds:
        for rate in tqdm(rates, desc=f"seed {seed}"):
            w = workload(opts.requests, rate, seed)
            for name, simulate in runs.items():
                res = simulate(w)
                table.append({"system": name, "rate": rate, "seed": seed, **averages(res)})
                if rate == rates[0] and seed == seeds[0]:
                    for lo, hi in zip((0,) + GROUPS, GROUPS):  # the first from 1K
                        groups.append({"system": name, "group": hi, **averages(res, lo, hi)})
    by = {(r["system"], r["rate"], r["seed"]): r for r in table}
    for r in table:  # Sarathi-Serve's over this system's (> 1: this one is faster)
        s = by[(SARATHI, r["rate"], r["seed"])]
        r |= {f"sarathi_over_{m}": s[m] / r[m] for m in ("ttft", "tbt", "response")}
    print(
        f"\n{'system':40s} {'rate':>5s} {'seed':>4s} {'TTFT':>7s} {'TBT':>6s} {'resp.':>7s} {'rej.':>4s}   "
        f"Sarathi / this: {'TTFT':>5s} {'TBT':>5s} {'resp.':>5s}"
    )
    for r in table:
        print(
            f"{r['system']:40s} {r['rate']:5.2f} {r['seed']:4d} {r['ttft']:7.2f} {r['tbt']:6.3f} "
            f"{r['response']:7.2f} {r['rejected']:4d}   {'':15s} {r['sarathi_over_ttft']:5.2f} "
            f"{r['sarathi_over_tbt']:5.2f} {r['sarathi_over_response']:5.2f}"
        )
    print(f"\nper input-length group, {rates[0]} req/s, seed {seeds[0]} (Figs. 14/15): average TTFT (s) / TBT (ms)")
    print(f"{'group':>6s} " + " ".join(f"{name[:22]:>22s}" for name in runs))
    for hi in GROUPS:
        cells = [next(g for g in groups if g["system"] == name and g["group"] == hi) for name in runs]
        print(f"{hi // 1024:>5d}K " + " ".join(f"{c['ttft']:>13.2f} / {1e3 * c['tbt']:6.1f}" for c in cells))

    capacity = {}  # seed -> system -> req/s
    for seed in seeds:
        w = functools.partial(workload, opts.requests, seed=seed)
        bound = 2 * averages(runs[SARATHI](w(opts.light)))["response"]
        capacity[seed] = {
            name: highest_rate(
                lambda rate, s=simulate: averages(s(w(rate)))["response"] <= bound, opts.light, 2.0, iterations=10
            )
            for name, simulate in tqdm(runs.items(), desc=f"capacity, seed {seed}")
        }
        print(
            f"\ncapacity, seed {seed} (average response time within {bound:.1f} s, 2x Sarathi-Serve's at light "
            "load), req/s: "
            + ", ".join(
                f"{k} {v:.3f} ({v / max(capacity[seed][SARATHI], 1e-9):.2f}x Sarathi-Serve)"
                for k, v in capacity[seed].items()
            )
        )

    os.makedirs(opts.out, exist_ok=True)
    flags = {k: v for k, v in dataclasses.asdict(opts).items() if k != "out"}
    results = {"flags": flags, "table": table, "groups": groups, "capacity": capacity}
    with open(os.path.join(opts.out, "csps.json"), "w") as f:
        json.dump(results, f, indent=1)
    fig = Figure(figsize=(12, 4.5))
    width = 0.8 / len(runs)
    for ax, metric, label in zip(fig.subplots(1, 2), ("ttft", "tbt"), ("average TTFT (s)", "average TBT (s)")):
        x = np.arange(len(GROUPS))
        for i, name in enumerate(runs):
            ys = [next(g[metric] for g in groups if g["system"] == name and g["group"] == hi) for hi in GROUPS]
            ax.bar(x + (i - (len(runs) - 1) / 2) * width, ys, width, label=name)
        ax.set_xticks(x, [f"{hi // 1024}K" for hi in GROUPS])
        ax.set_yscale("log")
        ax.set_xlabel("input length group (up to)")
        ax.set_ylabel(label)
    fig.axes[0].legend(fontsize=7)
    fig.suptitle(f"CSPS vs Sarathi-Serve in simulation: 64 A100, Llama-3-8B profile, {rates[0]} req/s")
    fig.tight_layout()
    fig.savefig(os.path.join(opts.out, "csps.png"), dpi=120)
    print(f"wrote {opts.out}/csps.json, csps.png")
    return results
