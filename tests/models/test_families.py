"""Model families beside Llama, each built small with random weights by transformers (its config and safetensors,
and a GGUF written with the `gguf` package): jaxserve's logprobs equal transformers' (float32, 1e-4), its greedy
tokens too, and its chat template renders byte for byte as transformers renders it."""

from __future__ import annotations

import json

import numpy as np
import pytest

import jaxserve
from jaxserve import SamplingParams
from jaxserve.models import registry
from jaxserve.models.gguf_loader import GGUFFile
from jaxserve.models.tokenizer import TextTokenizer
from tiny_models import write_gguf

torch = pytest.importorskip("torch")  # the [reference] extra, which CI installs
transformers = pytest.importorskip("transformers")

TOL = 1e-4  # float32 logprobs of magnitude ~10 through two implementations
# Qwen2.5's chat template (its system default, turns in ChatML)
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if message.role != 'system' or not loop.first %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "x3?"}],
    [{"role": "user", "content": "Ünïcode ✓ and emoji 🙂"}],
    [{"role": "user", "content": "Line one\nLine two\n\n  indented"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "empty system"}],
    [{"role": "user", "content": "{{ not a template }} {% raw %}"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
     {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}],
    [{"role": "user", "content": "quotes ' \" and \\ backslash"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "<|im_end|> typed by a user"}],
]


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer.from_gguf(GGUFFile(registry.resolve(registry.DEFAULT_MODEL)))


def qwen2(tmp_path_factory, tokenizer, tied: bool):
    """A 2-layer Qwen2 of random weights (its q/k/v biases too) saved by transformers, and the same as a GGUF."""
    root = tmp_path_factory.mktemp(f"qwen2-{tied}")
    cfg = transformers.Qwen2Config(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
                                   tie_word_embeddings=tied, torch_dtype="float32")
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.3)
    model.save_pretrained(root, safe_serialization=True)
    tokenizer.tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": None, "chat_template": QWEN_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    names = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
             **{f"self_attn.{x}_proj.{kind}": f"attn_{x}.{kind}" for x in "qkv" for kind in ("weight", "bias")}}
    tensors = {}
    for key, value in sd.items():
        if key == "lm_head.weight":
            if not tied:
                tensors["output.weight"] = value
            continue
        parts = key.removeprefix("model.").split(".")
        if parts[0] == "layers":
            tensors[f"blk.{parts[1]}.{names['.'.join(parts[2:])]}"] = value
        else:
            tensors[names[".".join(parts)]] = value
    tok = TextTokenizer(tokenizer.tokenizer, bos_id=None, stop_ids=tokenizer.stop_ids, add_bos=False,
                        chat_template=QWEN_TEMPLATE, special_tokens=tokenizer.special_tokens)
    write_gguf(root / "model.gguf", "qwen2", {
        "context_length": 4096, "embedding_length": 64, "feed_forward_length": 128, "block_count": 2,
        "attention.head_count": 4, "attention.head_count_kv": 2, "rope.freq_base": 1e6,
        "attention.layer_norm_rms_epsilon": 1e-6}, tensors, tok, pre="smollm")
    return root, model


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def family(request, tmp_path_factory, tokenizer):
    return qwen2(tmp_path_factory, tokenizer, request.param)


def reference_logprobs(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_logprobs_and_greedy_tokens_equal_transformers(family, source, monkeypatch, tmp_path):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    root, model = family
    llm = jaxserve.LLM(str(root if source == "safetensors" else root / "model.gguf"), max_model_len=256,
                       kv_cache_tokens=1024, progress=False)
    assert llm.config.qkv_bias
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. 12345", add_special_tokens=False)
    want = reference_logprobs(model, ids)
    got = llm.prompt_logprobs(ids, k=5)
    for pos, entry in enumerate(got[1:], start=1):
        assert abs(entry.logprob - want[pos - 1, ids[pos]]) < TOL
        np.testing.assert_allclose([v for _, v in entry.top], want[pos - 1][[t for t, _ in entry.top]], atol=TOL)
    out = llm.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1))[0]
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                             pad_token_id=0)[0, len(ids):].tolist()
    full = reference_logprobs(model, ids + ref)
    for i, (a, b) in enumerate(zip(out.token_ids, ref)):
        if a != b:  # a tie at float32 resolution may go either way; then the rest parts ways
            assert abs(full[len(ids) - 1 + i, a] - full[len(ids) - 1 + i, b]) < 1e-3
            break


def test_the_chat_template_renders_as_transformers_renders_it(family):
    root, _ = family
    ours = TextTokenizer.from_hf_dir(root)
    theirs = transformers.AutoTokenizer.from_pretrained(str(root))
    for conversation in CONVERSATIONS:
        assert ours.apply_chat_template(conversation) == theirs.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True)


def test_rope_parameters_as_transformers_5_writes_them():
    """transformers 5 keeps RoPE's theta and scaling in rope_parameters; earlier versions in rope_theta and
    rope_scaling. Both read the same."""
    from jaxserve.models.config import LlamaConfig

    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2}
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    old = LlamaConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}})
    new = LlamaConfig.from_hf({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}})
    assert old == new and new.rope_theta == 5e5 and new.rope_scaling == (8.0, 1.0, 4.0, 8192)
    plain = LlamaConfig.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None
