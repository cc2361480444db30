"""The batched sampler on random logits: greedy, top-k, top-p, min-p, temperature and per-row seeds; penalties,
logit_bias, min_tokens and logprobs against numpy references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.sampling import (
    BLOCK,
    MAX_LOGPROBS,
    Sampling,
    Slots,
    adjust,
    argmax,
    gumbel_max,
    logprobs_of,
    sample,
    sample_step,
)
from jaxserve.sampling_params import SamplingParams

V = 64


def draw(logits, temperature=1.0, top_k=0, top_p=1.0, n=2000, seed=0):
    b = n
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (b, V))
    return np.asarray(
        sample(
            rows,
            jnp.full((b,), temperature, jnp.float32),
            jnp.full((b,), top_k, jnp.int32),
            jnp.full((b,), top_p, jnp.float32),
            jnp.full((b,), seed, jnp.uint32),
            jnp.arange(b, dtype=jnp.int32),
            cut=top_k > 0 or top_p < 1.0,
        )
    )


@pytest.fixture
def logits():
    return np.random.default_rng(0).standard_normal(V) * 2


def test_greedy_rows_take_the_argmax(logits):
    assert (draw(logits, temperature=0.0, n=8) == logits.argmax()).all()
    rows = jnp.asarray(np.random.default_rng(1).standard_normal((5, V)), jnp.float32)
    zeros = jnp.zeros((5,), jnp.float32)
    got = sample(
        rows, zeros, jnp.zeros(5, jnp.int32), jnp.ones(5), jnp.zeros(5, jnp.uint32), jnp.zeros(5, jnp.int32), cut=False
    )
    assert (np.asarray(got) == np.asarray(rows).argmax(-1)).all()


def test_top_k_draws_only_the_k_best(logits):
    got = draw(logits, top_k=5)
    assert set(got) <= set(np.argsort(-logits)[:5]) and len(set(got)) == 5


def test_top_p_draws_only_the_nucleus(logits):
    p = np.exp(logits - logits.max())
    p /= p.sum()
    order = np.argsort(-p)
    nucleus = order[: np.searchsorted(np.cumsum(p[order]), 0.6) + 1]
    got = draw(logits, top_p=0.6)
    assert set(got) == set(nucleus)


def test_temperature_one_follows_the_softmax(logits):
    p = np.exp(logits - logits.max())
    p /= p.sum()
    got = draw(logits, n=20000)
    freq = np.bincount(got, minlength=V) / len(got)
    assert np.abs(freq - p).max() < 0.02


def test_the_program_the_host_picks_does_not_change_a_draw():
    # rows that cut nothing draw the same token in the cutting program as in the plain one, beside rows that cut
    rng = np.random.default_rng(3)
    b = 64
    rows = jnp.asarray(rng.standard_normal((b, V)) * 3, jnp.float32)
    temperature = jnp.asarray(rng.choice([0.0, 0.7, 1.3], b), jnp.float32)
    cutting = np.arange(b) % 2 == 0
    top_k = jnp.asarray(np.where(cutting, 5, 0), jnp.int32)
    top_p = jnp.asarray(np.where(cutting, 0.8, 1.0), jnp.float32)
    seeds, counters = jnp.asarray(rng.integers(0, 2**32, b), jnp.uint32), jnp.arange(b, dtype=jnp.int32)
    plain = np.asarray(sample(rows, temperature, jnp.zeros(b, jnp.int32), jnp.ones(b), seeds, counters, cut=False))
    both = np.asarray(sample(rows, temperature, top_k, top_p, seeds, counters, cut=True))
    np.testing.assert_array_equal(both[~cutting], plain[~cutting])
    assert (both[cutting] != plain[cutting]).any()


@pytest.mark.parametrize("vocab", [7, 256, 1000, 49152])
def test_the_two_level_argmax_is_numpys(vocab):
    """The first of equal maxima, the first NaN, and rows all -inf, as numpy's argmax, at vocabularies that do and
    do not fill the last block."""
    rng = np.random.default_rng(vocab)
    rows = rng.standard_normal((6, vocab)).astype(np.float32)
    rows[1] = np.round(rows[1])  # many ties at the top
    rows[2, vocab // 2 :] = rows[2].max() + 1  # a tie across blocks
    rows[3, vocab // 3] = np.nan
    rows[4] = -np.inf
    rows[5, -1] = 100.0  # the best in the padded block
    np.testing.assert_array_equal(np.asarray(argmax(jnp.asarray(rows))), rows.argmax(-1))


@pytest.mark.parametrize("vocab", [7, 256, 1000])
def test_the_two_level_gumbel_draw_follows_the_softmax_and_never_draws_minus_inf(vocab):
    """Token frequencies over 20,000 draws equal the softmax's (5 standard errors of the largest), with the mass
    spread over every block and the last one partly padding; -inf tokens (leading, a whole block) never come."""
    n = 20000
    logits = np.random.default_rng(vocab).standard_normal(vocab).astype(np.float32) * 2
    logits[:3] = -np.inf
    logits[BLOCK : 2 * BLOCK] = -np.inf
    p = np.exp(logits - logits.max())
    p /= p.sum()
    keys = jax.vmap(lambda c: jax.random.fold_in(jax.random.key(5), c))(jnp.arange(n))
    got = np.asarray(gumbel_max(jnp.broadcast_to(jnp.asarray(logits), (n, vocab)), keys))
    assert np.isfinite(logits[got]).all()
    freq = np.bincount(got, minlength=vocab) / n
    assert np.abs(freq - p).max() < 5 * np.sqrt(p.max() / n)


def test_logits_that_differ_in_their_last_bits_rarely_move_a_draw():
    """What another batch shape does to a row's logits (a relative 1e-5, ~1e-4 here): 4,000 draws of a
    49,152-token row with a long tail (20 likely tokens). A running sum's inverse CDF moved 176 of them; the
    Gumbel draw moves one when the two best noisy scores are that close, about 1 in 4,000."""
    n, vocab = 4000, 49152
    rng = np.random.default_rng(1)
    row = rng.standard_normal(vocab).astype(np.float32) * 2.5
    row[:20] += 8
    rows = jnp.broadcast_to(jnp.asarray(row), (n, vocab))
    nudged = rows * (1 + 1e-5 * jnp.asarray(rng.standard_normal((n, vocab)), jnp.float32))
    args = jnp.full((n,), 0.8), jnp.zeros(n, jnp.int32), jnp.ones(n), jnp.zeros(n, jnp.uint32), jnp.arange(n)
    a, b = (np.asarray(sample(x, *args, cut=False)) for x in (rows, nudged))
    assert len(set(a)) > 500  # the draws reach far into the tail
    assert (a != b).sum() <= 20


def test_seed_and_counter_determine_the_draw(logits):
    a, b, c = draw(logits, seed=7, n=50), draw(logits, seed=7, n=50), draw(logits, seed=8, n=50)
    assert (a == b).all() and (a != c).any()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=0),
        dict(max_tokens=-3),
        dict(max_tokens=2.5),
        dict(temperature=-0.1),
        dict(top_k=-2),
        dict(top_p=0),
        dict(top_p=1.01),
        dict(seed=2**63),
        dict(seed=-(2**63) - 1),
        dict(seed=1.5),
        dict(stop=("",)),
        dict(stop_token_ids=(-2,)),
        # hostile input: each once passed and hurt the batch or the engine thread
        dict(top_k=2**31),
        dict(temperature=float("inf")),
        dict(temperature=float("nan")),
        dict(top_p=float("nan")),
        dict(max_tokens=True),
        dict(temperature=True),
        dict(top_k=True),
        dict(seed=False),
        dict(stop_token_ids=(True,)),
        dict(stop=("x" * 1025,)),
        dict(stop=tuple("x" * (i + 1) for i in range(65))),
        dict(stop_token_ids=tuple(range(1025))),
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-2.1),
        dict(repetition_penalty=0),
        dict(repetition_penalty=float("inf")),
        dict(min_p=-0.1),
        dict(min_p=1.5),
        dict(logit_bias={1: 101}),
        dict(logit_bias={"1": 1.0}),
        dict(logit_bias={-1: 1.0}),
        dict(logit_bias=[(1, 1), (1, 2)]),
        dict(logit_bias=5),
        dict(min_tokens=-1),
        dict(max_tokens=4, min_tokens=5),
        dict(logprobs=-1),
        dict(logprobs=21),
        dict(logprobs=True),
    ],
)
def test_invalid_sampling_params_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_vllm_spellings_are_normalised():
    sp = SamplingParams(top_k=-1, stop=None, stop_token_ids=None, temperature=1e-7)
    assert (sp.top_k, sp.stop, sp.stop_token_ids, sp.temperature, sp.greedy) == (0, (), (), 0.0, True)
    assert SamplingParams(stop="END", stop_token_ids=[5]).stop == ("END",)


def test_logit_bias_accepts_a_dict_or_pairs():
    assert (
        SamplingParams(logit_bias={5: 1.0, 2: -3}).logit_bias
        == SamplingParams(logit_bias=[[5, 1.0], [2, -3]]).logit_bias
    )
    assert not SamplingParams().uses_history and SamplingParams(min_tokens=1).uses_history


def _rows(rng, r, v, slot):
    """Random per-row parameters: presence, frequency, repetition penalties, min_tokens and counters."""
    return Sampling(
        temperature=jnp.zeros(r),
        top_k=jnp.zeros(r, jnp.int32),
        top_p=jnp.ones(r),
        seeds=jnp.zeros(r, jnp.uint32),
        counters=jnp.asarray(rng.integers(0, 6, r), jnp.int32),
        min_p=jnp.zeros(r),
        slot=jnp.asarray(slot, jnp.int32),
        presence=jnp.asarray(rng.uniform(-2, 2, r), jnp.float32),
        frequency=jnp.asarray(rng.uniform(-2, 2, r), jnp.float32),
        repetition=jnp.asarray(rng.uniform(0.5, 2.0, r), jnp.float32),
        min_tokens=jnp.asarray(rng.integers(0, 6, r), jnp.int32),
    )


def _slots(rng, s, v):
    return Slots(
        counts=jnp.asarray(rng.integers(0, 3, (s, v)) * (rng.random((s, v)) < 0.3), jnp.int32),
        prompt=jnp.asarray(rng.random((s, v)) < 0.2),
        bias=jnp.asarray(np.where(rng.random((s, v)) < 0.1, rng.uniform(-100, 100, (s, v)), 0), jnp.float32),
        banned=jnp.asarray(rng.random((s, v)) < 0.05),
    )


def _adjust_reference(logits, p, slots):
    """vLLM's penalties, row by row in float64 numpy."""
    logits, out = np.asarray(logits, np.float64), []
    for i, x in enumerate(logits):
        s = int(p.slot[i])
        if s < 0:
            out.append(x)
            continue
        counts = np.asarray(slots.counts[s], np.float64)
        x = x + np.asarray(slots.bias[s])
        if p.counters[i] < p.min_tokens[i]:
            x = np.where(np.asarray(slots.banned[s]), -np.inf, x)
        rep = float(p.repetition[i])
        seen = np.asarray(slots.prompt[s]) | (counts > 0)
        x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
        x = x - float(p.frequency[i]) * counts - float(p.presence[i]) * (counts > 0)
        out.append(x)
    return np.stack(out)


