"""Model families beside Llama, each a tiny model of random weights (tests/tiny_models.py: the same from its seed
on any machine) loaded from a Hugging Face folder and from a GGUF written with the `gguf` package. jaxserve's
logprobs and greedy tokens equal transformers' (float32, 1e-4) and its chat template renders 10 conversations byte
for byte as transformers does; transformers' side is recorded in tests/fixtures/families_reference.json by
tools/make_family_fixtures.py."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

import jaxserve
from jaxserve import SamplingParams
from jaxserve.models import registry
from jaxserve.models.config import LlamaConfig
from jaxserve.models.gguf_loader import GGUFFile
from jaxserve.models.tokenizer import TextTokenizer
from tiny_models import CONVERSATIONS, FAMILIES, PROMPT, WINDOW, gguf_tensors, write_gguf, write_tiny_model

FIXTURE = pathlib.Path(__file__).parents[1] / "fixtures" / "families_reference.json"
TOL = 1e-4  # float32 logprobs of magnitude ~10 through two implementations
TIE = 1e-3  # two greedy candidates closer than this may swap between implementations
SHAPE = {"embedding_length": 64, "feed_forward_length": 128, "block_count": 2, "attention.head_count": 4,
         "attention.head_count_kv": 2}
# family -> (its GGUF architecture, the metadata llama.cpp's converter writes for it)
GGUF = {"qwen2": ("qwen2", {**SHAPE, "context_length": 4096, "rope.freq_base": 1e6,
                            "attention.layer_norm_rms_epsilon": 1e-6}),
        "mistral": ("llama", {**SHAPE, "context_length": 4096, "rope.freq_base": 1e6,
                              "attention.layer_norm_rms_epsilon": 1e-5, "attention.sliding_window": WINDOW}),
        "phi3": ("phi3", {**SHAPE, "context_length": 4096, "rope.freq_base": 10000.0, "rope.dimension_count": 16,
                          "attention.layer_norm_rms_epsilon": 1e-5, "attention.sliding_window": WINDOW})}


@pytest.fixture(scope="module")
def reference():
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer.from_gguf(GGUFFile(registry.resolve(registry.DEFAULT_MODEL)))


@pytest.fixture(scope="module", params=[(f, t) for f in FAMILIES for t in (True, False)],
                ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}")
def model_dir(request, tmp_path_factory, tokenizer):
    family, tied = request.param
    root = tmp_path_factory.mktemp(family)
    tensors = write_tiny_model(root, tokenizer, family=family, tied=tied, chat_template=FAMILIES[family])
    tok = TextTokenizer(tokenizer.tokenizer, bos_id=None, stop_ids=tokenizer.stop_ids, add_bos=False,
                        chat_template=FAMILIES[family], special_tokens=tokenizer.special_tokens)
    arch, metadata = GGUF[family]
    write_gguf(root / "model.gguf", arch, metadata, gguf_tensors(tensors, arch), tok, pre="smollm")
    return family, tied, root


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_logprobs_and_greedy_tokens_equal_transformers(model_dir, source, reference, monkeypatch, tmp_path):
    family, tied, root = model_dir
    want = reference[family]["tied" if tied else "untied"]
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    llm = jaxserve.LLM(str(root if source == "safetensors" else root / "model.gguf"), max_model_len=256,
                       kv_cache_tokens=1024, progress=False)
    ids = llm.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert ids == reference[family]["ids"]
    assert llm.config.qkv_bias == (family == "qwen2")
    assert llm.config.sliding_window == (WINDOW if family in ("mistral", "phi3") else None)
    assert llm.max_model_len == 256  # a sliding window does not cut the context
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


def test_qwen2_windows_on_some_layers_only_are_refused():
    base = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "max_position_embeddings": 4096, "sliding_window": 512}
    assert LlamaConfig.from_hf(base).sliding_window is None  # use_sliding_window is off by default
    assert LlamaConfig.from_hf({**base, "use_sliding_window": True, "max_window_layers": 0}).sliding_window == 512
    assert LlamaConfig.from_hf({**base, "use_sliding_window": True, "max_window_layers": 4}).sliding_window is None
    with pytest.raises(ValueError, match="max_window_layers"):
        LlamaConfig.from_hf({**base, "use_sliding_window": True, "max_window_layers": 2})


def test_the_chat_template_renders_as_transformers_renders_it(model_dir, reference):
    family, _, root = model_dir
    ours = TextTokenizer.from_hf_dir(root)
    assert [ours.apply_chat_template(c) for c in CONVERSATIONS] == reference[family]["chat"]


def test_rope_parameters_as_transformers_5_writes_them():
    """transformers 5 keeps RoPE's theta and scaling in rope_parameters; earlier versions in rope_theta and
    rope_scaling. Both read the same."""
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2}
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    old = LlamaConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}})
    new = LlamaConfig.from_hf({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}})
    assert old == new and new.rope_theta == 5e5 and new.rope_scaling == (8.0, 1.0, 4.0, 8192)
    plain = LlamaConfig.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None
