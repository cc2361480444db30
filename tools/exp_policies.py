"""Medha Fig. 13 in simulation: scheduling policies on a mix of short requests and 5% long ones, Llama-3-8B on
A100s, across arrival rates and seeds (jaxserve/lab/claims/policies.py: the variants and what it prints). Writes
plots and policies_<setting>.json.

    .venv/bin/python tools/exp_policies.py [--setting=medha] [--requests=600] [--seeds=2] [--capacity]
"""

from __future__ import annotations

from absl import app, flags

from jaxserve.lab import experiments
from jaxserve.lab.claims.policies import Options

flags.DEFINE_enum(
    "setting", Options.setting, ["medha", "tp8"], "medha: TP8 x SPP2, 0.25-1.75 QPS; tp8: one TP8 replica."
)
flags.DEFINE_integer("requests", Options.requests, "Requests per run.")
flags.DEFINE_integer("seeds", Options.seeds, "Workload seeds per point (0..seeds-1).")
flags.DEFINE_list("rates", Options.rates, "Arrival rates, requests/s (default: the setting's).")
flags.DEFINE_bool(
    "capacity", Options.capacity, "Also search the max sustainable rate of FCFS, LRS, EDF + multi-prefill, Medha."
)
flags.DEFINE_string("out", Options.out, "Where plots and policies_<setting>.json go.")


def main(argv):
    del argv
    experiments.run("policies", **{k: flags.FLAGS[k].value for k in experiments.option_names("policies")})


if __name__ == "__main__":
    app.run(main)
