"""Scheduler speed, printed (not asserted): LARS batch formation with 1,000 queued requests (Medha's goal:
<= 200 us) and simulated requests per wall-second on the Azure conv trace.

    .venv/bin/python tools/bench/scheduler.py [--queued=1000] [--decodes=64] [--trace_requests=19366]
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags
from tqdm import tqdm

from jaxserve.sched.packer import PackerConfig
from jaxserve.sched.plan import Outcome
from jaxserve.sched.policies import make_policy
from jaxserve.sched.profiles import ProfileBatchCost
from jaxserve.sched.request import Request
from jaxserve.sched.kv_manager import KVCacheManager
from jaxserve.sched.scheduler import ReplicaScheduler
from jaxserve.config import SLO, SimConfig
from jaxserve.sim import run
from jaxserve.sim.simulator import replica_kv_capacity

FLAGS = flags.FLAGS
flags.DEFINE_integer("queued", 1000, "Prefill requests waiting.")
flags.DEFINE_integer("decodes", 64, "Most requests holding KV at once (so the most decodes per batch).")
flags.DEFINE_integer("calls", 2000, "Batch formations timed.")
flags.DEFINE_integer("warmup", 200, "Iterations before timing starts (decodes build up).")
flags.DEFINE_integer("trace_requests", None, "Azure conv requests to simulate (default: all).")
flags.DEFINE_string("policy", "lars", "Policy to time.")


def batch_formation() -> np.ndarray:
    """Steady state: every iteration's Plan is applied, new prompts keep the queue at --queued, and up to
    --decodes requests decode per batch; only schedule() is timed."""
    rng = np.random.default_rng(0)
    cost = ProfileBatchCost("a100_llama3_8b", tp=8)
    sched = ReplicaScheduler(
        make_policy(FLAGS.policy),
        cost,
        PackerConfig(iteration_budget=0.05, space_sharing=True),
        KVCacheManager.for_tokens(replica_kv_capacity(SimConfig(tp=8)), 16, False),
        slo=SLO(),
        max_num_seqs=FLAGS.decodes,
    )
    ids = iter(range(10**9))

    def arrive(now: float) -> None:
        long = rng.random() < 0.05
        n = int(rng.integers(131072, 1 << 20) if long else rng.integers(50, 4000))
        sched.add(Request(f"p{next(ids)}", now, n, int(rng.integers(10, 400))))

    now, times = 0.0, []
    for _ in range(FLAGS.queued):
        arrive(now)
    for _ in tqdm(range(FLAGS.warmup + FLAGS.calls), desc="batch formation"):
        t = time.perf_counter()
        plan = sched.schedule(now)
        times.append(time.perf_counter() - t)
        now += plan.predicted_time
        tokens = {i.request_id: (0,) for i in plan.items if sched.yields_token(i)}
        sched.apply(plan, Outcome(now, tuple(plan.predicted_time for _ in plan.items), tokens))
        while len(sched.queue) < FLAGS.queued:
            arrive(now)
    return np.array(times[FLAGS.warmup :])


def main(argv):
    del argv
    t = batch_formation() * 1e6
    print(
        f"{FLAGS.policy} batch formation, {FLAGS.queued} queued prefills + up to {FLAGS.decodes} decodes: "
        f"p50 {np.percentile(t, 50):.0f} us, p99 {np.percentile(t, 99):.0f} us (goal <= 200 us)"
    )
    workload = run.make_workload("azure_conv", rate=None, requests=FLAGS.trace_requests)
    res = run.simulate(workload, run.config_for(FLAGS.policy, space_sharing=False), progress=True)
    s = res.summary()["all"]
    print(
        f"simulated {len(workload)} Azure conv requests ({workload.rate:.2f} req/s as recorded) in "
        f"{res.wall_seconds:.1f} s: {s['sim_requests_per_wall_s']:.0f} requests per wall-second "
        f"({res.span:.0f} simulated seconds)"
    )


if __name__ == "__main__":
    app.run(main)
