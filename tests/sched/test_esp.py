"""LoongServe ESP scheduling: admission under memory and compute, decode-slot preemption by gain and cost,
elastic allocation by gain and cost, and the batching DP checked against brute force."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest

from jaxserve.sched import cost_models as cm
from jaxserve.sched.esp import (
    ElasticInstance,
    ESPBatch,
    ESPScheduler,
    RunningDecodes,
    isolated_room,
    keeper,
    split_evenly,
)
from jaxserve.sched.profiles import tetris_table1_samples
from jaxserve.sched.request import Request


# LoongServe's model at TP=1, fitted to Tetris Table 1 (one request per sample: sum(l) = l, sum(l^2) = l^2)
MODEL = cm.LoongServePrefill.fit([((sp, 1), (n, n * n), t) for sp, (n, _), t in tetris_table1_samples()])
KV_BYTES = 131072.0  # LLaMA3-8B, bf16


def esp(**kw):
    return ESPScheduler(
        MODEL,
        tp=1,
        knee=kw.pop("knee", 30.0),
        migration_bandwidth=kw.pop("bw", 25e9),
        kv_bytes_per_token=KV_BYTES,
        **kw,
    )


def req(i, n):
    return Request(str(i), 0.0, n, 64)


def test_a_measured_model_replaces_the_prior_it_started_with():
    """A pool starts on the prior and plans with its measured model once it has it (cluster/build.py): latency
    and knee follow the model given to `use`."""
    keys = sorted(MODEL.coefficients)
    s = ESPScheduler(cm.LoongServePrefill.prior(keys), 1, 1.0, None, KV_BYTES)
    assert s.latency([32768], 8) != pytest.approx(MODEL.predict(8, 1, [32768]))
    s.use(MODEL, ESPScheduler.served_knee(MODEL, 1, 8192))
    assert s.latency([32768], 8) == pytest.approx(MODEL.predict(8, 1, [32768]))
    assert s.knee == pytest.approx(MODEL.predict(1, 1, [8192]))


def test_latency_interpolates_between_fitted_sp_sizes():
    s = esp()
    assert s.latency([32768], 8) == pytest.approx(MODEL.predict(8, 1, [32768]))
    between = s.latency([32768], 12)
    assert (
        min(s.latency([32768], 8), s.latency([32768], 16))
        <= between
        <= max(s.latency([32768], 8), s.latency([32768], 16))
    )


def test_admission_stops_at_memory_then_at_the_knee_in_fcfs_order():
    inst = [ElasticInstance(i, 100_000) for i in range(4)]
    s = esp(output_estimate=1000)
    pending = [req(i, 60_000) for i in range(10)]
    assert len(s.admit(pending, inst)) == 6  # 6 x 61K <= 400K < 7 x 61K
    inst[0].kv_used = 90_000  # decoding requests hold memory now
    assert len(s.admit(pending, inst)) == 5
    tight = esp(knee=s.latency([60_000] * 2, 4) + 1e-6, output_estimate=1000)
    assert len(tight.admit(pending, [ElasticInstance(i, 10**6) for i in range(4)])) == 2
    big_first = [req(0, 10**6), req(1, 10)]
    assert s.admit(big_first, inst) == []  # FCFS: the small one does not overtake


def test_out_of_order_admission_lets_a_bounded_number_of_plans_pass_a_request_that_does_not_fit():
    inst = [ElasticInstance(i, 100_000) for i in range(4)]
    s = esp(output_estimate=1000, max_overtakes=2)
    big = req("big", 500_000)  # more than the pool holds while anything else is in it
    for round_ in range(2):  # two plans may go ahead of it, each admitting a later small request
        small = req(f"small{round_}", 10_000)
        batches = s.plan([big, small], inst)
        assert [r.id for b in batches for r in b.requests] == [small.id]
    assert s.plan([big, req("small2", 10_000)], inst) == []  # overtaken twice: FCFS again until it runs
    assert esp(output_estimate=1000).plan([big, req("small", 10_000)], inst) == []  # the default is strict FCFS


def test_isolated_room_packs_the_kv_in_use_onto_the_largest_instances():
    ins = [ElasticInstance(0, 100, 30), ElasticInstance(1, 100, 0), ElasticInstance(2, 50, 40)]
    assert isolated_room(ins) == 150  # 70 in use fit instance 0 (or 1): the other 100 + 50 are free
    ins[1].kv_used = 40  # 110 in use need both 100s
    assert isolated_room(ins) == 50
    assert isolated_room([ElasticInstance(0, 100)]) == 100


def test_decode_preemption_gain_and_cost_by_hand():
    decodes = RunningDecodes(room=0, generated=(100, 400), avg_output=1000, step_time=0.02)
    # the least advanced decode has 900 steps of 20 ms left: 18 s saved for each request that need not wait
    assert ESPScheduler.preemption_gain([req(0, 20_000), req(1, 10_000)], decodes) == pytest.approx(
        18 * (1 / 20_000 + 1 / 10_000)
    )
    assert ESPScheduler.preemption_cost(2.0, decodes.generated) == pytest.approx(2.0 * (1 / 100 + 1 / 400))
    past_average = RunningDecodes(room=0, generated=(1500,), avg_output=1000, step_time=0.02)
    assert ESPScheduler.preemption_gain([req(0, 20_000)], past_average) == 0.0  # (.)^+: no wait to save


def test_admission_preempts_decode_slots_only_when_the_gain_beats_the_cost():
    """Instance 0 holds 30K of decode KV: 100K stays free apart from it. The 60K prompt fits that; the 50K after
    it needs instance 0's free slots, which pauses its decode for the ~7 s prefill of both."""
    ins = [ElasticInstance(0, 100_000, kv_used=30_000), ElasticInstance(1, 100_000)]
    s = esp(output_estimate=0)
    pending = [req(0, 60_000), req(1, 50_000)]
    room = isolated_room(ins)
    young = RunningDecodes(room, generated=(10,), avg_output=1000, step_time=0.02)  # cost 7 s / 10 >> gain 20 s / 50K
    assert [r.id for r in s.admit(pending, ins, decodes=young)] == ["0"]
    old = RunningDecodes(room, generated=(2000,), avg_output=20_000, step_time=0.05)  # gain 900 s / 50K > 7 s / 2000
    assert [r.id for r in s.admit(pending, ins, decodes=old)] == ["0", "1"]
    assert len(s.admit(pending, ins, decodes=RunningDecodes(room, (), 1000, 0.02))) == 2  # no decode to pause
    assert len(s.admit(pending, ins, decodes=dataclasses.replace(young, room=200_000))) == 2  # room for both
    assert len(s.admit(pending, ins)) == 2  # the ablation takes the slots without weighing the pause
    assert len(s.plan(pending, ins, decodes=young)) == 1


