"""Tetris's TBT claim (§7.2, Fig. 8: LoongServe's P50 TBT is 55-67% above the disaggregated large-TP decode, i.e.
Tetris cuts median TBT by up to 40.1%) in simulation: LLaMA3-8B on 4 nodes of 8 A100 (32 GPUs), Tetris-shaped
traces.

- Tetris: a 16-GPU TP-1 CDSP prefill pool (Eq. (1) fitted to Table 1, adaptive improvement rate seeded at 0.2)
  and 2 TP-8 decode instances, dispatch by freeness (sim/disagg.py), the paper's 1:1 P/D split.
- LoongServe: 32 TP-1 instances with elastic SP (lab/esp_cluster.py), decoding on the prefill instances.
- LoongServe Disaggregated: the Tetris cluster with request-level SP (no chunking, greedy SP) as prefill
  scheduler: what the disaggregated TP-8 decode alone buys.

Prints P50 / P99 TBT and P50 TTFT per trace and rate, and each system's P50 TBT over Tetris's (the paper: 1.55-1.67x
for LoongServe). Writes tetris_tbt.json and tetris_tbt.png to `out`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Sequence

from matplotlib.figure import Figure
from tqdm import tqdm

from jaxserve.lab.esp_cluster import ESPConfig, ESPSimulator
from jaxserve.sched.cdsp import Balancing, CDSPPlanner, Pool
from jaxserve.sched.cost_models import TetrisPrefill
from jaxserve.sched.profiles import tetris_table1_samples
from jaxserve.sim.disagg import DisaggConfig, DisaggSimulator
from jaxserve.sim.metrics import Results
from jaxserve.sim.workload import LONG_CONTEXT, Workload, long_context


@dataclasses.dataclass(frozen=True)
class Options:
    requests: int = 200
    traces: Sequence[str] = ("short", "medium")
    rates: Sequence[str] = ("0.5", "1", "2", "4")
    seeds: Sequence[str] = ("0", "1")
    out: str = "docs/figures"


HELP = {  # each option's help on the command line (python -m jaxserve.lab tetris_tbt)
    "requests": "Requests per run.",
    "traces": f"Tetris-shaped traces ({', '.join(sorted(LONG_CONTEXT))}).",
    "rates": "Poisson arrival rates, requests/s.",
    "seeds": "Workload seeds.",
    "out": "Where tetris_tbt.json and tetris_tbt.png go.",
}


TINY = Options(requests=15, traces=("short",), rates=("1",))

PROFILE = "a100_llama3_8b"
MODEL = TetrisPrefill.fit(tetris_table1_samples())
POOL = Pool(nodes=2, per_node=8)
TETRIS, LOONG, LOONG_DISAGG = "Tetris (CDSP + TP8 decode)", "LoongServe (ESP, 32 x TP1)", "LoongServe Disaggregated"


def systems() -> dict[str, Callable[[Workload], Results]]:
    decode = DisaggConfig(prefill_instances=POOL.size, decode_instances=2, decode_tp=8, profile=PROFILE)
    balancing = Balancing.from_profile(PROFILE, POOL.per_node)

    def disagg(make_planner: Callable[[], CDSPPlanner]) -> Callable[[Workload], Results]:
        return lambda w: DisaggSimulator(make_planner(), MODEL.fastest, decode).run(w, progress=False)

    return {
        TETRIS: disagg(lambda: CDSPPlanner(MODEL, POOL, 0.2, balancing=balancing)),
        LOONG: lambda w: ESPSimulator(ESPConfig(instances=32, tp=1, profile=PROFILE)).run(w, progress=False),
        LOONG_DISAGG: disagg(lambda: CDSPPlanner(MODEL, POOL, 0.0, chunking=False)),
    }


def run(opts: Options) -> dict:
    runs = systems()
    rows = []
    for trace, seed in [(t, int(s)) for t in opts.traces for s in opts.seeds]:
        for rate in tqdm([float(r) for r in opts.rates], desc=f"{trace}, seed {seed}"):
            w = long_context(trace, opts.requests, rate, seed=seed)
            for name, simulate in runs.items():
                s = simulate(w).summary()["all"]
                rows.append(
                    {
                        "trace": trace,
                        "seed": seed,
                        "rate": rate,
                        "system": name,
                        "tbt_p50": s["tbt_p50"],
                        "tbt_p99": s["tbt_p99"],
                        "ttft_p50": s["ttft_p50"],
                        "finished": s["finished"],
                        "rejected": s["rejected"],
                    }
                )
    tetris = {(r["trace"], r["seed"], r["rate"]): r for r in rows if r["system"] == TETRIS}
    print(
        f"\n{'trace':7s} {'seed':>4s} {'rate':>5s} {'system':30s} {'TBT P50':>8s} {'P99':>8s} {'TTFT P50':>9s} "
        f"{'rej.':>4s} {'P50 TBT / Tetris':>16s}"
    )
    for r in rows:
        r["tbt_p50_over_tetris"] = r["tbt_p50"] / tetris[(r["trace"], r["seed"], r["rate"])]["tbt_p50"]
        print(
            f"{r['trace']:7s} {r['seed']:4d} {r['rate']:5.2f} {r['system']:30s} {1e3 * r['tbt_p50']:6.1f}ms "
            f"{1e3 * r['tbt_p99']:6.1f}ms {r['ttft_p50']:8.2f}s {r['rejected']:4d} {r['tbt_p50_over_tetris']:16.2f}"
        )
    os.makedirs(opts.out, exist_ok=True)
    results = {"flags": {k: v for k, v in dataclasses.asdict(opts).items() if k != "out"}, "rows": rows}
    with open(os.path.join(opts.out, "tetris_tbt.json"), "w") as f:
        json.dump(results, f, indent=1)
    fig = Figure(figsize=(5 * len(opts.traces), 4))
    for ax, trace in zip(fig.subplots(1, len(opts.traces), squeeze=False)[0], opts.traces):
        for name in runs:
            pts = [
                (r["rate"], 1e3 * r["tbt_p50"])
                for r in rows
                if r["trace"] == trace and r["system"] == name and r["seed"] == int(opts.seeds[0])
            ]
            ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_title(f"{trace} trace, seed {opts.seeds[0]}")
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel("P50 TBT (ms)")
    fig.axes[0].legend(fontsize=7)
    fig.suptitle("Tetris vs LoongServe: median time between tokens, LLaMA3-8B on 32 A100 (simulated)")
    fig.tight_layout()
    fig.savefig(os.path.join(opts.out, "tetris_tbt.png"), dpi=120)
    print(f"wrote {opts.out}/tetris_tbt.json, tetris_tbt.png")
    return results
