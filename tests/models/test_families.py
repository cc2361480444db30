"""Model families beside Llama, each a tiny model of random weights (tests/tiny_models.py: the same from its seed
on any machine) loaded from a Hugging Face folder and from a GGUF written with the `gguf` package. jaxserve's
logprobs and greedy tokens equal transformers' (float32, 1e-4) and its chat template renders 10 conversations byte
for byte as transformers does; transformers' side is recorded in tests/fixtures/families_reference.json by
tools/fixtures/families.py."""

from __future__ import annotations

import json
import math
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
import jaxserve.models.hf_loader
from jaxserve import SamplingParams
from jaxserve.models.config import LlamaConfig
from jaxserve.models.gguf_loader import GGUFFile
from jaxserve.models.tokenizer import TextTokenizer
from tiny_models import (
    CONVERSATIONS,
    DYNAMIC,
    DYNAMIC_POSITIONS,
    FAMILIES,
    PHI3_CONTEXT,
    PHI3_LONG_POSITIONS,
    PHI3_ORIGINAL,
    PROMPT,
    WINDOW,
    YARN,
    YARN_CONFIGS,
    YARN_FACTOR,
    YARN_ORIGINAL,
    as_image_text,
    gguf_tensors,
    phi3_rope_tensors,
    smollm2_tokenizer,
    write_gguf,
    write_tiny_model,
)

FIXTURE = pathlib.Path(__file__).parents[1] / "fixtures" / "families_reference.json"
TOL = 1e-4  # float32 logprobs of magnitude ~10 through two implementations
TIE = 1e-3  # two greedy candidates closer than this may swap between implementations
SHAPE = {
    "embedding_length": 64,
    "feed_forward_length": 128,
    "block_count": 2,
    "attention.head_count": 4,
    "attention.head_count_kv": 2,
}
# family -> (its GGUF architecture, the metadata llama.cpp's converter writes for it)
GGUF = {
    "qwen2": (
        "qwen2",
        {**SHAPE, "context_length": 4096, "rope.freq_base": 1e6, "attention.layer_norm_rms_epsilon": 1e-6},
    ),
    "qwen3": (
        "qwen3",
        {
            **SHAPE,
            "context_length": 4096,
            "rope.freq_base": 1e6,
            "attention.key_length": 16,
            "attention.value_length": 16,
            "attention.layer_norm_rms_epsilon": 1e-6,
        },
    ),
    "mistral": (
        "llama",
        {
            **SHAPE,
            "context_length": 4096,
            "rope.freq_base": 1e6,
            "attention.layer_norm_rms_epsilon": 1e-5,
            "attention.sliding_window": WINDOW,
        },
    ),
    "phi3": (
        "phi3",
        {
            **SHAPE,
            "context_length": PHI3_CONTEXT,
            "rope.freq_base": 10000.0,
            "rope.dimension_count": 16,
            "attention.layer_norm_rms_epsilon": 1e-5,
            "attention.sliding_window": WINDOW,
            "rope.scaling.original_context_length": PHI3_ORIGINAL,
            "rope.scaling.attn_factor": math.sqrt(1 + math.log(4) / math.log(PHI3_ORIGINAL)),
        },
    ),
    "gemma3": (
        "gemma3",
        {
            **SHAPE,
            "context_length": 4096,
            "rope.freq_base": 1e6,
            "attention.key_length": 16,
            "attention.value_length": 16,
            "attention.layer_norm_rms_epsilon": 1e-6,
            "attention.sliding_window": WINDOW,
            "attention.sliding_window_pattern": [True, False],
            "rope.freq_base_swa": 100.0,
            "rope.scaling.type": "linear",
            "rope.scaling.factor": 2.0,
            "attention.scale": 24**-0.5,
            "final_logit_softcapping": 0.5,
        },
    ),
}


@pytest.fixture(scope="module")
def reference():
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


@pytest.fixture(
    scope="module",
    params=[(f, t) for f in FAMILIES for t in (True, False)],
    ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}",
)
def model_dir(request, tmp_path_factory, tokenizer):
    family, tied = request.param
    root = tmp_path_factory.mktemp(family)
    tensors = write_tiny_model(root, tokenizer, family=family, tied=tied, chat_template=FAMILIES[family])
    tok = TextTokenizer(
        tokenizer.tokenizer,
        bos_id=None,
        stop_ids=tokenizer.stop_ids,
        add_bos=False,
        chat_template=FAMILIES[family],
        special_tokens=tokenizer.special_tokens,
    )
    arch, metadata = GGUF[family]
    extra = phi3_rope_tensors() if family == "phi3" else {}
    write_gguf(root / "model.gguf", arch, metadata, gguf_tensors(tensors, arch) | extra, tok, pre="smollm")
    return family, tied, root


