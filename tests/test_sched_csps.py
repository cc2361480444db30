"""CSPS's prefill cost and planner (sched/csps.py): the pieces it adds up, CSA's calibrated drop, SPT sizing."""

from __future__ import annotations

import pytest

from jaxserve.sched import csa_cost, sp_layout
from jaxserve.sched.cdsp import Pool
from jaxserve.sched.csps import CSPSPlanner, CSPSPrefill
from jaxserve.sched.profiles import ProfileBatchCost, model_shape, network

PROFILE = "a100_llama3_8b"


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
            linear + attention + comm)
    # one GPU: no partner, no all-to-all, no CSA: the single-GPU prefill
    assert CSPSPrefill(PROFILE).seconds(1, 8192) == pytest.approx(one.linear_ops(8192) + one.prefill_attention(8192, 0))


@pytest.mark.parametrize("sp", [2, 8, 16, 48])  # two levels up to a node, three beyond
def test_csa_drops_are_solved_to_keep_the_papers_share_of_pairs(sp):
    model = CSPSPrefill(PROFILE, cut=0.28)
    t = 16384
    spans, drops = model.spans(sp), model.drops(sp, t)
    assert spans[-1] == sp and drops[0] == 0
    kept = csa_cost.attention_fraction(spans, drops, t)
    least = csa_cost.geometric_drops(len(spans), 0.0)  # a third level keeps at most half its tokens
    if csa_cost.attention_fraction(spans, least, t) >= 0.72:
        assert kept == pytest.approx(0.72, abs=1e-3)
    else:  # 48 GPUs: most pairs lie at the third level, so even the least dropping cuts more than 28%
        assert sp == 48 and drops == pytest.approx(least, abs=1e-6) and kept < 0.72
    # farther levels keep fewer (the paper's geometric schedule)
    assert all(a <= b for a, b in zip(drops, drops[1:]))
    assert model.seconds(sp, sp * t) < CSPSPrefill(PROFILE, cut=0.0).seconds(sp, sp * t)


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