@pytest.mark.parametrize("r,v", [(1, 64), (5, 257), (16, 4096)])
def test_penalties_bias_and_min_tokens_match_numpy(r, v):
    rng = np.random.default_rng(v)
    logits = jnp.asarray(rng.standard_normal((r, v)) * 4, jnp.float32)
    slot = rng.permutation(8)[:r] if r <= 8 else np.where(np.arange(r) % 3 == 0, -1, np.arange(r) % 8)
    if r > 1:
        slot[0] = -1  # a row without a slot passes unchanged
    slots = _slots(rng, 8, v)
    p = _rows(rng, r, v, slot)
    got = np.asarray(adjust(logits, p, slots), np.float64)
    want = _adjust_reference(logits, p, slots)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    # a few float32 roundings of the largest intermediate: (|logit| + |bias|) / 0.5 (the smallest repetition),
    # then 2 x the largest count and 2 for the frequency and presence penalties
    scale = (np.abs(logits).max() + np.abs(slots.bias).max()) / 0.5 + 2 * int(slots.counts.max()) + 2
    np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=4 * np.finfo(np.float32).eps * scale)


def test_min_tokens_holds_back_the_banned_tokens_until_counted():
    v = 32
    slots = Slots(
        jnp.zeros((1, v), jnp.int32),
        jnp.zeros((1, v), bool),
        jnp.zeros((1, v)),
        jnp.zeros((1, v), bool).at[0, 7].set(True),
    )
    logits = jnp.zeros((2, v)).at[:, 7].set(10.0)
    p = _rows(np.random.default_rng(0), 2, v, [0, 0])._replace(
        counters=jnp.asarray([2, 3]),
        min_tokens=jnp.asarray([3, 3]),
        presence=jnp.zeros(2),
        frequency=jnp.zeros(2),
        repetition=jnp.ones(2),
    )
    tokens, _, _ = sample_step(logits, p, slots, kind="greedy")
    assert int(tokens[0]) != 7 and int(tokens[1]) == 7  # the 3rd token may not be EOS; the 4th may


