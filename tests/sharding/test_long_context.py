"""A request's context bounded by the KV-parallel sets it may spread over, not by one set's pool (Medha's KVP): one
engine of --kvp=K sets serves prompts longer than a set holds with the single-device engine's greedy tokens, each
set holding part of the request's KV; a prompt longer than every set together is refused with the numbers."""

from __future__ import annotations

import numpy as np
import pytest

import jaxserve
from jaxserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12)
PROMPT = 3500  # tokens: more than three of the four sets' 1,024


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(10, 512, PROMPT).tolist()


@pytest.fixture(scope="module")
def want(ids):
    one = jaxserve.LLM("random:tiny", kv_cache_tokens=4096, max_model_len=4096, progress=False)
    return one.generate([ids], GREEDY)[0].token_ids


def run_holding(llm, ids):
    """Generate on the engine directly; the request's block table while it decodes, and its tokens."""
    engine = llm.engine
    rid = engine.add_request(ids, GREEDY)
    tokens, table = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            if out.new_token_ids and table is None:
                table = engine.kv.block_table(rid)
    return table, tokens


@pytest.mark.parametrize("kvp_tokens", [None, 1024], ids=["spread", "progressive"])
def test_a_prompt_longer_than_one_set_spreads_over_the_sets(devices, ids, want, kvp_tokens):
    """LLM(kvp=4, kv_cache_tokens=1024, max_model_len=4096): a 3,500-token prompt gives one device's greedy tokens.
    Spread (the default), its blocks alternate sets; progressive (--kvp_tokens=1024), it fills three sets whole and
    part of the fourth, as Medha's workers join."""
    llm = jaxserve.LLM(
        "random:tiny", kvp=4, kv_cache_tokens=1024, max_model_len=4096, kvp_tokens=kvp_tokens, progress=False
    )
    assert llm.max_model_len == 4096
    table, tokens = run_holding(llm, ids)
    assert tokens == want
    per_set = np.bincount([b % 4 for b in table], minlength=4) * llm.engine.kv.block_size
    assert per_set.sum() >= PROMPT and per_set.max() <= 1024, per_set
    if kvp_tokens is None:
        assert per_set.min() >= per_set.max() - llm.engine.kv.block_size, per_set  # even shares
    else:
        assert sorted(per_set.tolist())[1:] == [1024] * 3, per_set  # three full sets, the rest on one more


def test_a_prompt_longer_than_every_set_is_refused_with_the_numbers(devices):
    llm = jaxserve.LLM("random:tiny", kvp=4, kv_cache_tokens=512, max_model_len=4096, progress=False)
    assert llm.max_model_len == 2048  # what the four sets hold, not the 4,096 asked
    with pytest.raises(ValueError, match=r"2500 tokens; the context holds 2048 .*4 KV-parallel sets of 512 tokens"):
        llm.generate([[1] * 2500], GREEDY)
