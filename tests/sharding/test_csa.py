"""CSA (sharding/csa.py) on one device: the reference against float64 numpy attention (drop 0 is dense causal
attention; with drops, the softmax over exactly the kept keys), the level masks against a brute-force reading of
the rules, the dense error bound as drops shrink, the K/V it moves against SP-NTP's, and sched/csa_cost.py against
all of it. The sharded path runs on 8 devices in tests/sharding/test_csa_sharded.py. Random data throughout."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.sched import csa_cost
from jaxserve.sharding import comm, csa

EPS32 = float(np.finfo(np.float32).eps)
D = 16
HEADS = [(4, 4), (6, 2)]  # GQA ratios 1 and 3
LEVELS = [  # (spans, drops): binary levels (a level per power of 2), and coarser ones
    ((1,), (0,)),
    ((1, 2), (0, 0.5)),
    ((1, 2, 4), (0, 0.25, 0.6)),
    ((1, 2, 4, 8), (0, 0.3, 0.65, 0.8)),
    ((1, 4, 8), (0, 0.5, 0.9)),
    ((1, 3, 6), (0, 0.2, 0.7)),
]


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def masked_dense(q, k, v, mask):
    """float64 softmax attention of every query over the keys its [kvh, q, k] mask allows (GQA by head groups);
    also returns the probabilities [h, q, k]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    n, h, d = q.shape
    mask = np.repeat(np.asarray(mask), h // k.shape[1], axis=0)  # per query head
    kk, vv = (np.repeat(x, h // k.shape[1], axis=1) for x in (k, v))
    s = np.where(mask, np.einsum("qhd,khd->hqk", q, kk) / np.sqrt(d), -np.inf)
    probs = np.exp(s - s.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, vv), probs


def causal(n, kvh):
    return np.broadcast_to(np.tril(np.ones((n, n), bool)), (kvh, n, n))


def tolerance(want, terms):
    """float32 against float64, as tests/sharding/test_sp_attention.py's `close` derives it: a reduction of n
    float32 terms errs about eps * sqrt(n) times the terms' magnitude (max |want|), up to four chained stages."""
    return 4 * EPS32 * np.sqrt(terms) * np.abs(want).max()


def inputs(seed, n, h, kvh):
    rng = np.random.default_rng(seed)
    return rand(rng, n, h, D), rand(rng, n, kvh, D), rand(rng, n, kvh, D), rng.random((n, kvh)).astype(np.float32)


@pytest.mark.parametrize("spans", [spans for spans, _ in LEVELS])
@pytest.mark.parametrize("h, kvh", HEADS)
@pytest.mark.parametrize("t", [1, 3, 8])
def test_drop_zero_is_dense_causal_attention(spans, h, kvh, t):
    n = spans[-1] * t
    q, k, v, imp = inputs([n, h, len(spans)], n, h, kvh)
    got = np.asarray(csa.csa_reference(q, k, v, imp, csa.Levels(spans, (0,) * len(spans))))
    want, _ = masked_dense(q, k, v, causal(n, kvh))
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance(want, n))


def brute_mask(imp, spans, drops, t):
    """The rules read off the paper, one (level, head, query, key) at a time: own partition causally at level 0;
    an earlier partition i at the first level whose segment holds both, if key is among i's keep top keys."""
    n, kvh = imp.shape
    keep = [int((1 - d) * t + 0.5) for d in drops]
    rank = np.empty((n, kvh), int)
    for i in range(0, n, t):
        for hd in range(kvh):
            rank[i + np.argsort(-imp[i : i + t, hd], kind="stable"), hd] = np.arange(t)
    mask = np.zeros((len(spans), kvh, n, n), bool)
    for qi in range(n):
        for ki in range(qi + 1):
            a, b = ki // t, qi // t
            lv = next(x for x, s in enumerate(spans) if a // s == b // s)
            mask[lv, :, qi, ki] = rank[ki] < keep[lv]
    return mask


@pytest.mark.parametrize("spans, drops", LEVELS)
@pytest.mark.parametrize("t", [1, 4, 7])
def test_level_masks_follow_the_rules_and_keep_the_configured_counts(spans, drops, t):
    n, kvh = spans[-1] * t, 3
    imp = np.random.default_rng([t, len(spans)]).random((n, kvh)).astype(np.float32)
    imp[:t, 0] = 0.5  # ties: broken by position, the same in mask and sharded path (stable sort / top_k)
    levels = csa.Levels(spans, drops)
    mask = np.asarray(csa.csa_mask(imp, levels))
    np.testing.assert_array_equal(mask, brute_mask(imp, spans, drops, t))
    assert not (mask.sum(axis=0) > 1).any()  # levels are disjoint key sets
    keep = levels.keep(t)
    assert all(abs(kp - (1 - d) * t) <= 0.5 for kp, d in zip(keep, drops))
    # the last query of partition j sees exactly keep[level] tokens of each earlier partition i, per head
    for j in range(spans[-1]):
        for i in range(j):
            lv = levels.level(i, j)
            seen = mask[lv, :, (j + 1) * t - 1, i * t : (i + 1) * t].sum(axis=-1)
            np.testing.assert_array_equal(seen, keep[lv])


def test_geometric_schedule_halves_what_each_farther_level_keeps():
    levels = csa.geometric((1, 2, 4, 8), 0.2)
    np.testing.assert_allclose([1 - d for d in levels.drops], [1, 0.8, 0.4, 0.2])
    assert levels.drops == csa_cost.geometric_drops(4, 0.2)
    assert levels.keep(100) == (100, 80, 40, 20)


@pytest.mark.parametrize("spans, drops", LEVELS[1:])
@pytest.mark.parametrize("h, kvh", HEADS)
def test_with_drops_it_is_softmax_over_the_kept_keys(spans, drops, h, kvh):
    """Eq. (5) over the disjoint levels equals one softmax over the union of their keys."""
    t = 6
    n = spans[-1] * t
    q, k, v, imp = inputs([n, h, 3], n, h, kvh)
    levels = csa.Levels(spans, drops)
    want, _ = masked_dense(q, k, v, np.asarray(csa.csa_mask(imp, levels)).any(axis=0))
    got = np.asarray(csa.csa_reference(q, k, v, imp, levels))
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance(want, n))


def test_error_from_dense_is_bounded_by_dropped_mass_and_vanishes_with_the_drops():
    """With delta the dense softmax mass on dropped keys, O_dense = (1 - delta) O_csa + delta O_dropped, so
    |O_dense - O_csa| <= delta * (max - min of the visible values), per query, head and feature. Shrinking every
    drop ratio keeps a superset of keys (top-k sets nest), so delta can only fall, to 0 at drop 0."""
    spans, base = (1, 2, 4, 8), csa.geometric((1, 2, 4, 8), 0.6).drops
    h, kvh, t = 6, 2, 8
    n = spans[-1] * t
    q, k, v, imp = inputs([5], n, h, kvh)
    dense, probs = masked_dense(q, k, v, causal(n, kvh))
    vis = np.repeat(causal(n, kvh), h // kvh, axis=0)[..., None]  # [h, q, k, 1]
    vv = np.repeat(np.asarray(v, np.float64), h // kvh, axis=1).transpose(1, 0, 2)[:, None]  # [h, 1, k, d]
    spread = (np.where(vis, vv, -np.inf).max(axis=2) - np.where(vis, vv, np.inf).min(axis=2)).transpose(1, 0, 2)
    last_delta = np.inf
    for scale in (1, 0.5, 0.25, 0.1, 0):
        levels = csa.Levels(spans, tuple(scale * d for d in base))
        kept = np.repeat(np.asarray(csa.csa_mask(imp, levels)).any(axis=0), h // kvh, axis=0)
        delta = np.where(kept, 0, probs).sum(axis=-1).T  # [q, h]
        err = np.abs(np.asarray(csa.csa_reference(q, k, v, imp, levels), np.float64) - dense)
        float_err = tolerance(dense, n)
        assert (err <= delta[..., None] * spread + float_err).all(), scale
        assert delta.max() <= last_delta
        last_delta = delta.max()
        if scale == 1:
            assert err.max() > 100 * float_err  # the drops do change the result
    assert last_delta == 0 and err.max() <= float_err


@pytest.mark.parametrize("spans, drops", LEVELS)
def test_received_tokens_are_exactly_the_kept_keys_from_other_partitions(spans, drops):
    """What a device must receive: the (key, KV head) pairs of other partitions its queries see."""
    t, kvh = 5, 3
    levels = csa.Levels(spans, drops)
    imp = np.random.default_rng(1).random((spans[-1] * t, kvh)).astype(np.float32)
    seen = np.asarray(csa.csa_mask(imp, levels)).any(axis=0)  # [kvh, q, k]
    for j, got in enumerate(csa.received_tokens(levels, t)):
        mine = slice(j * t, (j + 1) * t)
        needed = seen[:, mine].any(axis=1)  # [kvh, k]
        needed[:, mine] = False
        assert got * kvh == needed.sum()


@pytest.mark.parametrize("sp", [2, 4, 8])
@pytest.mark.parametrize("h, kvh", [(8, 8), (24, 8), (32, 8), (8, 1)])
def test_moves_fewer_bytes_than_sp_ntp(sp, h, kvh):
    """Under the geometric schedule at any level-2 drop (even 0: farther levels still thin out), CSA's K/V is
    fewer bytes than Ulysses' all-to-alls; more drop, fewer bytes; farther levels send fewer tokens per pair.
    With nothing dropped, CSA ships every earlier partition's K/V: all of the causal need."""
    t, dtype_bytes = 64, 2
    spans = tuple(2**i for i in range(sp.bit_length()))
    ulysses = comm.ulysses_bytes(comm.Shape(tokens=sp * t, devices=sp, heads=h, kv_heads=kvh, head_dim=D, hidden=0))
    moved = lambda levels: sum(csa.received_tokens(levels, t)) * 2 * kvh * D * dtype_bytes
    last = np.inf
    for drop in (0, 0.2, 0.5, 0.8):
        levels = csa.geometric(spans, drop)
        got = moved(levels)
        assert got < ulysses and got < last
        last = got
        assert got == pytest.approx(csa_cost.comm_fraction(spans, levels.drops, t, h, kvh) * ulysses, rel=1e-12)
        keep = levels.keep(t)  # tokens each pair at that level carries
        assert all(a >= b for a, b in zip(keep[1:], keep[2:]))
    nothing_dropped = csa.Levels(spans, (0,) * len(spans))
    assert moved(nothing_dropped) == sp * (sp - 1) // 2 * t * 2 * kvh * D * dtype_bytes


@pytest.mark.parametrize("spans, drops", LEVELS)
@pytest.mark.parametrize("t", [1, 5, 16])
def test_cost_model_fractions_match_the_masks(spans, drops, t):
    n, kvh = spans[-1] * t, 2
    levels = csa.Levels(spans, drops)
    imp = np.random.default_rng(t).random((n, kvh)).astype(np.float32)
    pairs = np.asarray(csa.csa_mask(imp, levels)).sum() / kvh
    assert csa_cost.attention_fraction(spans, drops, t) == pairs / (n * (n + 1) // 2)
    assert sum(csa_cost.kv_tokens_by_level(spans, drops, t)) == sum(csa.received_tokens(levels, t))
    assert levels.keep(t) == tuple(csa_cost.keep_count(d, t) for d in drops)


def test_importance_from_probs_sums_each_kv_heads_query_group():
    rng = np.random.default_rng(2)
    probs = rng.random((6, 5, 7))
    got = np.asarray(csa.importance_from_probs(probs, kv_heads=2))
    np.testing.assert_allclose(
        got, np.stack([probs[:3].sum(axis=(0, 1)), probs[3:].sum(axis=(0, 1))], axis=1), rtol=1e-6
    )
    # fed with a layer's own probabilities, the kept keys hold most of that layer's attention mass
    n, h, kvh = 32, 6, 2
    q, k, v, _ = inputs([9], n, h, kvh)
    q *= 3  # peaked attention, as in trained models
    _, p = masked_dense(q, k, v, causal(n, kvh))
    imp = np.asarray(csa.importance_from_probs(p.astype(np.float32), kvh))
    levels = csa.geometric((1, 2, 4), 0.5)
    mass = lambda scores: np.where(
        np.repeat(np.asarray(csa.csa_mask(scores, levels)).any(axis=0), 3, axis=0), p, 0
    ).sum()
    assert mass(imp) > mass(-imp)


@pytest.mark.parametrize(
    "spans, drops, match",
    [
        ((2, 4), (0, 0), "start at 1|starting at 1"),
        ((1, 3, 4), (0, 0, 0), "multiple"),
        ((1, 2), (0.1, 0), "level 1"),
        ((1, 2), (0, 1.5), r"\[0, 1\]"),
        ((1, 2), (0,), "one drop ratio"),
    ],
)
def test_bad_levels_are_rejected(spans, drops, match):
    with pytest.raises(ValueError, match=match):
        csa.Levels(spans, drops)
    with pytest.raises(ValueError, match=match):
        csa_cost.check(spans, drops)
