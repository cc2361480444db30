"""LoongServe's elastic sequence parallelism in simulation, with its ablations, on 4 instances of Llama-2-7B on
2 x H100: each variant's capacity, then SLO attainment under memory pressure (jaxserve/lab/claims/esp.py: the
variants and the two settings). Writes P50 TTFT / P90 TPOT against load, SLO attainment against load and esp.json
to --out.

    .venv/bin/python tools/exp_esp.py [--requests=200] [--trace=medium] [--memory_requests=150] [--out=docs/figures]
"""

from __future__ import annotations

from absl import app, flags

from jaxserve.lab import experiments
from jaxserve.lab.claims.esp import Options
from jaxserve.sim.workload import LONG_CONTEXT

flags.DEFINE_integer("requests", Options.requests, "Requests per simulated run (capacity setting).")
flags.DEFINE_enum("trace", Options.trace, sorted(LONG_CONTEXT), "Long-context prompt lengths (capacity setting).")
flags.DEFINE_integer(
    "max_output", Options.max_output, "Outputs are uniform in [64, max_output] tokens (capacity setting)."
)
flags.DEFINE_integer("memory_requests", Options.memory_requests, "Requests per simulated run (memory setting).")
flags.DEFINE_enum("memory_trace", Options.memory_trace, sorted(LONG_CONTEXT), "Prompt lengths (memory setting).")
flags.DEFINE_integer(
    "memory_max_output", Options.memory_max_output, "Outputs are uniform in [64, this] tokens (memory setting)."
)
flags.DEFINE_float(
    "memory_utilization",
    Options.memory_utilization,
    "GPU memory for weights + KV (memory setting): 0.35 leaves ~81K KV tokens per instance.",
)
flags.DEFINE_list("memory_rates", list(Options.memory_rates), "Arrival rates, requests/s (memory setting).")
flags.DEFINE_string("out", Options.out, "Where plots and esp.json go.")


def main(argv):
    del argv
    experiments.run("esp", **{k: flags.FLAGS[k].value for k in experiments.option_names("esp")})


if __name__ == "__main__":
    app.run(main)
