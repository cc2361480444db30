"""Medha's KV-cache parallelism in simulation: decode-only time per token of one 1M-10M-token context with 1, 2
and 4 KVP workers (Fig. 19 / B.2), and 2D (TP8 x SPP8) against 3D (TP8 x SPP4 x KVP2) on 64 H100 (Fig. 12)
(jaxserve/lab/claims/kvp.py). Prints both tables; writes kvp.json and two plots to --out.

    .venv/bin/python tools/exp_kvp.py [--requests=100] [--rates=0.25,0.75,1.25,1.75] [--kvp_tokens=1048576]
"""

from __future__ import annotations

from absl import app, flags

from jaxserve.lab import experiments
from jaxserve.lab.claims.kvp import Options

flags.DEFINE_integer("requests", Options.requests, "Requests per run of the Fig. 12 comparison.")
flags.DEFINE_list("rates", list(Options.rates), "Arrival rates, requests/s.")
flags.DEFINE_integer("long_tokens", Options.long_tokens, "Prompt length of the long requests.")
flags.DEFINE_integer(
    "kvp_tokens", Options.kvp_tokens, "Tokens of one sequence a KVP worker holds before the next joins."
)
flags.DEFINE_integer("seed", Options.seed, "Workload seed.")
flags.DEFINE_string("out", Options.out, "Where kvp.json and the plots go.")


def main(argv):
    del argv
    experiments.run("kvp", **{k: flags.FLAGS[k].value for k in experiments.option_names("kvp")})


if __name__ == "__main__":
    app.run(main)
