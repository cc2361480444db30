"""TetriInfer's headline comparison (5.1, Figs. 11-15) in simulation: a colocated baseline against TetriInfer's
disaggregated cluster, on TetriInfer's workload classes built from Azure conv (prompt, output) pairs
(jaxserve/lab/claims/tetriinfer.py: the systems, the layouts and what it prints). Writes tetriinfer.json and
tetriinfer.png to --out.

    .venv/bin/python tools/exp_tetriinfer.py [--workloads=mixed,lphd] [--rates=burst,8,16,32] [--requests=400]
"""

from __future__ import annotations

from absl import app, flags

from jaxserve.lab import experiments
from jaxserve.lab.claims.tetriinfer import Options

flags.DEFINE_list("workloads", list(Options.workloads), "TetriInfer 5.1's workload classes.")
flags.DEFINE_list("rates", list(Options.rates), "Poisson rates (requests/s), or burst: all at t=0.")
flags.DEFINE_integer("requests", Options.requests, "Requests per Poisson run.")
flags.DEFINE_integer("burst_requests", Options.burst_requests, "Requests of the burst run (the paper's 128).")
flags.DEFINE_list("colocated", list(Options.colocated), "Colocated clusters, TP-1 replicas; the first is the baseline.")
flags.DEFINE_integer("capped", Options.capped, "Also the baseline with at most this many running per replica (0: no).")
flags.DEFINE_list("layouts", list(Options.layouts), "TetriInfer layouts, prefill+decode TP-1 instances.")
flags.DEFINE_integer("seed", Options.seed, "Workload and power-of-two seed.")
flags.DEFINE_string("out", Options.out, "Where tetriinfer.json and tetriinfer.png go.")


def main(argv):
    del argv
    experiments.run("tetriinfer", **{k: flags.FLAGS[k].value for k in experiments.option_names("tetriinfer")})


if __name__ == "__main__":
    app.run(main)
