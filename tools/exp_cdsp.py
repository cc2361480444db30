"""Tetris in simulation: CDSP vs fixed SP vs request-level SP on a prefill pool, over Tetris-shaped and Azure
traces: max sustainable rates, TTFT across loads, chunking and improvement-rate ablations
(jaxserve/lab/claims/cdsp.py). Writes plots and cdsp.json (cdsp_70b.json) to --out.

    .venv/bin/python tools/exp_cdsp.py [--requests=600] [--out=docs/figures]
    .venv/bin/python tools/exp_cdsp.py --model=70b --traces=medium,long    # Tetris's 70B setting (cdsp_70b.json)
"""

from __future__ import annotations

from absl import app, flags

from jaxserve.lab import experiments
from jaxserve.lab.claims.cdsp import Options

flags.DEFINE_integer("requests", Options.requests, "Requests per simulated run.")
flags.DEFINE_list("traces", list(Options.traces), "Traces to run: long-context shapes or Azure.")
flags.DEFINE_string("out", Options.out, "Where plots and cdsp.json (cdsp_70b.json) go.")
flags.DEFINE_enum(
    "model",
    Options.model,
    ["8b", "70b"],
    "8b: Tetris Table 1 on 16 TP-1 A100 instances; 70b: 8 TP-4 "
    "Llama-2-70B instances on H100 (the closest profile to Tetris's A100 70B), Eq. (1) fitted to "
    "ring-SP prefill times from the profile (sim/esp_cost.ESPCost).",
)


def main(argv):
    del argv
    experiments.run("cdsp", **{k: flags.FLAGS[k].value for k in experiments.option_names("cdsp")})


if __name__ == "__main__":
    app.run(main)
