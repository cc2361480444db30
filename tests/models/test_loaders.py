"""Loaders: GGUF vs Hugging Face directory, orbax restore on the second start, bfloat16, rope scaling, registry."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import jaxserve
from jaxserve import SamplingParams
from jaxserve.models import quantize, registry
from jaxserve.models.config import LlamaConfig

PROMPT = "The quick brown fox jumps over the lazy dog. Then it ran into the forest"


def _rows(w, kernel: bool = False) -> np.ndarray:
    """A weight as Hugging Face stores it ([out, in]; a table [vocab, e]): ggml's F32 rows are that already
    (quantize.float_rows), a float kernel [in, out] transposed."""
    if isinstance(w, quantize.GGMLBlocks):
        return np.asarray(w.raw)
    return np.asarray(w).T if kernel else np.asarray(w)


def export_hf_dir(llm: jaxserve.LLM, root: pathlib.Path, tied: bool) -> None:
    """Write llm's weights, config and tokenizer as a Hugging Face Llama directory (untied: lm_head copied)."""
    cfg = llm.config
    params = llm.engine.runner.params["params"]
    tensors = {
        "model.embed_tokens.weight": _rows(params["embed_tokens"]["embedding"]),
        "model.norm.weight": params["norm"]["weight"],
    }
    for i in range(cfg.num_layers):
        layer = params[f"layers_{i}"]  # the runner holds each layer's parameters apart (models/llama.py)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = layer[norm]["weight"]
        for block in ("self_attn", "mlp"):
            for name, lin in layer[block].items():
                tensors[f"model.layers.{i}.{block}.{name}.weight"] = _rows(lin["kernel"], kernel=True)
    if not tied:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    save_file(
        {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in tensors.items()},
        str(root / "model.safetensors"),
    )
    (root / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.hidden_size,
                "intermediate_size": cfg.intermediate_size,
                "num_hidden_layers": cfg.num_layers,
                "num_attention_heads": cfg.num_heads,
                "num_key_value_heads": cfg.num_kv_heads,
                "max_position_embeddings": cfg.max_position_embeddings,
                "rms_norm_eps": cfg.rms_norm_eps,
                "rope_theta": cfg.rope_theta,
                "tie_word_embeddings": tied,
            }
        )
    )
    llm.tokenizer.tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(
        json.dumps(
            {"eos_token": llm.tokenizer.special_tokens["eos_token"], "chat_template": llm.tokenizer.chat_template}
        )
    )


@pytest.fixture(scope="module")
def gguf_path():
    return registry.resolve(registry.DEFAULT_MODEL)  # resolved before a test swaps in a private cache


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_hf_directory_gives_the_gguf_model(llm, tmp_path, private_cache, tied):
    root = tmp_path / "hf"
    root.mkdir()
    export_hf_dir(llm, root, tied)
    hf = jaxserve.LLM(str(root), max_model_len=256, kv_cache_tokens=512)
    assert hf.config.tie_word_embeddings == tied
    assert ("lm_head" in hf.engine.runner.params["params"]) != tied
    assert dataclasses.replace(hf.config, tie_word_embeddings=True) == llm.config
    assert hf.tokenizer.encode(PROMPT) == llm.tokenizer.encode(PROMPT)
    msgs = [{"role": "user", "content": "Hi there"}]
    assert hf.render_chat(msgs) == llm.render_chat(msgs)
    # Untied logits come from a Dense matmul instead of Embed.attend: float32 rounding differs slightly.
    np.testing.assert_allclose(hf.prompt_logits(PROMPT), llm.prompt_logits(PROMPT), atol=1e-4, rtol=0)


def test_second_start_restores_converted_weights(llm, gguf_path, private_cache, monkeypatch):
    path = gguf_path
    first = jaxserve.LLM(str(path), max_model_len=128, kv_cache_tokens=256)
    assert list(private_cache.glob("converted/*/params"))

    def no_conversion(*args, **kwargs):
        raise AssertionError("the second start must not read the GGUF file again")

    monkeypatch.setattr("jaxserve.models.gguf_loader.load_gguf", no_conversion)
    second = jaxserve.LLM(str(path), max_model_len=128, kv_cache_tokens=256)
    assert second.config == first.config
    np.testing.assert_array_equal(second.prompt_logits(PROMPT), first.prompt_logits(PROMPT))
    assert second.tokenizer.encode(PROMPT) == llm.tokenizer.encode(PROMPT)


def test_bfloat16_tracks_float32(llm, reference):
    bf16 = jaxserve.LLM(dtype="bfloat16", max_model_len=256, kv_cache_tokens=512)
    # a CPU keeps the cache in float32: XLA's CPU converts a bfloat16 cache whole at each write (seconds a step)
    assert bf16.engine.runner.caches[0].dtype == jnp.float32
    ids = reference["prefill"][2]["ids"][:200]  # part of the long prompt
    ref = llm.prompt_logits(ids)
    got = bf16.prompt_logits(ids)
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.9
    assert np.abs(got - ref).mean() < 0.2
    assert bf16.generate("The capital of France is", SamplingParams(max_tokens=4))[0].text.strip().startswith("Paris")


def test_llama3_rope_scaling_matches_reference(reference):
    case = reference["llama3_rope"]
    cfg = LlamaConfig.from_hf({**case["config"], "vocab_size": 8, "intermediate_size": 8, "num_hidden_layers": 1})
    np.testing.assert_allclose(cfg.inv_freq(), case["inv_freq"], rtol=1e-6)


def test_llama_cpp_rope_freq_factors_equal_llama3_scaling(reference):
    case = reference["llama3_rope"]
    scaled = LlamaConfig.from_hf({**case["config"], "vocab_size": 8, "intermediate_size": 8, "num_hidden_layers": 1})
    plain = dataclasses.replace(scaled, rope_scaling=None)
    # llama.cpp's GGUF converter stores the scaling as divisors of the unscaled frequencies.
    factors = tuple(float(x) for x in plain.inv_freq().astype(np.float64) / np.asarray(case["inv_freq"]))
    np.testing.assert_allclose(
        dataclasses.replace(plain, rope_freq_factors=factors).inv_freq(), case["inv_freq"], rtol=1e-6
    )


def test_registry_resolution(tmp_path, private_cache, monkeypatch):
    monkeypatch.setattr(registry, "_installed_resource", lambda m: None)
    with pytest.raises(registry.ModelNotFoundError, match="fetch it once"):
        registry.resolve(registry.DEFAULT_MODEL)  # registered, but not in this (empty) cache
    with pytest.raises(registry.ModelNotFoundError, match="unknown model"):
        registry.resolve(str(tmp_path))  # a directory without config.json
    with pytest.raises(registry.ModelNotFoundError, match="unknown model"):
        registry.fetch_model("not-a-model")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert registry.resolve(str(gguf)) == gguf