def test_allocation_takes_busy_instances_while_the_kv_does_not_fit_whatever_moving_costs():
    s = esp(output_estimate=0, bw=1.0)  # moving any KV costs more than it could gain
    ins = [
        ElasticInstance(0, 100_000),
        ElasticInstance(1, 100_000, kv_used=50_000),
        ElasticInstance(2, 100_000, kv_used=60_000),
        ElasticInstance(3, 100_000, kv_used=70_000),
    ]
    assert [e.id for e in s.allocate([req(0, 170_000)], ins)] == [0, 1, 2]  # 100K + 50K < 170K <= + 40K
    assert [e.id for e in s.allocate([req(0, 90_000)], ins)] == [0]


def test_allocation_takes_a_busy_instance_only_when_its_gain_beats_moving_its_kv():
    reqs = [req(0, 131072)]
    idle = [ElasticInstance(i, 10**6) for i in range(2)]
    light = ElasticInstance(2, 10**6, kv_used=1000)
    heavy = ElasticInstance(3, 10**6, kv_used=900_000)
    chosen = esp(bw=25e9).allocate(reqs, idle + [heavy, light])
    assert [e.id for e in chosen] == [0, 1, 2]  # light joins (little to move); then heavy's KV costs too much
    assert [e.id for e in esp(bw=1e18).allocate(reqs, idle + [heavy, light])] == [0, 1, 2, 3]


