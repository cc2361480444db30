"""Load a Llama-family GGUF file (architectures llama, which Mistral's files use too, qwen2 and phi3): config,
dequantized weights (via the `gguf` package) and tokenizer metadata."""

from __future__ import annotations

import pathlib
import re
from typing import Any

import gguf
import numpy as np

from jaxserve.models.config import LlamaConfig, windowed_context
from jaxserve.models.hf_loader import phi3_split
from jaxserve.models.weights import params_from_hf

ARCHITECTURES = ("llama", "qwen2", "phi3")
# Hugging Face tensor name (with {i} for the layer) -> GGUF tensor name.
_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.qkv_proj.weight": "blk.{i}.attn_qkv.weight",  # phi3: q, k and v fused
    "model.layers.{i}.mlp.gate_up_proj.weight": "blk.{i}.ffn_up.weight",  # phi3: gate and up fused
    "model.layers.{i}.self_attn.q_proj.bias": "blk.{i}.attn_q.bias",
    "model.layers.{i}.self_attn.k_proj.bias": "blk.{i}.attn_k.bias",
    "model.layers.{i}.self_attn.v_proj.bias": "blk.{i}.attn_v.bias",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}


class GGUFFile:
    """A parsed GGUF file: metadata fields and tensors, read lazily from a memory map."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        self._reader = gguf.GGUFReader(str(self.path))
        self._tensors = {t.name: t for t in self._reader.tensors}

    def field(self, key: str, default: Any = None) -> Any:
        f = self._reader.fields.get(key)
        return default if f is None else f.contents()

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> np.ndarray:
        """Dequantized float32 tensor in row-major [out, in] layout."""
        t = self._tensors[name]
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)

    def config(self) -> LlamaConfig:
        arch = self.field("general.architecture")
        if arch not in ARCHITECTURES:
            raise ValueError(f"{self.path}: unsupported GGUF architecture {arch!r} (served: "
                             f"{', '.join(ARCHITECTURES)})")
        p = f"{arch}."
        if (self.field(p + "expert_count") or 0) > 0:
            raise ValueError(f"{self.path}: mixture-of-experts GGUF models are not supported")
        scaling = self.field(p + "rope.scaling.type")
        if scaling not in (None, "none") and not self.has_tensor("rope_freqs.weight"):
            raise ValueError(f"{self.path}: unsupported rope scaling {scaling!r} (only Llama-3 rope_freqs)")
        heads = int(self.field(p + "attention.head_count"))
        hidden = int(self.field(p + "embedding_length"))
        # llama.cpp stores Llama-3 rope scaling as per-frequency divisors in a `rope_freqs` tensor.
        freq_factors = None
        if self.has_tensor("rope_freqs.weight"):
            freq_factors = tuple(float(x) for x in self.tensor("rope_freqs.weight").reshape(-1))
        if self.has_tensor("rope_factors_long.weight"):
            raise ValueError(f"{self.path}: LongRoPE (Phi-3's 128K variants) is not supported")
        vocab = self.field(p + "vocab_size") or len(self.field("tokenizer.ggml.tokens"))
        context = windowed_context(int(self.field(p + "context_length")), self.field(p + "attention.sliding_window"))
        return LlamaConfig(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self.field(p + "feed_forward_length")),
            num_layers=int(self.field(p + "block_count")),
            num_heads=heads,
            num_kv_heads=int(self.field(p + "attention.head_count_kv", heads)),
            head_dim=int(self.field(p + "rope.dimension_count", hidden // heads)),
            max_position_embeddings=context,
            rms_norm_eps=float(self.field(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self.field(p + "rope.freq_base", 10000.0)),
            rope_freq_factors=freq_factors,
            tie_word_embeddings=not self.has_tensor("output.weight"),
            qkv_bias=arch == "qwen2",
        )


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> rotate-half halves)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | pathlib.Path) -> tuple[LlamaConfig, dict[str, Any], GGUFFile]:
    f = GGUFFile(path)
    cfg = f.config()
    arch = f.field("general.architecture")
    permuted = arch == "llama"  # llama.cpp's converter permutes llama's q and k only

    def tensor(hf_name: str) -> np.ndarray:
        m = re.match(r"model\.layers\.(\d+)\.(.*)", hf_name)
        key = f"model.layers.{{i}}.{m.group(2)}" if m else hf_name
        w = f.tensor(_HF_TO_GGUF[key].format(i=m.group(1) if m else ""))
        if permuted and key.endswith("q_proj.weight"):
            w = _unpermute(w, cfg.num_heads)
        elif permuted and key.endswith("k_proj.weight"):
            w = _unpermute(w, cfg.num_kv_heads)
        return w

    return cfg, params_from_hf(cfg, phi3_split(cfg, tensor) if arch == "phi3" else tensor), f
