"""Medha Fig. 13 in simulation: FCFS vs EDF vs LRS vs LARS vs LARS + space sharing on a mix of short requests
(Azure conv lengths) and 5% long ones (128K-1M tokens), Llama-3-8B on 8 x A100 (TP8, built-in profile),
across arrival rates. Prints a table, the P50 short-request TTFT ratio FCFS / LARS at the --convoy_rate, and
each policy's max sustainable rate (SLO attainment >= 90%); writes plots and JSON to --out.

    .venv/bin/python tools/exp_policies.py [--requests=600] [--rates=0.1,0.2,0.3,0.4] [--convoy_rate=0.3]
"""

from __future__ import annotations

import json
import os

from absl import app, flags
from tqdm import tqdm

from jaxserve.sim import plots, run

FLAGS = flags.FLAGS
flags.DEFINE_integer("requests", 600, "Requests per run.")
flags.DEFINE_list("rates", ["0.1", "0.2", "0.3", "0.4"], "Arrival rates, requests/s.")
flags.DEFINE_float("convoy_rate", 0.3, "Rate for the TTFT CDF and the FCFS / LARS ratio.")
flags.DEFINE_bool("capacity", True, "Also search each policy's max sustainable rate.")
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_string("out", "docs/figures", "Where plots and policies.json go.")

# (label, policy, multi-prefill batching, space sharing): the baselines batch one prefill, as in Medha 6.4
VARIANTS = [("FCFS", "fcfs", False, False), ("EDF", "edf", False, False), ("LRS", "lrs", False, False),
            ("LARS", "lars", False, False), ("LARS + space sharing", "lars", True, True)]


def workload(rate: float):
    return run.make_workload("mix", rate, FLAGS.requests, seed=FLAGS.seed)


def config(policy: str, multi: bool, sharing: bool):
    return run.config_for(policy, multi_prefill=multi, space_sharing=sharing)


def main(argv):
    del argv
    rates = [float(r) for r in FLAGS.rates]
    if FLAGS.convoy_rate not in rates:
        rates.append(FLAGS.convoy_rate)
    rows, at_convoy = [], {}
    for rate in tqdm(sorted(rates), desc="rates"):
        for label, policy, multi, sharing in VARIANTS:
            res = run.simulate(workload(rate), config(policy, multi, sharing), progress=False)
            s = res.summary()
            rows.append({"label": label, "rate": rate, "short_ttft_p50": s["short"]["ttft_p50"],
                         "short_ttft_p99": s["short"]["ttft_p99"], "long_ttft_p50": s["long"]["ttft_p50"],
                         "slo_attainment": s["all"]["slo_attainment"], "tpot_p50": s["all"]["tpot_p50"]})
            if rate == FLAGS.convoy_rate:
                at_convoy[label] = res
    print(f"{'variant':22s} {'rate':>5s} {'short P50':>10s} {'short P99':>10s} {'long P50':>9s} {'SLO met':>8s}")
    for r in rows:
        print(f"{r['label']:22s} {r['rate']:5.2f} {r['short_ttft_p50']:10.3f} {r['short_ttft_p99']:10.3f} "
              f"{r['long_ttft_p50']:9.1f} {r['slo_attainment']:8.1%}")
    p50 = {r["label"]: r["short_ttft_p50"] for r in rows if r["rate"] == FLAGS.convoy_rate}
    for label in ("LARS", "LARS + space sharing"):
        print(f"P50 short-request TTFT at {FLAGS.convoy_rate} req/s, FCFS / {label}: "
              f"{p50['FCFS'] / p50[label]:.1f}x")
    capacity = {}
    if FLAGS.capacity:
        for label, policy, multi, sharing in tqdm(VARIANTS, desc="max sustainable rate"):
            capacity[label], _ = run.max_sustainable_rate(config(policy, multi, sharing), workload,
                                                          lo=0.02, hi=2.0, iterations=6)
            print(f"max sustainable rate (SLO attainment >= 90%), {label}: {capacity[label]:.3f} req/s")
    os.makedirs(FLAGS.out, exist_ok=True)
    plots.ttft_cdf(at_convoy, os.path.join(FLAGS.out, "policies_ttft_cdf.png"), which="short",
                   title=f"short requests, 5% long mix, {FLAGS.convoy_rate} req/s, 8xA100 Llama-3-8B")
    plots.metric_vs_load(rows, os.path.join(FLAGS.out, "policies_p50_vs_load.png"), "short_ttft_p50",
                         "P50 TTFT of short requests (s)", title="5% long mix, 8xA100 Llama-3-8B")
    with open(os.path.join(FLAGS.out, "policies.json"), "w") as f:
        json.dump({"rows": rows, "max_sustainable_rate": capacity, "requests": FLAGS.requests}, f, indent=1)
    print(f"wrote {FLAGS.out}/policies_ttft_cdf.png, policies_p50_vs_load.png, policies.json")


if __name__ == "__main__":
    app.run(main)