def brute_force(s, reqs, ins, max_sp=None):
    reqs = sorted(reqs, key=lambda r: -r.prompt_len)
    ins = sorted(ins, key=lambda e: e.kv_used)

    @functools.cache
    def best(i, k):  # place reqs[i:] on ins[k:]
        if i == len(reqs):
            return 0.0
        out = math.inf
        for i2 in range(i + 1, len(reqs) + 1):
            need = sum(map(s.kv_need, reqs[i:i2]))
            for k1 in range(k, len(ins)):  # skip instances k..k1-1
                for k2 in range(k1 + 1, min(len(ins), k1 + (max_sp or len(ins))) + 1):
                    if sum(e.free for e in ins[k1:k2]) >= need:
                        t = s.latency([r.prompt_len for r in reqs[i:i2]], k2 - k1)
                        out = min(out, (i2 - i) * t + best(i2, k2))
        return out

    return best(0, 0)


@pytest.mark.parametrize("max_sp", [None, 1, 2])
@pytest.mark.parametrize("seed", range(8))
def test_batching_dp_matches_brute_force(seed, max_sp):
    rng = np.random.default_rng(seed)
    s = esp(output_estimate=256, max_sp=max_sp)
    reqs = [req(i, int(rng.integers(1000, 200_000))) for i in range(int(rng.integers(1, 6)))]
    ins = [ElasticInstance(i, 300_000, int(rng.integers(0, 200_000))) for i in range(int(rng.integers(2, 6)))]
    try:
        batches = s.batch(reqs, ins)
    except ValueError:
        assert brute_force(s, reqs, ins, max_sp) == math.inf
        return
    assert sum(b.time * len(b.requests) for b in batches) == pytest.approx(brute_force(s, reqs, ins, max_sp))
    assert all(len(b.instances) <= (max_sp or len(ins)) for b in batches)
    placed = [r.id for b in batches for r in b.requests]
    assert sorted(placed) == sorted(r.id for r in reqs)
    used = [i for b in batches for i in b.instances]
    assert len(used) == len(set(used))  # batches run on disjoint instance groups
    for b in batches:
        assert sum(map(s.kv_need, b.requests)) <= sum(e.free for e in ins if e.id in b.instances)


def test_plan_runs_admission_allocation_and_batching():
    s = esp(output_estimate=512)
    ins = [ElasticInstance(i, 400_000) for i in range(8)]
    batches = s.plan([req(i, n) for i, n in enumerate([200_000, 8000, 6000, 4000])], ins)
    assert sum(len(b.requests) for b in batches) == 4
    assert max(len(b.instances) for b in batches) >= 2  # the long prompt gets SP


def test_plan_holds_back_the_latest_admitted_when_the_batches_cannot_hold_them():
    s = esp(output_estimate=0, max_sp=1)  # replicas: a request's KV must fit one instance
    ins = [ElasticInstance(0, 100_000), ElasticInstance(1, 1_000_000, kv_used=950_000)]
    pending = [req(0, 60_000), req(1, 60_000)]
    assert len(s.admit(pending, ins)) == 2  # the pool as a whole has room for both ...
    batches = s.plan(pending, ins)  # ... but neither instance has room for the second
    assert [r.id for b in batches for r in b.requests] == ["0"]


def test_admission_counts_the_growth_of_requests_already_decoding():
    ins = [ElasticInstance(i, 100_000) for i in range(2)]
    s = esp(output_estimate=0)
    assert len(s.admit([req(0, 50_000), req(1, 50_000)], ins)) == 2
    assert len(s.admit([req(0, 50_000), req(1, 50_000)], ins, growth=110_000)) == 1  # 210K > 200K


def test_scale_down_keeps_kv_on_the_fewest_instances_that_hold_prompt_and_output():
    s = esp(output_estimate=10_000)
    ins = [ElasticInstance(i, 100_000, kv_used=u) for i, u in enumerate([0, 50_000, 20_000, 0])]
    batch = ESPBatch((req(0, 120_000), req(1, 30_000)), (0, 1, 2, 3), 1.0)
    shards = s.scale_down(batch, ins)
    # the long one first, on the two emptiest (200K free >= 130K), split evenly
    assert shards["0"] == {0: 60_000, 3: 60_000} or shards["0"] == {3: 60_000, 0: 60_000}
    # then the short one: 2's 80K free now beats 0/3's 40K
    assert shards["1"] == {2: 30_000}
    assert [e.kv_used for e in ins] == [60_000, 50_000, 50_000, 60_000]
    for placed in shards.values():  # the member with the most room left is last: it takes new tokens
        tail = next(reversed(placed))
        assert ins[tail].free == max(ins[i].free for i in placed)


