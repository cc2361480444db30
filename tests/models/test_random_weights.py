"""Random-weight models (`random:<shape>`): what tools/bench/generate.py --gpu serves without a download."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve import SamplingParams
from jaxserve.models import random_weights


def test_random_weights_are_seeded_and_shaped_like_the_named_model():
    cfg, params, tok = random_weights.load("random:tiny", jnp.bfloat16)
    _, again, _ = random_weights.load("random:tiny", jnp.bfloat16)  # every process draws the same weights
    q = np.asarray(params["params"]["layers"]["self_attn"]["q_proj"]["kernel"], np.float32)
    assert q.shape == (cfg.num_layers, cfg.hidden_size, cfg.num_heads * cfg.head_dim)
    assert params["params"]["layers"]["self_attn"]["q_proj"]["kernel"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(q, np.asarray(again["params"]["layers"]["self_attn"]["q_proj"]["kernel"], np.float32))
    assert abs(q.std() - random_weights.STD) < 0.1 * random_weights.STD and abs(q.mean()) < 0.1 * random_weights.STD
    assert (np.asarray(params["params"]["norm"]["weight"], np.float32) == 1).all()
    assert tok.encode("<3> <511>") == [3, 511] and tok.decode([7, 8]) == "<7> <8>"
    assert random_weights.config("random:llama3-8b").num_kv_heads == 8
    with pytest.raises(ValueError, match="unknown random model 'random:nope'"):
        random_weights.config("random:nope")


def test_llm_serves_a_random_model_from_token_ids():
    llm = jaxserve.LLM("random:tiny", max_model_len=256, kv_cache_tokens=2048, progress=False)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first, second = llm.generate([[5, 6, 7], [300, 2, 9, 9]], params)
    assert len(first.token_ids) == 6 and len(second.token_ids) == 6
    assert first.text == " " + " ".join(f"<{i}>" for i in first.token_ids) or first.text.split() == [
        f"<{i}>" for i in first.token_ids
    ]
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == first.token_ids  # greedy: the same again


def test_auto_dtype_is_float32_on_a_cpu_and_bfloat16_elsewhere(monkeypatch):
    import types

    import jax

    from jaxserve.models import loader

    assert loader.resolve_dtype("bfloat16") == "bfloat16" and loader.resolve_dtype("float32") == "float32"
    assert loader.resolve_dtype("auto") == "float32"  # this machine: CPU devices
    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(platform="gpu")])
    assert loader.resolve_dtype("auto") == "bfloat16"
