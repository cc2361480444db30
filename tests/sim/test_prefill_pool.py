"""The prefill-pool simulation with CDSP and fixed-SP planners, cache balancing charged by the executor."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.sched import cost_models as cm
from jaxserve.sched.cdsp import Balancing, CDSPPlanner, FixedSPPlanner, Pool
from jaxserve.sched.profiles import tetris_table1_samples
from jaxserve.sim.prefill_pool import Executor, run_pool
from jaxserve.sim.workload import long_context


MODEL = cm.TetrisPrefill.fit(tetris_table1_samples())
POOL = Pool(nodes=2, per_node=8)
BALANCING = Balancing.from_profile("a100_llama3_8b", per_node=8)


best = MODEL.fastest


def test_pool_run_books_instances_and_times_every_request():
    w = long_context("medium", 200, 1.0, seed=0)
    run = run_pool(CDSPPlanner(MODEL, POOL, 0.2), w, POOL.size, best)
    assert run.ttft.shape == (200,) and np.all(run.ttft >= [best(n) * 0.999 for n in w.prompt_lens])
    assert run.busy > 0 and 0 < run.slo_attainment <= 1
    single = run_pool(FixedSPPlanner(MODEL, POOL, 16), w, POOL.size, best)
    assert np.all(single.chunks == 1)


def test_the_executor_charges_balancing_and_the_planner_predicts_it():
    """Random prompts and queues on 4 nodes, SP up to 32 (so chunks before the last may cross nodes): the executor
    times each chunk on its own (its group's queues, the previous chunk's end, the history moved from the previous
    chunk's group). A balancing-aware plan runs exactly as planned; a blind one pays for the moves it did not
    plan."""
    c16 = MODEL.coef(16)  # SP 32 extrapolated as Table 1 goes from 8 to 16 (as tools/bench/cdsp.py)
    model = cm.TetrisPrefill(MODEL.coefficients | {32: c16 * np.array([1.5, 0.5, 0.5, 0.5])})
    pool = Pool(nodes=4, per_node=8)
    run = Executor(model, BALANCING)
    late = 0
    for seed in range(60):
        rng = np.random.default_rng(seed)
        queues = rng.uniform(0, 3, pool.size) * (rng.random(pool.size) < 0.6)
        tokens, rate = int(rng.integers(4 * 1024, 512 * 1024)), float(rng.uniform(0, 0.5))
        aware = CDSPPlanner(model, pool, rate, balancing=BALANCING).plan(tokens, queues)
        assert [c.end for c in run(aware, queues).chunks] == pytest.approx([c.end for c in aware.chunks], abs=1e-9)
        blind = CDSPPlanner(model, pool, rate).plan(tokens, queues)
        charged = run(blind, queues)
        assert charged.ttft >= blind.ttft - 1e-9
        late += charged.ttft > blind.ttft + 0.01
    assert late >= 5  # 10 of these 60 pay 0.02-0.22 s


def test_pool_run_charges_balancing_the_planner_did_not_plan():
    w = long_context("long", 200, 1.2, seed=0)
    run = Executor(MODEL, BALANCING)
    aware = [
        run_pool(CDSPPlanner(MODEL, POOL, 0.2, balancing=BALANCING), w, POOL.size, best, executor=e).ttft
        for e in (None, run)
    ]
    assert aware[0] == pytest.approx(aware[1], abs=1e-9)
    blind = [run_pool(CDSPPlanner(MODEL, POOL, 0.2), w, POOL.size, best, executor=e).ttft for e in (None, run)]
    assert np.sum(blind[1] > blind[0] + 1e-3) >= 5  # 20 (two moves, and the requests queued behind them)