def check_against(llm, ids: list[int], want: dict) -> None:
    """The prompt's logprobs (chosen and top 5) and the greedy tokens against transformers' in the fixture."""
    got = llm.prompt_logprobs(ids, k=5)[1:]
    np.testing.assert_allclose([g.logprob for g in got], want["chosen"], atol=TOL)
    for g, top_ids, top in zip(got, want["top_ids"], want["top"]):
        theirs = dict(zip(top_ids, top))
        for token, value in g.top:  # the same five, up to ties at the fifth
            assert token not in theirs or abs(value - theirs[token]) < TOL
        np.testing.assert_allclose([v for _, v in g.top], top, atol=TOL)
    out = llm.generate([ids], SamplingParams(max_tokens=len(want["greedy"]), ignore_eos=True))[0]
    for i, (a, b) in enumerate(zip(out.token_ids, want["greedy"])):
        if a != b:  # a tie at float32 resolution may go either way; past it the outputs part
            best, second = want["greedy_top2"][i]
            assert best - second < TIE
            break


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_logprobs_and_greedy_tokens_equal_transformers(model_dir, source, reference, monkeypatch, tmp_path):
    family, tied, root = model_dir
    want = reference[family]["tied" if tied else "untied"]
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    llm = jaxserve.LLM(
        str(root if source == "safetensors" else root / "model.gguf"),
        max_model_len=256,
        kv_cache_tokens=1024,
        progress=False,
    )
    ids = llm.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert ids == reference[family]["ids"]
    assert llm.config.qkv_bias == (family == "qwen2")
    assert llm.config.sliding_window == (WINDOW if family in ("mistral", "phi3", "gemma3") else None)
    assert llm.config.per_layer == (family == "gemma3")
    assert llm.max_model_len == 256  # a sliding window does not cut the context
    check_against(llm, ids, want)


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_phi3_longrope_past_the_original_context_as_transformers(tmp_path, tokenizer, reference, source):
    """Phi-3's 128K variants: RoPE's cos and sin at positions past the original context take LongRoPE's long factors
    and its attention factor, as transformers computes them there (the prompt test above covers the short ones)."""
    from jaxserve.models.llama import rope_cos_sin

    tensors = write_tiny_model(tmp_path, tokenizer, family="phi3")
    arch, metadata = GGUF["phi3"]
    write_gguf(
        tmp_path / "model.gguf",
        arch,
        metadata,
        gguf_tensors(tensors, arch) | phi3_rope_tensors(),
        tokenizer,
        pre="smollm",
    )
    cfg = (
        LlamaConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
        if source == "safetensors"
        else GGUFFile(tmp_path / "model.gguf").config()
    )
    assert cfg.long_rope.original_context == PHI3_ORIGINAL and cfg.max_position_embeddings == PHI3_CONTEXT
    assert LlamaConfig.from_json(cfg.to_json()) == cfg  # the converted cache keeps it
    cos, sin = rope_cos_sin(cfg, jnp.asarray([PHI3_LONG_POSITIONS]))
    want = reference["phi3"]["long_rope"]
    # float32 angles of up to 5,000 radians: an ulp of the angle or of an inverse frequency is about 5e-4
    tol = 4 * 2**-24 * max(PHI3_LONG_POSITIONS) * 1.09
    np.testing.assert_allclose(np.asarray(cos[0]), want["cos"], atol=tol)
    np.testing.assert_allclose(np.asarray(sin[0]), want["sin"], atol=tol)


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_yarn_past_the_original_context_equals_transformers(tmp_path, tokenizer, reference, source, monkeypatch):
    """Qwen2.5's YaRN as its model card adds it (max_position_embeddings left at the original 64 tokens here,
    stretched 4x): the context served is 256, and a 128-token prompt's logprobs and greedy tokens equal
    transformers' at every position, past the original context included; from config.json and from a GGUF with
    llama.cpp's rope.scaling keys."""
    tensors = write_tiny_model(tmp_path, tokenizer, family="qwen2", rope=YARN)
    arch, metadata = GGUF["qwen2"]
    write_gguf(
        tmp_path / "model.gguf",
        arch,
        {
            **metadata,
            "context_length": YARN_ORIGINAL,
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": YARN_FACTOR,
            "rope.scaling.original_context_length": YARN_ORIGINAL,
        },
        gguf_tensors(tensors, arch),
        tokenizer,
        pre="smollm",
    )
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    llm = jaxserve.LLM(
        str(tmp_path if source == "safetensors" else tmp_path / "model.gguf"), kv_cache_tokens=1024, progress=False
    )
    assert llm.max_model_len == YARN_ORIGINAL * YARN_FACTOR
    assert llm.config.yarn.original_context == YARN_ORIGINAL and llm.config.yarn.factor == YARN_FACTOR
    ids, want = reference["qwen2"]["yarn_ids"], reference["qwen2"]["yarn"]
    assert len(ids) > YARN_ORIGINAL
    check_against(llm, ids, want)


