"""Tetris's TBT claim (§7.2, Fig. 8) in simulation: Tetris (CDSP prefill + TP8 decode) against LoongServe (ESP on
32 TP1 instances) and LoongServe disaggregated, LLaMA3-8B on 32 A100, Tetris-shaped traces
(jaxserve/lab/claims/tetris_tbt.py). Writes tetris_tbt.json and tetris_tbt.png to --out.

    .venv/bin/python tools/exp_tetris_tbt.py [--requests=200] [--traces=short,medium] [--rates=0.5,1,2,4] [--seeds=0,1]
"""

from __future__ import annotations

from absl import app, flags

from jaxserve.lab import experiments
from jaxserve.lab.claims.tetris_tbt import Options
from jaxserve.sim.workload import LONG_CONTEXT

flags.DEFINE_integer("requests", Options.requests, "Requests per run.")
flags.DEFINE_list("traces", list(Options.traces), f"Tetris-shaped traces ({', '.join(sorted(LONG_CONTEXT))}).")
flags.DEFINE_list("rates", list(Options.rates), "Poisson arrival rates, requests/s.")
flags.DEFINE_list("seeds", list(Options.seeds), "Workload seeds.")
flags.DEFINE_string("out", Options.out, "Where tetris_tbt.json and tetris_tbt.png go.")


def main(argv):
    del argv
    experiments.run("tetris_tbt", **{k: flags.FLAGS[k].value for k in experiments.option_names("tetris_tbt")})


if __name__ == "__main__":
    app.run(main)
