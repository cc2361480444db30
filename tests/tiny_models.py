"""Small random-weight models written as Hugging Face folders, for tests that need a real tokenizer."""

from __future__ import annotations

import json
import pathlib

import numpy as np
from safetensors.numpy import save_file

from jaxserve.models.tokenizer import TextTokenizer


def write_tiny_model(root: pathlib.Path, tokenizer: TextTokenizer, seed: int = 0) -> None:
    """A 2-layer Llama of random weights with `tokenizer`, as a Hugging Face folder."""
    v, h, f, heads, kv_heads, d = tokenizer.vocab_size, 64, 128, 4, 2, 16
    rng = np.random.default_rng(seed)
    w = lambda *shape: (0.02 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    tensors = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": np.ones(h, np.float32)}
    for i in range(2):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": np.ones(h, np.float32),
                    p + "post_attention_layernorm.weight": np.ones(h, np.float32),
                    p + "self_attn.q_proj.weight": w(heads * d, h), p + "self_attn.k_proj.weight": w(kv_heads * d, h),
                    p + "self_attn.v_proj.weight": w(kv_heads * d, h), p + "self_attn.o_proj.weight": w(h, heads * d),
                    p + "mlp.gate_proj.weight": w(f, h), p + "mlp.up_proj.weight": w(f, h),
                    p + "mlp.down_proj.weight": w(h, f)}
    save_file(tensors, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": v, "hidden_size": h,
        "intermediate_size": f, "num_hidden_layers": 2, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": d, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": True}))
    tokenizer.tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": tokenizer.special_tokens["eos_token"]}))


def write_gguf(path: pathlib.Path, arch: str, config: dict, tensors: dict[str, np.ndarray], tokenizer: TextTokenizer,
               pre: str) -> None:
    """A float32 GGUF file as llama.cpp's converter writes one: `config` its `{arch}.*` metadata, `tensors` by their
    GGUF names ([out, in] arrays), the tokenizer's byte-level BPE vocabulary and merges, `pre` its pre-tokenizer."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in config.items():
        if isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    spec = json.loads(tokenizer.tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [""] * tokenizer.vocab_size
    for token, i in vocab.items():
        tokens[i] = token
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    for t in spec["added_tokens"]:
        tokens[t["id"]] = t["content"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    eos = tokenizer.tokenizer.token_to_id(tokenizer.special_tokens["eos_token"])
    w.add_eos_token_id(eos)
    if tokenizer.chat_template:
        w.add_chat_template(tokenizer.chat_template)
    for name, array in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(array, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