@pytest.mark.parametrize("name", list(YARN_CONFIGS))
def test_yarn_frequencies_of_long_context_checkpoints_are_transformers(name, reference):
    """Qwen2.5-7B's and Qwen3-8B's YaRN settings, and one with its own betas and DeepSeek's mscale pair: the
    inverse frequencies and attention factor transformers computes, and the context stretched by the factor."""
    settings = {"vocab_size": 64, "intermediate_size": 64, "num_hidden_layers": 1, **YARN_CONFIGS[name]}
    cfg = LlamaConfig.from_hf(settings)
    want = reference["qwen2"]["yarn_frequencies"][name]
    np.testing.assert_allclose(cfg.inv_freq(), want["inv_freq"], rtol=4 * 2**-24)  # float32 powers of the base
    assert cfg.rope_attention_factor == pytest.approx(want["attention_factor"], rel=1e-12)
    scaling = settings["rope_scaling"]
    assert cfg.max_position_embeddings == max(
        settings["max_position_embeddings"], scaling["original_max_position_embeddings"] * scaling["factor"]
    )
    assert LlamaConfig.from_json(cfg.to_json()) == cfg  # the converted cache keeps it


def test_dynamic_ntk_rope_is_transformers_at_the_stretched_context(tmp_path, tokenizer, reference):
    """Dynamic NTK (rope_type dynamic), as vLLM serves it: the base transformers takes for a forward reaching
    factor x the context, at every position, and that many positions served."""
    from jaxserve.models.llama import rope_cos_sin

    write_tiny_model(tmp_path, tokenizer, family="qwen2", rope=DYNAMIC)
    cfg = LlamaConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert cfg.max_position_embeddings == YARN_ORIGINAL * YARN_FACTOR
    cos, sin = rope_cos_sin(cfg, jnp.asarray([DYNAMIC_POSITIONS]))
    want = reference["qwen2"]["dynamic_rope"]
    tol = 4 * 2**-24 * max(DYNAMIC_POSITIONS)  # float32 angles of up to 255 radians
    np.testing.assert_allclose(np.asarray(cos[0]), want["cos"], atol=tol)
    np.testing.assert_allclose(np.asarray(sin[0]), want["sin"], atol=tol)


def test_rope_scaling_not_served_is_refused_by_name():
    base = {
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'mrope'"):
        LlamaConfig.from_hf({**base, "rope_scaling": {"rope_type": "mrope", "factor": 2.0}})


def test_phi4_mini_partial_rotary_is_refused_by_name(tmp_path, tokenizer):
    """Phi-4-mini is model_type phi3 with RoPE over three quarters of each head: refused, from config.json and from
    a GGUF (whose rope.dimension_count is then under the head's size), rather than served wrong."""
    write_tiny_model(tmp_path, tokenizer, family="phi3")
    config = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        LlamaConfig.from_hf({**config, "partial_rotary_factor": 0.75})
    arch, metadata = GGUF["phi3"]
    write_gguf(tmp_path / "p.gguf", arch, {**metadata, "rope.dimension_count": 12}, {}, tokenizer, pre="smollm")
    with pytest.raises(ValueError, match="part of each head"):
        GGUFFile(tmp_path / "p.gguf").config()


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_windows_cover_the_layers_from_max_window_layers_on(model_type):
    """As transformers' Qwen2Config and Qwen3Config lay them out (and as transformers 5 writes layer_types)."""
    base = {
        "model_type": model_type,
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "max_position_embeddings": 4096,
        "sliding_window": 512,
    }
    assert LlamaConfig.from_hf(base).sliding_window is None  # use_sliding_window is off by default
    every = LlamaConfig.from_hf({**base, "use_sliding_window": True, "max_window_layers": 0})
    assert every.sliding_window == 512 and every.uniform_window == 512 and not every.per_layer
    assert LlamaConfig.from_hf({**base, "use_sliding_window": True, "max_window_layers": 4}).sliding_window is None
    upper = LlamaConfig.from_hf({**base, "use_sliding_window": True, "max_window_layers": 2})
    assert upper.window_layers == (2, 3) and upper.uniform_window is None and upper.per_layer
    written = {**base, "layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 2}
    assert LlamaConfig.from_hf({**written, "use_sliding_window": True}) == upper


def test_the_chat_template_renders_as_transformers_renders_it(model_dir, reference):
    family, _, root = model_dir
    ours = TextTokenizer.from_hf_dir(root)
    assert [ours.apply_chat_template(c) for c in CONVERSATIONS] == reference[family]["chat"]


def test_rope_parameters_as_transformers_5_writes_them():
    """transformers 5 keeps RoPE's theta and scaling in rope_parameters; earlier versions in rope_theta and
    rope_scaling. Both read the same."""
    base = {
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    old = LlamaConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}})
    new = LlamaConfig.from_hf({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}})
    assert old == new and new.rope_theta == 5e5 and new.rope_scaling == (8.0, 1.0, 4.0, 8192)
    plain = LlamaConfig.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None


