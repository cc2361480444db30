"""CSPS's headline comparison (§5.3, Figs. 14-17) in simulation: Sarathi-Serve against CSPS on 64 A100 (8 nodes),
an 8B model, prompts of 1K to 1M tokens: average TTFT, TBT and response time, per input-length group, and each
system's capacity (jaxserve/lab/claims/csps.py). Writes csps.json and csps.png to --out.

    .venv/bin/python tools/exp_csps.py [--requests=200] [--rates=0.05,0.15,0.25,0.35] [--spts=131072,16384]
        [--seeds=0,1] [--out=docs/figures]
"""

from __future__ import annotations

from absl import app, flags

from jaxserve.lab import experiments
from jaxserve.lab.claims.csps import Options

flags.DEFINE_integer("requests", Options.requests, "Requests per run.")
flags.DEFINE_list("rates", list(Options.rates), "Poisson arrival rates, requests/s.")
flags.DEFINE_integer(
    "prefill_gpus", Options.prefill_gpus, "CSPS's prefill pool (whole nodes of 8); the rest of 64 decode."
)
flags.DEFINE_integer("decode_tp", Options.decode_tp, "GPUs per CSPS decode instance.")
flags.DEFINE_list("spts", list(Options.spts), "Most tokens of one SPT (the paper: 64K-128K), one CSPS each.")
flags.DEFINE_float("cut", Options.cut, "CSA's share of attention pairs dropped (the paper: 28% less computation).")
flags.DEFINE_float("light", Options.light, "The light load capacities are measured against, requests/s.")
flags.DEFINE_list("seeds", list(Options.seeds), "Workload seeds.")
flags.DEFINE_string("out", Options.out, "Where csps.json and csps.png go.")


def main(argv):
    del argv
    experiments.run("csps", **{k: flags.FLAGS[k].value for k in experiments.option_names("csps")})


if __name__ == "__main__":
    app.run(main)
