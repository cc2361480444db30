"""CSPS's prefill cost and planner (sched/csps.py): the pieces it adds up, CSA's calibrated drop and kept pairs,
SPT sizing and group placement, on a GPU profile and on a live pool's measured Eq. (1)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.sched import csa_cost, sp_layout
from jaxserve.sched.cdsp import Pool, Stores
from jaxserve.sched.cost_models import TetrisPrefill
from jaxserve.sched.csps import CSPSPlanner, CSPSPrefill, MeasuredCSPS
from jaxserve.sched.profiles import ProfileBatchCost, model_shape, network

PROFILE = "a100_llama3_8b"  # 32 query heads


def test_dense_time_is_linear_ops_of_one_spt_plus_the_longer_of_attention_and_all_to_alls():
    one = ProfileBatchCost(PROFILE, tp=1)
    hidden = model_shape(PROFILE).hidden
    for sp, link in ((4, "intra_node"), (16, "inter_node")):
        tokens = 300_000
        attention = one.prefill_attention(tokens, 0) / sp
        comm = one.layers * sp_layout.layer_seconds("sp_ntp", tokens, hidden, sp, False, network("a100"), link)
        linear = one.linear_ops(-(-tokens // sp))
        assert CSPSPrefill(PROFILE, cut=0.0).seconds(sp, tokens) == pytest.approx(linear + max(attention, comm))
        assert CSPSPrefill(PROFILE, cut=0.0, pipelined=False).seconds(sp, tokens) == pytest.approx(
            linear + attention + comm
        )
    # one GPU: no partner, no all-to-all, no CSA: the single-GPU prefill
    assert CSPSPrefill(PROFILE).seconds(1, 8192) == pytest.approx(one.linear_ops(8192) + one.prefill_attention(8192, 0))
    with pytest.raises(ValueError, match="32 heads"):  # SP-NTP gives each GPU whole heads
        CSPSPrefill(PROFILE).seconds(48, 1 << 20)


@pytest.mark.parametrize("sp", [2, 8, 16, 32])  # two levels up to a node, three beyond
def test_csa_drops_are_solved_to_keep_the_papers_share_of_pairs(sp):
    model = CSPSPrefill(PROFILE, cut=0.28)
    t = 16384
    spans, drops = model.spans(sp), model.drops(sp, t)
    assert spans[-1] == sp and drops[0] == 0
    assert csa_cost.attention_fraction(spans, drops, t) == pytest.approx(0.72, abs=1e-3)
    assert all(a <= b for a, b in zip(drops, drops[1:]))  # farther levels keep no more
    if sp == 32:  # the geometric schedule's third level alone keeps half: level 2 keeps everything instead
        assert drops[1] == 0 and drops[2] < 0.5


@pytest.mark.parametrize("sp, t", [(8, 4096), (32, 32768)])  # long enough that attention outlasts the all-to-alls
def test_csa_attention_is_the_kept_pairs_spread_over_the_group(sp, t):
    """The kept pairs counted pair by pair over the partitions, independently of csa_cost: each partition's own
    tokens causally, and at each level the earlier partitions of its ring through their kept tokens. The segment's
    GPUs split the heads, so the group's time is the kept pairs over sp GPUs."""
    model = CSPSPrefill(PROFILE, cut=0.28)
    spans, drops = model.spans(sp), model.drops(sp, t)
    kept = 0
    for j in range(sp):
        kept += t * (t + 1) // 2
        for v in range(1, len(spans)):
            ring = [i for i in range(j) if i // spans[v] == j // spans[v] and i // spans[v - 1] != j // spans[v - 1]]
            kept += len(ring) * t * csa_cost.keep_count(drops[v], t)
    n = sp * t
    one = ProfileBatchCost(PROFILE, tp=1)
    attention = one.prefill_attention(n, 0) / sp * kept / (n * (n + 1) // 2)
    assert kept / (n * (n + 1) // 2) == pytest.approx(0.72, abs=2e-3)
    assert model.seconds(sp, n) - one.linear_ops(t) == pytest.approx(attention, rel=1e-9)  # attention binds here


def test_spt_sizing_and_the_group_that_frees_first():
    planner = CSPSPlanner(CSPSPrefill(PROFILE), Pool(nodes=2, per_node=8), spt=131072)
    assert [planner.sp_for(n) for n in (1000, 131072, 131073, 1 << 20, 4 << 20)] == [1, 1, 2, 8, 16]
    queues = [5.0] * 8 + [0.0] * 4 + [1.0] * 4
    plan = planner.plan(1 << 20, queues)  # 8 GPUs: the second node, free at 1 s
    (chunk,) = plan.chunks
    assert chunk.group == tuple(range(8, 16)) and chunk.start == 1.0
    assert plan.ttft == pytest.approx(1.0 + planner.fastest(1 << 20))
    with pytest.raises(ValueError, match="cut"):
        CSPSPrefill(PROFILE, cut=1.0)


def test_groups_beyond_a_node_start_at_any_node_and_stop_at_the_heads():
    planner = CSPSPlanner(CSPSPrefill(PROFILE), Pool(nodes=6, per_node=8), spt=16384)
    assert planner.sp_for(1 << 20) == 32  # 64 SPTs wanted, 32 heads to split
    queues = [9.0] * 8 + [0.0] * 40  # the first node busy: GPUs 8-39 are free now
    (chunk,) = planner.plan(1 << 20, queues).chunks
    assert chunk.group == tuple(range(8, 40)) and chunk.start == 0.0


def test_the_live_planner_takes_the_measured_sizes_and_its_stores_bound_the_group():
    """Live, the sizes are those measured on the pool and a prompt's partitions must fit the instances' history
    stores: a prompt whose SPT would overflow a store takes more instances."""
    eq1 = TetrisPrefill({s: np.array([0.01 * s, 1e-3 / s, 0.0, 1e-7 / s]) for s in (1, 2, 4)})
    pool = Pool(nodes=2, per_node=2)
    planner = CSPSPlanner(MeasuredCSPS(eq1), pool, spt=4096, sizes=[1, 2, 4], stores=Stores(1024, 64))
    assert [planner.sp_for(n) for n in (1000, 1025, 3000, 5000)] == [1, 2, 4, 4]
    assert planner.longest() == 4096
    assert planner.groups() == [(0,), (1,), (2,), (3,), (0, 1), (2, 3), (0, 1, 2, 3)]
    (chunk,) = planner.plan(1500, [0.5, 0.5, 0.2, 0.0]).chunks
    assert chunk.group == (2, 3) and chunk.start == 0.2 and chunk.end == pytest.approx(0.2 + eq1.predict(2, 1500))
    for sizes in ([3], [1, 8], [4, 16]):  # not a power of two; past the pool; a node and a half
        with pytest.raises(ValueError, match="powers of two"):
            CSPSPlanner(MeasuredCSPS(eq1), Pool(nodes=3, per_node=4) if 16 in sizes else pool, sizes=sizes)
