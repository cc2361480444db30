"""Tetris's load-aware improvement rate offline: the profile, and the capacity CDSP gains with it (the online side:
tests/sched/test_improvement_rate.py)."""

from __future__ import annotations


from jaxserve.lab.improvement_rate import profile_improvement_rates
from jaxserve.sched import cost_models as cm
from jaxserve.sched.cdsp import CDSPPlanner, FixedSPPlanner, Pool
from jaxserve.sched.improvement_rate import AdaptiveCDSP
from jaxserve.sched.profiles import tetris_table1_samples
from jaxserve.sim.prefill_pool import max_sustainable_rate
from jaxserve.sim.workload import long_context


MODEL = cm.TetrisPrefill.fit(tetris_table1_samples())
POOL = Pool(nodes=2, per_node=8)


best = MODEL.fastest


def test_offline_profile_prefers_expansion_at_light_load_and_restraint_under_load():
    table = profile_improvement_rates(
        lambda r: CDSPPlanner(MODEL, POOL, r),
        lambda rate: long_context("short", 300, rate, seed=1),
        POOL.size,
        best,
        arrival_rates=[0.2, 5.0],
        candidates=(0.05, 0.5),
    )
    assert table.improvement_rates == (0.05, 0.5)


def test_cdsp_sustains_more_load_than_the_best_fixed_sp():
    """The issue's bar, on the Medium trace: >= 20% more max sustainable load than fixed SP 8 or 16."""

    def workload_at(rate):
        return long_context("medium", 300, rate, seed=0)

    table = profile_improvement_rates(
        lambda r: CDSPPlanner(MODEL, POOL, r),
        lambda rate: long_context("medium", 300, rate, seed=1),
        POOL.size,
        best,
        arrival_rates=[0.5, 1.0, 2.0, 4.0],
    )
    cdsp = max_sustainable_rate(
        lambda: AdaptiveCDSP(CDSPPlanner(MODEL, POOL), table), workload_at, POOL.size, best, 0.1, 20.0
    )
    fixed = max(
        max_sustainable_rate(lambda sp=sp: FixedSPPlanner(MODEL, POOL, sp), workload_at, POOL.size, best, 0.1, 20.0)
        for sp in (8, 16)
    )
    assert cdsp >= 1.2 * fixed
