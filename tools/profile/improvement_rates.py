"""Tetris's offline improvement-rate profile (Section 5.1) for a live prefill pool: for each arrival rate, the
improvement rate with the lowest mean TTFT when the pool's own measured Eq. (1) plans a trace in simulation. The
table it writes is what `serve --improvement_rates=FILE` reads.

    .venv/bin/python tools/profile/improvement_rates.py --prefill_profile=EQ1.json --prefill_instances=4 \\
        --node_size=2 [--min_chunk=1024] [--trace=azure_code] [--requests=300] [--rates=0.5,1,2,4] --out=rates.json

EQ1.json: the pool's Eq. (1) fit, as the cluster writes it at its first start (--prefill_profile, or the cache
folder's profiles/*cdsp*.json). The trace: any `simulate --trace` (a packaged one, a file, or mix).
"""

from __future__ import annotations

import pathlib

from absl import app, flags
from tqdm import tqdm

from jaxserve.lab.improvement_rate import IMPROVEMENT_RATES, profile_improvement_rates
from jaxserve.sched.cdsp import CDSPPlanner, Pool
from jaxserve.sched.cost_models import TetrisPrefill
from jaxserve.sched.improvement_rate import RateTable
from jaxserve.sim.run import make_workload

FLAGS = flags.FLAGS
flags.DEFINE_string("prefill_profile", None, "The pool's Eq. (1) fit (JSON).", required=True)
flags.DEFINE_integer("prefill_instances", None, "Instances in the pool.", required=True)
flags.DEFINE_integer("node_size", 2, "Pool instances per node.")
flags.DEFINE_integer("min_chunk", 1024, "The smallest CDSP chunk, tokens.")
flags.DEFINE_string("trace", "azure_code", "The prompts: a packaged trace, a trace file, or mix.")
flags.DEFINE_integer("requests", 300, "Requests per simulated run.")
flags.DEFINE_integer("max_len", None, "Prompts longer than this are left out (the pool's --max_model_len).")
flags.DEFINE_list("rates", ["0.25", "0.5", "1", "2", "4"], "Arrival rates to profile, requests/s.")
flags.DEFINE_list("candidates", [str(r) for r in IMPROVEMENT_RATES], "Improvement rates tried at each.")
flags.DEFINE_integer("seed", 0, "The workload's random draws.")
flags.DEFINE_string("out", None, "Where to write the table (JSON).", required=True)


def main(argv) -> None:
    del argv
    eq1 = TetrisPrefill.from_json(pathlib.Path(FLAGS.prefill_profile).read_text())
    if FLAGS.prefill_instances % FLAGS.node_size:
        raise app.UsageError(
            f"--prefill_instances={FLAGS.prefill_instances} is not whole nodes of --node_size={FLAGS.node_size}"
        )
    pool = Pool(FLAGS.prefill_instances // FLAGS.node_size, FLAGS.node_size)
    rates = sorted(float(r) for r in FLAGS.rates)
    best = []
    for rate in tqdm(rates, desc="arrival rates", unit="rate"):  # one at a time, for the progress bar
        best += profile_improvement_rates(
            lambda r: CDSPPlanner(eq1, pool, r, min_chunk=FLAGS.min_chunk),
            lambda x: make_workload(FLAGS.trace, x, FLAGS.requests, seed=FLAGS.seed, max_len=FLAGS.max_len),
            pool.size,
            eq1.fastest,
            [rate],
            [float(c) for c in FLAGS.candidates],
        ).improvement_rates
    table = RateTable(tuple(rates), tuple(best))
    pathlib.Path(FLAGS.out).write_text(table.to_json())
    for rate, best in zip(table.arrival_rates, table.improvement_rates):
        print(f"{rate:6.2f} req/s: improvement rate {best}")
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
