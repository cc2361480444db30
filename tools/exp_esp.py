"""LoongServe's elastic sequence parallelism in simulation, with its ablations: ESP (elastic prefill groups,
scale-down with proactive migration, multi-master scale-up) against ESP without scale-up (a full request moves its
whole KV), with a single master, with reactive migration, and independent replicas (no ESP: each request
prefills and decodes on one instance). 4 instances of Llama-2-7B on 2 x H100 (TP=2, ESP=4, LoongServe's shape),
long-context prompts with outputs up to 2K tokens.

Prints each variant's max sustainable rate (SLO attainment >= 90%: TTFT within 25x the prompt's fastest isolated
prefill on the pool, LoongServe's normalisation, and TPOT <= 100 ms) and its ratio to the replicas; writes P50
TTFT / P90 TPOT against load and esp.json.

    .venv/bin/python tools/exp_esp.py [--requests=300] [--trace=medium] [--out=docs/figures]
"""

from __future__ import annotations

import json
import os

from absl import app, flags
from tqdm import tqdm

from jaxserve.sched.slo import SLO
from jaxserve.sim import plots
from jaxserve.sim.capacity import highest_rate
from jaxserve.sim.esp_cluster import ESPConfig, ESPSimulator
from jaxserve.sim.workload import LONG_CONTEXT, long_context

FLAGS = flags.FLAGS
flags.DEFINE_integer("requests", 300, "Requests per simulated run.")
flags.DEFINE_enum("trace", "medium", sorted(LONG_CONTEXT), "Long-context prompt lengths.")
flags.DEFINE_integer("max_output", 2048, "Outputs are uniform in [64, max_output] tokens.")
flags.DEFINE_string("out", "docs/figures", "Where plots and esp.json go.")

SLO25 = SLO(ttft_min=0.0, ttft_factor=25.0, tpot=0.1)
VARIANTS = {
    "ESP (LoongServe)": ESPConfig(slo=SLO25),
    "ESP, no scale-up": ESPConfig(scale_up=False, slo=SLO25),
    "ESP, single master": ESPConfig(multi_master=False, slo=SLO25),
    "ESP, reactive migration": ESPConfig(proactive=False, slo=SLO25),
    "replicas (no ESP)": ESPConfig(max_sp=1, scale_up=False, slo=SLO25),
}


def main(argv):
    del argv

    def workload_at(rate: float):
        return long_context(FLAGS.trace, FLAGS.requests, rate, output=(64, FLAGS.max_output))

    def attainment(cfg: ESPConfig, rate: float) -> float:
        return ESPSimulator(cfg).run(workload_at(rate), progress=False).summary()["all"]["slo_attainment"]

    capacity = {name: highest_rate(lambda rate, c=cfg: attainment(c, rate) >= 0.9, 0.02, 4.0, iterations=10)
                for name, cfg in tqdm(VARIANTS.items(), desc="max sustainable rate")}
    base = capacity["replicas (no ESP)"]
    for name, rate in capacity.items():
        ratio = f"{rate / base:.2f}x replicas" if base else "replicas sustain no load"
        print(f"{name:26s} max sustainable rate {rate:6.3f} req/s  ({ratio})")
    rows = []
    top = capacity["ESP (LoongServe)"]
    for frac in (0.25, 0.5, 0.75, 1.0, 1.25):
        for name, cfg in VARIANTS.items():
            res = ESPSimulator(cfg).run(workload_at(frac * top), progress=False)
            rows.append({"label": name, "rate": frac * top, **res.summary()["all"],
                         **{k: res.config[k] for k in ("preemptions", "scale_ups", "migrations", "evacuations")}})
    print(f"{'variant':26s} {'rate':>6s} {'TTFT P50':>9s} {'TTFT P90':>9s} {'TPOT P90':>9s} {'SLO':>6s} "
          f"{'scale-ups':>9s} {'moves':>6s} {'preempt':>7s}")
    for r in rows:
        print(f"{r['label']:26s} {r['rate']:6.3f} {r['ttft_p50']:9.3f} {r['ttft_p90']:9.3f} {r['tpot_p90']:9.4f} "
              f"{r['slo_attainment']:6.1%} {r['scale_ups']:9d} {r['migrations'] + r['evacuations']:6d} "
              f"{r['preemptions']:7d}")
    os.makedirs(FLAGS.out, exist_ok=True)
    title = f"{FLAGS.trace} prompts, 4 x (2 x H100) Llama-2-7B"
    plots.metric_vs_load(rows, os.path.join(FLAGS.out, "esp_ttft_p50_vs_load.png"), "ttft_p50", "P50 TTFT (s)",
                         title=title)
    plots.metric_vs_load(rows, os.path.join(FLAGS.out, "esp_tpot_p90_vs_load.png"), "tpot_p90", "P90 TPOT (s)",
                         title=title)
    with open(os.path.join(FLAGS.out, "esp.json"), "w") as f:
        json.dump({"trace": FLAGS.trace, "requests": FLAGS.requests, "max_output": FLAGS.max_output,
                   "max_sustainable_rate": capacity, "load": rows}, f, indent=1)
    print(f"wrote {FLAGS.out}/esp_ttft_p50_vs_load.png, esp_tpot_p90_vs_load.png, esp.json")


if __name__ == "__main__":
    app.run(main)