def test_gemma3_config_as_transformers_reads_it():
    """gemma-3-1b-it's config.json (26 layers, transformers' defaults for what it leaves out): five sliding layers
    of every six with RoPE base 10,000, the global ones at 1e6; older files spell the same as rope_theta,
    rope_local_base_freq and sliding_window_pattern."""
    base = {
        "model_type": "gemma3_text",
        "vocab_size": 262144,
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "max_position_embeddings": 32768,
        "sliding_window": 512,
        "query_pre_attn_scalar": 256,
    }
    old = LlamaConfig.from_hf({**base, "rope_theta": 1e6, "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6})
    new = LlamaConfig.from_hf(
        {
            **base,
            "layer_types": [("full" if (i + 1) % 6 == 0 else "sliding") + "_attention" for i in range(26)],
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        }
    )
    assert old == new
    assert [i for i in range(26) if new.layer_window(i) is None] == [5, 11, 17, 23]
    assert new.per_layer and new.uniform_window is None and new.sliding_window == 512
    assert new.rope_theta == 1e6 and new.rope_local_theta == 1e4 and new.tie_word_embeddings
    assert new.gemma_norms and new.qk_norm and new.embed_scale and new.activation == "gelu_tanh"
    assert new.final_logit_softcap is None and new.query_scale == 256
    scaled = LlamaConfig.from_hf({**base, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    np.testing.assert_allclose(scaled.inv_freq(), new.inv_freq() / 8)
    np.testing.assert_array_equal(scaled.inv_freq(local=True), new.inv_freq(local=True))  # local layers unscaled
    assert LlamaConfig.from_json(new.to_json()) == new


@pytest.mark.parametrize(
    "change, match",
    [
        ({"attn_logit_softcapping": 50.0}, "soft-capping"),
        ({"hidden_activation": "relu"}, "activation"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling"),
    ],
)
def test_gemma3_settings_not_served_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf({"model_type": "gemma3_text", **change})


def test_gemma3_gguf_reads_as_llama_cpp_does(tmp_path, tokenizer):
    """Without a pattern in the file five of every six layers slide, at RoPE base 10,000; without
    attention.scale scores scale by head_dim ** -0.5 (by (hidden / heads) ** -0.5 for the 62-layer 27B)."""
    meta = {**GGUF["gemma3"][1], "block_count": 12}
    for key in ("attention.sliding_window_pattern", "rope.freq_base_swa", "attention.scale"):
        del meta[key]
    write_gguf(tmp_path / "g.gguf", "gemma3", meta, {}, tokenizer, pre="smollm")
    cfg = GGUFFile(tmp_path / "g.gguf").config()
    assert cfg.window_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10) and cfg.rope_local_theta == 10000.0
    assert cfg.query_scale == 16 and cfg.head_dim == 16 and cfg.final_logit_softcap == 0.5
    np.testing.assert_allclose(
        cfg.inv_freq(), LlamaConfig(**{**cfg.__dict__, "rope_freq_factors": None}).inv_freq() / 2
    )
    write_gguf(tmp_path / "b.gguf", "gemma3", {**meta, "block_count": 62}, {}, tokenizer, pre="smollm")
    assert GGUFFile(tmp_path / "b.gguf").config().query_scale == 64 / 4


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_gemma3_image_text_checkpoints_serve_their_text_model(prefix, tmp_path, tokenizer, reference, monkeypatch):
    """gemma-3-4b and larger are image-text checkpoints (model_type gemma3): the text model's config inside
    text_config, its tensors under language_model.model (the hub's files) or model.language_model (as
    transformers 5 saves them), beside a vision tower. Their text model gives transformers'
    Gemma3ForConditionalGeneration's logprobs on text (which leaves the text config's logit soft-cap out)."""
    write_tiny_model(tmp_path, tokenizer, family="gemma3", tied=True)
    as_image_text(tmp_path, prefix)
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    llm = jaxserve.LLM(str(tmp_path), max_model_len=256, kv_cache_tokens=1024, progress=False)
    assert llm.config.per_layer and llm.config.gemma_norms and llm.config.final_logit_softcap is None
    got = llm.prompt_logprobs(reference["gemma3"]["ids"], k=5)[1:]
    np.testing.assert_allclose([g.logprob for g in got], reference["gemma3"]["image_text"], atol=TOL)
