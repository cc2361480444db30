"""--kv_cache_dtype: the pool holds 2x (bfloat16) and 4x (fp8) the float32 tokens in the same memory, the cache
arrays take the dtype, the real model still answers, and fp8 saturates where a plain cast gives NaN."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve.sampling_params import SamplingParams
from jaxserve.sharding.rows import as_cache

# prompts whose first tokens are far from a tie: a cache's rounding does not move them
CONFIDENT = {"The capital of France is": " Paris", "1, 2, 3, 4,": " 5"}


@pytest.mark.parametrize("kv,factor", [("bfloat16", 2), ("fp8", 4)])
def test_a_narrow_cache_holds_more_tokens_and_still_answers(llm, kv, factor):
    settings = dict(kv_cache_gib=0.01, max_model_len=1024, progress=False)
    full = jaxserve.LLM(**settings)
    narrow = jaxserve.LLM(kv_cache_dtype=kv, **settings)
    assert narrow.builder.kv_tokens == pytest.approx(factor * full.builder.kv_tokens, abs=factor)
    assert narrow.engine.runner.caches[0].dtype == jnp.dtype(jnp.float8_e4m3fn if kv == "fp8" else kv)
    outs = narrow.generate(list(CONFIDENT), SamplingParams(max_tokens=4))
    assert [o.text.startswith(want) for o, want in zip(outs, CONFIDENT.values())] == [True] * len(CONFIDENT)


def test_fp8_saturates_instead_of_nan():
    x = jnp.asarray([1000.0, -700.0, 3.3, 1e-4], jnp.float32)
    got = np.asarray(as_cache(x, jnp.float8_e4m3fn).astype(jnp.float32))
    np.testing.assert_array_equal(got[:2], [448.0, -448.0])
    assert np.isfinite(got).all() and abs(got[2] - 3.3) < 0.2


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        jaxserve.LLM(kv_cache_dtype="int3", progress=False)