def test_scale_down_spreads_over_every_instance_when_none_suffice():
    s = esp(output_estimate=0)
    ins = [ElasticInstance(i, 10_000, kv_used=u) for i, u in enumerate([9_000, 0, 5_000])]
    assert s.scale_down(ESPBatch((req(0, 14_000),), (0, 1, 2), 1.0), ins)["0"] == {2: 5_000, 1: 9_000}
    for e, used in zip(ins, [9_000, 0, 5_000]):
        e.kv_used = used
    shards = s.scale_down(ESPBatch((req(0, 15_500),), (0, 1, 2), 1.0), ins)  # 16K free in all: all three
    assert shards["0"] == {0: 1_000, 2: 5_000, 1: 9_500}  # the nearly full ones give what they can
    assert split_evenly(7, ins[1:2] * 1) == {1: 7}


def test_scale_up_grows_onto_the_emptiest_instance_outside_the_group():
    ins = [ElasticInstance(i, 1000, kv_used=u) for i, u in enumerate([1000, 300, 100, 1000])]
    assert ESPScheduler.scale_up({0: 1000}, ins) == 2
    assert ESPScheduler.scale_up({0: 1000, 2: 900}, ins) == 1
    assert ESPScheduler.scale_up({0: 1000, 1: 700, 2: 900}, ins) is None  # 3 is full


def test_multi_master_spreads_masters_over_the_group():
    mastered: dict[int, int] = {}
    picks = []
    for _ in range(6):
        m = ESPScheduler.master({0: 500, 1: 100, 2: 100}, mastered)
        mastered[m] = mastered.get(m, 0) + 1
        picks.append(m)
    assert picks[0] == 0  # ties go to the instance holding more of the KV
    assert sorted(mastered.values()) == [2, 2, 2]
    assert ESPScheduler.master({2: 10, 0: 500}, {2: 9}, multi_master=False) == 2  # single master: the first


def test_a_live_cluster_weighs_pausing_a_busy_instances_decodes():
    """Without a bandwidth no KV is evacuated: a busy instance costs its decodes' wait, the prefill's time per
    token each has generated, against the time saved per prompt token (~7.7e-6 s for this prompt): decodes of a
    few tokens keep their instance; one 100K tokens in (0.25 s / 100K) lends it."""
    reqs = [req(0, 8192)]
    idle = [ElasticInstance(i, 10**6) for i in range(2)]
    young = ElasticInstance(2, 10**6, kv_used=1000, generated=(2, 3))
    old = ElasticInstance(3, 10**6, kv_used=1000, generated=(100_000,))
    assert [e.id for e in esp(bw=None).allocate(reqs, idle + [young])] == [0, 1]
    assert [e.id for e in esp(bw=None).allocate(reqs, idle + [old])] == [0, 1, 3]


def test_batches_use_only_the_allowed_instance_groups():
    """A live cluster has programs only for aligned groups: {1, 2} is not one, so the DP keeps the two prompts
    apart or pairs aligned instances."""
    ins = [ElasticInstance(i, 10**6) for i in range(4)]
    reqs = [req(0, 200_000), req(1, 150_000)]
    aligned = [(0,), (1,), (2,), (3,), (0, 1), (2, 3), (0, 1, 2, 3)]
    for batch in esp(groups=aligned).batch(reqs, ins):
        assert tuple(sorted(batch.instances)) in aligned
    odd = [ElasticInstance(0, 10**6, kv_used=10), ElasticInstance(1, 10**6), ElasticInstance(2, 10**6, kv_used=5)]
    only_pairs = esp(groups=[(0, 1)])  # emptiest first is 1, 2, 0: (0, 1) is no contiguous range of that order
    with pytest.raises(ValueError, match="does not fit"):
        only_pairs.batch([req(0, 1000)], odd)


def test_the_keeper_is_the_instance_with_the_most_free_kv_ties_to_the_lowest_id():
    group = [ElasticInstance(3, 100, 40), ElasticInstance(1, 100, 70), ElasticInstance(2, 100, 40)]
    assert keeper(group).id == 2
    assert keeper(group[1:2]).id == 1
