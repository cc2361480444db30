"""CSA cost fractions (sched/csa_cost.py) on hand-counted cases, no jax. tests/sharding/test_csa.py checks them against
the device path's masks and K/V counts."""

from __future__ import annotations


import pytest

from jaxserve.sched import csa_cost as cc


def test_geometric_drops_halve_what_each_farther_level_keeps():
    assert cc.geometric_drops(1, 0.3) == (0.0,)
    assert cc.geometric_drops(4, 0.2) == pytest.approx((0, 0.2, 0.6, 0.8))
    assert cc.geometric_drops(3, 0.0) == (0.0, 0.0, 0.5)  # even at level-2 drop 0, level 3 keeps half


def test_keep_count_rounds_half_up():
    assert [cc.keep_count(d, 10) for d in (0, 0.25, 0.5, 0.96, 1)] == [10, 8, 5, 0, 0]  # 7.5 -> 8, 0.4 -> 0


@pytest.mark.parametrize("spans", [(1,), (1, 2), (1, 2, 4, 8), (1, 4, 8), (1, 3, 6), (1, 2, 4, 8, 16)])
def test_ring_pairs_partition_all_earlier_pairs(spans):
    sp = spans[-1]
    brute = [0] * len(spans)
    for j in range(sp):
        for i in range(j):
            brute[next(v for v, s in enumerate(spans) if i // s == j // s)] += 1
    assert cc.ring_pairs(spans) == tuple(brute)
    assert sum(brute) == sp * (sp - 1) // 2


def test_two_partitions_by_hand():
    # t = 4 tokens on each of 2 devices; level 2 keeps 2 of device 0's 4 tokens for device 1's queries.
    spans, drops = (1, 2), (0, 0.5)
    assert cc.kv_tokens_by_level(spans, drops, 4) == (0, 2)
    # dense causal: 8 * 9 / 2 = 36 pairs; CSA: 2 * (4 * 5 / 2) own-partition pairs + 4 queries * 2 kept keys
    assert cc.attention_fraction(spans, drops, 4) == 28 / 36
    # Ulysses, 8 heads over 8 KV heads: (2 - 1) * 4 tokens * (2 * 8 + 2 * 8); CSA: 2 tokens * 2 * 8
    assert cc.comm_fraction(spans, drops, 4, heads=8, kv_heads=8) == 32 / 128


@pytest.mark.parametrize("spans", [(1, 2), (1, 2, 4), (1, 2, 4, 8), (1, 4, 8)])
def test_nothing_dropped_keeps_every_pair_and_more_drop_keeps_less(spans):
    t = 32
    zero = (0.0,) * len(spans)
    assert cc.attention_fraction(spans, zero, t) == 1.0
    last_attn = last_comm = 2.0
    for drop in (0.1, 0.4, 0.7, 1.0):
        drops = (0.0,) + (drop,) * (len(spans) - 1)
        attn, comm = cc.attention_fraction(spans, drops, t), cc.comm_fraction(spans, drops, t, 32, 8)
        assert attn < last_attn and comm < last_comm
        last_attn, last_comm = attn, comm
    assert last_comm == 0  # drop 1: no K/V leaves a device
    assert last_attn == pytest.approx(1 / spans[-1], rel=0.1)  # only the own partitions' causal triangles


def test_comm_fraction_is_below_one_for_the_paper_schedule_and_can_exceed_it_without_drops():
    for spans in [(1, 2), (1, 2, 4), (1, 2, 4, 8)]:
        for heads, kv_heads in [(8, 8), (32, 8), (8, 1)]:
            drops = cc.geometric_drops(len(spans), 0.0)
            assert cc.comm_fraction(spans, drops, 64, heads, kv_heads) < 1
    # 16 partitions, 8 heads over 8 KV heads, nothing dropped: 120 earlier pairs of 64-token K/V, against
    # Ulysses' (15/16) * 1024 tokens of q and o (8 heads) and k and v (replicated to 16 heads)
    assert cc.comm_fraction((1, 16), (0, 0), 64, 8, 8) == pytest.approx(120 * 64 * 2 * 8 / (15 * 64 * (16 + 32)))
    assert cc.comm_fraction((1,), (0,), 64, 8, 8) == 1.0
