"""Gantt charts of a live cluster run's prefill chunks and of the simulator's plan for the same trace, side by
side: which SP group each chunk of each request ran on, and when.

The run file is what tools/bench_cluster.py writes (run.json): the trace (arrival, prompt length), the pool
(instances, node size), the planner's settings and Eq. (1) fit, and every executed chunk. The simulated side
replays the same arrivals through the same planner and Eq. (1) on sim/'s prefill pool (run_pool), where a
chunk's time is exactly its prediction and nothing else runs.

    .venv/bin/python tools/plot_plan.py --run=bench_out/run.json [--png=bench_out/plan_gantt.png]
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
from absl import app, flags

from jaxserve.sched.cdsp import CDSPPlanner, Pool
from jaxserve.sched.cost_models import TetrisPrefill
from jaxserve.sim import plots
from jaxserve.sim.prefill_pool import PoolRun, run_pool
from jaxserve.sim.workload import Workload

FLAGS = flags.FLAGS


def simulate(run: dict) -> PoolRun:
    """The run's trace through sim/'s prefill pool with the run's planner and Eq. (1)."""
    pool = Pool(run["pool"]["instances"] // run["pool"]["node_size"], run["pool"]["node_size"])
    cost = TetrisPrefill.from_json(json.dumps(run["eq1"]))
    planner = CDSPPlanner(cost, pool, run["planner"]["improvement_rate"], sizes=run["planner"]["sizes"],
                          min_chunk=run["planner"]["min_chunk"])
    workload = Workload(np.array([r["arrival"] for r in run["requests"]], np.float64),
                        np.array([r["prompt_len"] for r in run["requests"]], np.int64),
                        np.array([r["output_len"] for r in run["requests"]], np.int64), "live trace")
    return run_pool(planner, workload, pool.size, cost.fastest)


def simulated_bars(run: dict, sim: PoolRun) -> list[plots.Bar]:
    return [plots.Bar(k, tuple(c.group), r["arrival"] + c.start, r["arrival"] + c.end)
            for k, (r, plan) in enumerate(zip(run["requests"], sim.plans)) for c in plan.chunks]


def live_bars(run: dict) -> list[plots.Bar]:
    return [plots.Bar(c["request"], tuple(c["group"]), c["start"], c["end"]) for c in run["chunks"]]


def draw(run: dict, sim: PoolRun, path: str) -> None:
    plots.gantt({"live cluster (measured)": live_bars(run), "simulator (Eq. 1)": simulated_bars(run, sim)},
                run["pool"]["instances"], path,
                title=f"{len(run['requests'])} requests on {run['pool']['instances']} prefill devices "
                      f"({run['device']})")


def main(argv: list[str]) -> None:
    del argv
    run = json.loads(pathlib.Path(FLAGS.run).read_text())
    out = FLAGS.png or str(pathlib.Path(FLAGS.run).with_name("plan_gantt.png"))
    draw(run, simulate(run), out)
    print(f"wrote {out}")


if __name__ == "__main__":  # flags only when run: tools/bench_cluster.py imports draw and simulate
    flags.DEFINE_string("run", None, "run.json written by tools/bench_cluster.py.")
    flags.DEFINE_string("png", None, "PNG to write (default: plan_gantt.png beside the run file).")
    flags.mark_flag_as_required("run")
    app.run(main)
