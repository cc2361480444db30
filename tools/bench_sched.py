"""Scheduler speed, printed (not asserted): LARS batch formation with 1,000 queued requests (Medha's goal:
<= 200 us) and simulated requests per wall-second on the Azure conv trace.

    .venv/bin/python tools/bench_sched.py [--queued=1000] [--decodes=64] [--trace_requests=19366]
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

from jaxserve.sched.packer import PackerConfig
from jaxserve.sched.policies import make_policy
from jaxserve.sched.profiles import ProfileBatchCost
from jaxserve.sched.request import Request
from jaxserve.sched.scheduler import ReplicaScheduler
from jaxserve.sched.slo import SLO
from jaxserve.sim import run

FLAGS = flags.FLAGS
flags.DEFINE_integer("queued", 1000, "Prefill requests waiting.")
flags.DEFINE_integer("decodes", 64, "Requests decoding.")
flags.DEFINE_integer("calls", 2000, "Batch formations timed.")
flags.DEFINE_integer("trace_requests", None, "Azure conv requests to simulate (default: all).")
flags.DEFINE_string("policy", "lars", "Policy to time.")


def batch_formation() -> np.ndarray:
    rng = np.random.default_rng(0)
    cost = ProfileBatchCost("a100_llama3_8b", tp=8)
    sched = ReplicaScheduler(make_policy(FLAGS.policy), cost, PackerConfig(t_target=0.05, space_sharing=True),
                             kv_capacity=1 << 40, slo=SLO())
    for i in range(FLAGS.decodes):
        r = Request(f"d{i}", 0.0, int(rng.integers(100, 4000)), 10**6)
        r.prefilled, r.generated = r.prompt_len, 1
        sched._requests[r.id] = r  # a decoding request, as apply() leaves it
        sched.decoding[r.id] = r
    lengths = np.where(rng.random(FLAGS.queued) < 0.05, rng.integers(131072, 1 << 20, FLAGS.queued),
                       rng.integers(50, 4000, FLAGS.queued))
    for i, n in enumerate(lengths):
        sched.add(Request(f"p{i}", float(rng.uniform(0, 10)), int(n), 100))
    times = []
    for k in range(FLAGS.calls):
        t = time.perf_counter()
        plan = sched.schedule(now=10.0 + k * 1e-3)
        times.append(time.perf_counter() - t)
        sched.in_flight -= plan.request_ids  # plan discarded: the same state is measured again
    return np.array(times)


def main(argv):
    del argv
    t = batch_formation() * 1e6
    print(f"{FLAGS.policy} batch formation, {FLAGS.queued} queued + {FLAGS.decodes} decoding: "
          f"p50 {np.percentile(t, 50):.0f} us, p99 {np.percentile(t, 99):.0f} us (goal <= 200 us)")
    workload = run.make_workload("azure_conv", rate=None, requests=FLAGS.trace_requests)
    res = run.simulate(workload, run.config_for(FLAGS.policy), progress=True)
    s = res.summary()["all"]
    print(f"simulated {len(workload)} Azure conv requests ({workload.rate:.2f} req/s as recorded) in "
          f"{res.wall_seconds:.1f} s: {s['sim_requests_per_wall_s']:.0f} requests per wall-second "
          f"({res.span:.0f} simulated seconds)")


if __name__ == "__main__":
    app.run(main)
