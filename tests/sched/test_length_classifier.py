"""The prompt-reading decode-length classifier: it learns online what the running mean cannot, answers as the
running mean until warm, and its saved state is checked when read."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.sched.decode_dispatch import ObservedLengths, PromptInfo, accuracy
from jaxserve.sched.length_classifier import PromptClassifier

DIM = 24


def _trace(n: int, seed: int) -> tuple[list[PromptInfo], list[int]]:
    """Three kinds of prompt, each a noisy point around its own centre, answered with its own length range;
    prompt lengths drawn independently of the kind (a length band alone tells nothing)."""
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(99).normal(size=(3, DIM))
    spans = [(5, 150), (250, 390), (650, 780)]
    prompts, outputs = [], []
    for _ in range(n):
        kind = int(rng.integers(3))
        features = centres[kind] + 0.8 * rng.normal(size=DIM)
        prompts.append(PromptInfo(int(rng.integers(10, 2000)), features.astype(np.float32)))
        outputs.append(int(rng.integers(*spans[kind])))
    return prompts, outputs


def _taught(prompts, outputs, **kwargs) -> PromptClassifier:
    c = PromptClassifier(DIM, **kwargs)
    for p, o in zip(prompts, outputs):
        c.observe(p, o)
    return c


def test_it_learns_online_what_the_running_mean_cannot():
    train, held = _trace(400, 0), _trace(300, 1)
    c = _taught(*train)
    mean = ObservedLengths(granularity=200)
    for p, o in zip(*train):
        mean.observe(p, o)
    ours, theirs = accuracy(c, *held), accuracy(mean, *held)
    # each kind's lengths sit inside one 200-token bucket; the mean is one bucket for all three
    assert ours > 0.9 and theirs < 0.5
    lo, hi = c.predict(held[0][0])
    assert hi - lo == 200 and lo % 200 == 0


def test_until_warm_and_without_features_it_answers_as_the_running_mean():
    (prompts, outputs) = _trace(40, 2)
    c = PromptClassifier(DIM, warm=32)
    mean = ObservedLengths(granularity=200)
    for k, (p, o) in enumerate(zip(prompts, outputs)):
        if k < 32:
            assert c.predict(p) == mean.predict(p)
        c.observe(p, o)
        mean.observe(p, o)
    assert c.predict(PromptInfo(100)) == mean.predict(PromptInfo(100))  # no features (ESP's one estimate)
    with pytest.raises(ValueError, match="24 finite numbers"):
        c.observe(PromptInfo(10, np.full(DIM, np.nan)), 5)
    with pytest.raises(ValueError, match="24 finite numbers"):
        c.predict(PromptInfo(10, np.zeros(DIM + 1)))


def test_a_long_decode_counts_in_the_last_open_ended_bucket():
    rng = np.random.default_rng(3)
    c = PromptClassifier(DIM, buckets=4, warm=0)
    for _ in range(50):
        c.observe(PromptInfo(100, rng.normal(size=DIM)), 5000)
    assert c.predict(PromptInfo(100, rng.normal(size=DIM))) == (600, 800)


def test_its_state_round_trips_and_a_bad_one_is_refused_by_name():
    train, held = _trace(200, 4), _trace(50, 5)
    c = _taught(*train)
    again = PromptClassifier.from_json(c.to_json(), DIM)
    assert [again.predict(p) for p in held[0]] == [c.predict(p) for p in held[0]]
    for p, o in zip(*held):  # and it goes on learning the same way
        c.observe(p, o)
        again.observe(p, o)
    assert np.array_equal(again.weights, c.weights)
    with pytest.raises(ValueError, match="reads 24 features; this model gives 8"):
        PromptClassifier.from_json(c.to_json(), 8)
    state = json.loads(c.to_json())
    state["weights"][0][0] = float("nan")
    with pytest.raises(ValueError, match="weights"):
        PromptClassifier.from_json(json.dumps(state), DIM)
    state = json.loads(c.to_json())
    state["mean"] = state["mean"][:-1]
    with pytest.raises(ValueError, match="mean"):
        PromptClassifier.from_json(json.dumps(state), DIM)
    state = json.loads(c.to_json())
    state["seen"] = state["observed"][1] + 1
    with pytest.raises(ValueError, match="counts"):
        PromptClassifier.from_json(json.dumps(state), DIM)
    with pytest.raises(ValueError, match="buckets >= 2"):
        PromptClassifier(DIM, buckets=1)