def test_the_extra_sampler_counts_kept_tokens_into_their_slots():
    rng = np.random.default_rng(1)
    v, r = 50, 4
    slots = _slots(rng, 6, v)
    logits = jnp.asarray(rng.standard_normal((r, v)), jnp.float32)
    slot = np.array([3, -1, 0, 5])
    p = _rows(rng, r, v, slot)
    tokens, new, _ = sample_step(logits, p, slots, kind="greedy")
    want = np.asarray(slots.counts).copy()
    for s, t in zip(slot, np.asarray(tokens)):
        if s >= 0:
            want[s, t] += 1
    np.testing.assert_array_equal(np.asarray(new.counts), want)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(adjust(logits, p, slots)).argmax(-1))


def test_logprobs_are_the_log_softmax_and_its_top():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((3, 300)) * 5
    tokens = np.array([0, 17, 299])
    got = logprobs_of(jnp.asarray(logits, jnp.float32), jnp.asarray(tokens))
    x = logits - logits.max(-1, keepdims=True)
    want = x - np.log(np.exp(x).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(got.chosen), want[np.arange(3), tokens], atol=1e-5)
    order = np.argsort(-want, axis=-1)[:, :MAX_LOGPROBS]
    np.testing.assert_array_equal(np.asarray(got.top_ids), order)
    np.testing.assert_allclose(np.asarray(got.top), np.take_along_axis(want, order, -1), atol=1e-5)


def test_min_p_draws_only_tokens_within_its_ratio_of_the_best(logits):
    b = 2000
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (b, V))
    got = np.asarray(
        sample(
            rows,
            jnp.full((b,), 1.0),
            jnp.zeros(b, jnp.int32),
            jnp.ones(b),
            jnp.zeros(b, jnp.uint32),
            jnp.arange(b, dtype=jnp.int32),
            cut=False,
            min_p=jnp.full((b,), 0.2),
        )
    )
    p = np.exp(logits - logits.max())
    assert set(got) == set(np.flatnonzero(p >= 0.2))
