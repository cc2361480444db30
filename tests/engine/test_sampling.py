"""The batched sampler on random logits: greedy, top-k, top-p, temperature and per-row seeds."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.sampling import inverse_cdf, sample
from jaxserve.sampling_params import SamplingParams

V = 64


def draw(logits, temperature=1.0, top_k=0, top_p=1.0, n=2000, seed=0):
    b = n
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (b, V))
    return np.asarray(sample(rows, jnp.full((b,), temperature, jnp.float32), jnp.full((b,), top_k, jnp.int32),
                             jnp.full((b,), top_p, jnp.float32), jnp.full((b,), seed, jnp.uint32),
                             jnp.arange(b, dtype=jnp.int32), cut=top_k > 0 or top_p < 1.0))


@pytest.fixture
def logits():
    return np.random.default_rng(0).standard_normal(V) * 2


def test_greedy_rows_take_the_argmax(logits):
    assert (draw(logits, temperature=0.0, n=8) == logits.argmax()).all()
    rows = jnp.asarray(np.random.default_rng(1).standard_normal((5, V)), jnp.float32)
    zeros = jnp.zeros((5,), jnp.float32)
    got = sample(rows, zeros, jnp.zeros(5, jnp.int32), jnp.ones(5), jnp.zeros(5, jnp.uint32),
                 jnp.zeros(5, jnp.int32), cut=False)
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
def test_the_two_level_running_sum_finds_the_flat_ones_token(vocab):
    """inverse_cdf against a flat running sum. Integer weights keep every float32 sum exact, so the two agree
    token for token; zeros (leading, and whole blocks of them) are never drawn."""
    rng = np.random.default_rng(vocab)
    weights = rng.integers(0, 50, (6, vocab)).astype(np.float32)
    weights[:, :3] = 0
    weights[1, : vocab // 2] = 0
    weights[2] = 0
    weights[2, -1] = 5  # all the mass on the last token
    u = rng.uniform(2.0**-24, 1, 6).astype(np.float32)
    u[3] = 2.0**-24
    u[4] = 1 - 2.0**-24
    got = np.asarray(inverse_cdf(jnp.asarray(weights), jnp.asarray(u)))
    flat = np.cumsum(weights, axis=-1)
    want = np.minimum(np.sum(flat < (u * flat[:, -1])[:, None], axis=-1), vocab - 1)
    np.testing.assert_array_equal(got, want)
    assert (weights[np.arange(6), got] > 0).all()


def test_seed_and_counter_determine_the_draw(logits):
    a, b, c = draw(logits, seed=7, n=50), draw(logits, seed=7, n=50), draw(logits, seed=8, n=50)
    assert (a == b).all() and (a != c).any()


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(max_tokens=-3), dict(max_tokens=2.5),
                                    dict(temperature=-0.1), dict(top_k=-2), dict(top_p=0), dict(top_p=1.01),
                                    dict(seed=-1), dict(stop=("",)), dict(stop_token_ids=(-2,)),
                                    # hostile input: each once passed and hurt the batch or the engine thread
                                    dict(top_k=2**31), dict(temperature=float("inf")), dict(temperature=float("nan")),
                                    dict(top_p=float("nan")), dict(max_tokens=True), dict(temperature=True),
                                    dict(top_k=True), dict(seed=False), dict(stop_token_ids=(True,)),
                                    dict(stop=("x" * 1025,)), dict(stop=tuple("x" * (i + 1) for i in range(65))),
                                    dict(stop_token_ids=tuple(range(1025)))])
def test_invalid_sampling_params_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_vllm_spellings_are_normalised():
    sp = SamplingParams(top_k=-1, stop=None, stop_token_ids=None, temperature=1e-7)
    assert (sp.top_k, sp.stop, sp.stop_token_ids, sp.temperature, sp.greedy) == (0, (), (), 0.0, True)
    assert SamplingParams(stop="END", stop_token_ids=[5]).stop == ("END",)
