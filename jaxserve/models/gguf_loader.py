"""Load a Llama-family GGUF file (architectures llama, which Mistral's files use too, qwen2, qwen3, phi3 and gemma3):
config, weights and tokenizer metadata.

Weights are dequantized to float32 (via the `gguf` package), or with `keep_quantized` kept in their blocks as
`quantize.Quantized` values: Q8_0 (int8), Q4_0 (int4), Q4_1 and Q4_K (uint4 with a float offset per block of 32),
Q5_0, Q5_1 and Q5_K (5-bit values in int8, a scale and for Q5_1 / Q5_K an offset per 32), Q6_K, Q3_K and Q2_K
(int8, a scale and for Q2_K an offset per 16) load without going through float. A weight whose layers differ in type (a
stacked weight has one layout: Q4_K_M's Q4_K and Q6_K) is kept in one layout they all fit (mixed_layout); a
tensor of another type is dequantized.

On a CPU with ggml's kernels (models/ggml.py) a kept tensor is a `quantize.GGMLBlocks` instead: its rows of
blocks as stored, any type ggml computes (a weight whose layers differ in type is dequantized: stacked layers
need one row size)."""

from __future__ import annotations

import pathlib
import re
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from jaxserve.models.config import LlamaConfig, LongRoPE, YaRN, gemma3_sliding, yarn_mscale
from jaxserve.models.hf_loader import phi3_split
from jaxserve.models import ggml
from jaxserve.models.quantize import GGMLBlocks, Quantized
from jaxserve.models.weights import params_from_hf

ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3")
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
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",  # qwen3, gemma3
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
}
# Gemma 3's names where they differ: its post_attention_layernorm norms the attention's output, and llama.cpp's
# ffn_norm is its pre_feedforward_layernorm
_GEMMA3 = {
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.post_attention_norm.weight",
    "model.layers.{i}.pre_feedforward_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.post_feedforward_layernorm.weight": "blk.{i}.post_ffw_norm.weight",
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

    def tensor_type(self, name: str) -> gguf.GGMLQuantizationType:
        return self._tensors[name].tensor_type

    def blocks(self, name: str) -> Quantized:
        """A tensor of a type in KEPT as stored: [out, in] values, a scale (and offset) per block along `in`."""
        t = self._tensors[name]
        block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        raw = np.asarray(t.data).reshape(-1, size)
        values, scale, offset, qtype = KEPT[t.tensor_type](raw)
        rows = t.data.shape[:-1]
        lead = (*rows, scale.size // int(np.prod(rows)))  # the blocks of each row
        return Quantized(
            values.reshape(*rows, -1), scale.reshape(lead), None if offset is None else offset.reshape(lead), qtype
        )

    def rows(self, name: str) -> GGMLBlocks:
        """A tensor's rows of blocks as stored, [out, row bytes], for ggml's kernels."""
        t = self._tensors[name]
        return GGMLBlocks(np.asarray(t.data).reshape(t.data.shape[0], -1), int(t.tensor_type))

    def config(self) -> LlamaConfig:
        arch = self.field("general.architecture")
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"{self.path}: unsupported GGUF architecture {arch!r} (served: {', '.join(ARCHITECTURES)})"
            )
        p = f"{arch}."
        if (self.field(p + "expert_count") or 0) > 0:
            raise ValueError(f"{self.path}: mixture-of-experts GGUF models are not supported")
        scaling = self.field(p + "rope.scaling.type")
        factor = float(self.field(p + "rope.scaling.factor", 1.0))
        linear = scaling == "linear" or (scaling is None and factor != 1.0)  # llama.cpp's default type is linear
        if scaling not in (None, "none", "linear", "yarn") and not self.has_tensor("rope_freqs.weight"):
            raise ValueError(f"{self.path}: unsupported rope scaling {scaling!r} (linear, yarn and Llama-3 rope_freqs)")
        heads = int(self.field(p + "attention.head_count"))
        hidden = int(self.field(p + "embedding_length"))
        head_dim = int(self.field(p + "attention.key_length", self.field(p + "rope.dimension_count", hidden // heads)))
        if arch == "phi3" and int(self.field(p + "rope.dimension_count", head_dim)) < hidden // heads:
            raise ValueError(f"{self.path}: RoPE over part of each head (Phi-4-mini) is not supported")
        # llama.cpp stores Llama-3 rope scaling as per-frequency divisors in a `rope_freqs` tensor.
        freq_factors = None
        if self.has_tensor("rope_freqs.weight"):
            freq_factors = tuple(float(x) for x in self.tensor("rope_freqs.weight").reshape(-1))
        elif linear and factor != 1.0:  # every frequency divided alike
            freq_factors = (factor,) * (head_dim // 2)
        vocab = self.field(p + "vocab_size") or len(self.field("tokenizer.ggml.tokens"))
        context = int(self.field(p + "context_length"))
        long_rope = None
        if self.has_tensor("rope_factors_long.weight"):  # Phi-3's 128K variants, as llama.cpp's converter writes them
            long_rope = LongRoPE.make(
                self.tensor("rope_factors_short.weight").reshape(-1).tolist(),
                self.tensor("rope_factors_long.weight").reshape(-1).tolist(),
                int(self.field(p + "rope.scaling.original_context_length")),
                context,
                self.field(p + "rope.scaling.attn_factor"),
            )
        yarn = None
        if scaling == "yarn":  # llama.cpp multiplies its own attention scale by yarn_attn_factor
            original = int(self.field(p + "rope.scaling.original_context_length", context))
            yarn = YaRN.make(
                factor,
                original,
                yarn_mscale(factor) * float(self.field(p + "rope.scaling.yarn_attn_factor", 1.0)),
                beta_fast=self.field(p + "rope.scaling.yarn_beta_fast"),
                beta_slow=self.field(p + "rope.scaling.yarn_beta_slow"),
            )
            context = max(context, int(original * factor))
        layers = int(self.field(p + "block_count"))
        window = self.field(p + "attention.sliding_window")
        cfg = LlamaConfig(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self.field(p + "feed_forward_length")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(self.field(p + "attention.head_count_kv", heads)),
            head_dim=head_dim,
            max_position_embeddings=context,
            rms_norm_eps=float(self.field(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self.field(p + "rope.freq_base", 10000.0)),
            rope_freq_factors=freq_factors,
            long_rope=long_rope,
            yarn=yarn,
            tie_word_embeddings=not self.has_tensor("output.weight"),
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            sliding_window=int(window) if window and window < context else None,
        )
        return self._gemma3(cfg, layers, window) if arch == "gemma3" else cfg

    def _gemma3(self, cfg: LlamaConfig, layers: int, window: int | None) -> LlamaConfig:
        """Gemma 3's settings as llama.cpp reads them: with a window, five of every six layers slide (or the
        file's own attention.sliding_window_pattern, one flag a layer) with RoPE base 10,000 (or
        rope.freq_base_swa); scores scaled by head_dim ** -0.5, but by (hidden / heads) ** -0.5 for the
        62-layer 27B, unless the file gives attention.scale."""
        p = "gemma3."
        pattern = self.field(p + "attention.sliding_window_pattern")
        sliding = (
            (tuple(i for i, s in enumerate(pattern) if s) if isinstance(pattern, list) else gemma3_sliding(layers))
            if window
            else ()
        )
        scale = self.field(p + "attention.scale")
        query_scale = (
            float(scale) ** -2 if scale else cfg.hidden_size / cfg.num_heads if layers == 62 else float(cfg.head_dim)
        )
        return cfg.gemma3(
            sliding,
            float(self.field(p + "rope.freq_base_swa", 10000.0)),
            query_scale,
            self.field(p + "final_logit_softcapping"),
        )


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16)[:, 0]


def _fields(qs: np.ndarray, groups: int, bits: int) -> np.ndarray:
    """Values of `bits` bits packed in bytes, llama.cpp's order: in each of `groups` runs of bytes, every byte's
    lowest field first, then every byte's next one, and so on."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8).reshape(1, 1, -1, 1)
    qs = qs.reshape(qs.shape[0], groups, 1, -1) >> shifts
    return (qs & np.uint8((1 << bits) - 1)).reshape(qs.shape[0], -1)


# Each kept type's blocks -> (values, scale, offset or None, the values' type), exactly as the file means them:
# w = scale * values + offset. 4-bit values come one to an int8 (quantize.on_device packs them).
def _q8_0(raw):
    return raw[:, 2:].view(np.int8), _f16(raw[:, :2]), None, jnp.int8


def _q4_0(raw):  # d * (q - 8)
    return _fields(raw[:, 2:], 1, 4).astype(np.int8) - 8, _f16(raw[:, :2]), None, jnp.int4


def _q4_1(raw):  # d * q + m
    return _fields(raw[:, 4:], 1, 4), _f16(raw[:, :2]), _f16(raw[:, 2:4]), jnp.uint4


def _q4_k(raw):  # 8 blocks of 32 per 256: (d * sc_j) * q - dmin * m_j, sc_j and m_j 6-bit (float32 holds them)
    d, dmin = _f16(raw[:, :2]).astype(np.float32)[:, None], _f16(raw[:, 2:4]).astype(np.float32)[:, None]
    sc, mn = gguf.quants.Q4_K.get_scale_min(raw[:, 4:16])
    return _fields(raw[:, 16:], 4, 4), d * sc, -dmin * mn, jnp.uint4


def _q5_0(raw):  # d * (q - 16), q 5-bit (low 4 bits in qs, the fifth in qh: bit i for value i)
    values = (_fields(raw[:, 6:], 1, 4) | _fifth_bits(raw[:, 2:6])).astype(np.int8) - 16
    return values, _f16(raw[:, :2]), None, jnp.int8


def _q5_1(raw):  # d * q + m
    values = (_fields(raw[:, 8:], 1, 4) | _fifth_bits(raw[:, 4:8])).astype(np.int8)
    return values, _f16(raw[:, :2]), _f16(raw[:, 2:4]), jnp.int8


def _q5_k(raw):  # as Q4_K, the fifth bit of value j of block b (of 8) bit b of qh[j]
    d, dmin = _f16(raw[:, :2]).astype(np.float32)[:, None], _f16(raw[:, 2:4]).astype(np.float32)[:, None]
    sc, mn = gguf.quants.Q4_K.get_scale_min(raw[:, 4:16])
    values = _fields(raw[:, 48:], 4, 4) | (_fields(raw[:, 16:48], 1, 1) << 4)
    return values.astype(np.int8), d * sc, -dmin * mn, jnp.int8


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's fifth bits (4 bytes, little-endian bit order: value i's is bit i) as 16s."""
    return np.unpackbits(qh, axis=-1, bitorder="little") << 4


def _q2_k(raw):  # 16 blocks of 16 per 256: (d * sc_j) * q - dmin * m_j, q 2-bit, sc_j and m_j 4-bit
    d, dmin = _f16(raw[:, 80:82]).astype(np.float32)[:, None], _f16(raw[:, 82:84]).astype(np.float32)[:, None]
    return (
        _fields(raw[:, 16:80], 2, 2).astype(np.int8),
        d * (raw[:, :16] & 0x0F),
        -dmin * (raw[:, :16] >> 4),
        jnp.int8,
    )


def _q3_k(raw):  # 16 blocks of 16 per 256: (d * sc_j) * q, q 3-bit (-4..3; its high bit set means no -4), sc_j 6-bit
    d = _f16(raw[:, 108:110]).astype(np.float32)[:, None]
    sc = (_fields(raw[:, 96:104], 1, 4) | (_fields(raw[:, 104:108], 1, 2) << 4)).astype(np.int8) - 32
    values = _fields(raw[:, 32:96], 2, 2).astype(np.int8) - ((_fields(raw[:, :32], 1, 1) ^ 1) << 2).astype(np.int8)
    return values, d * sc, None, jnp.int8


def _q6_k(raw):  # 16 blocks of 16 per 256: (d * sc_j) * (q - 32), q 6-bit (low 4 bits in ql, high 2 in qh)
    d = _f16(raw[:, 208:210]).astype(np.float32)[:, None]
    sc = raw[:, 192:208].view(np.int8).astype(np.float32)
    low = _fields(raw[:, :128], 2, 4)
    return (low | (_fields(raw[:, 128:192], 2, 2) << 4)).astype(np.int8) - 32, d * sc, None, jnp.int8


_T = gguf.GGMLQuantizationType
KEPT = {
    _T.Q8_0: _q8_0,
    _T.Q4_0: _q4_0,
    _T.Q4_1: _q4_1,
    _T.Q4_K: _q4_k,
    _T.Q5_0: _q5_0,
    _T.Q5_1: _q5_1,
    _T.Q5_K: _q5_k,
    _T.Q6_K: _q6_k,
    _T.Q2_K: _q2_k,
    _T.Q3_K: _q3_k,
}
MIXED_BLOCK = 16  # the block of a weight whose layers differ in type: the smallest of KEPT's


def mixed_layout(q: Quantized) -> Quantized:
    """A kept tensor in the one layout any of KEPT's types fits: int8 values (still unpacked, as blocks() gives
    them), a float32 scale and offset per MIXED_BLOCK along `in`. Layers stored in different types (Q4_K_M's
    Q4_K and Q6_K) stack in it: 12 bits a weight against float16's 16."""
    values = np.asarray(q.values)
    repeat = values.shape[-1] // MIXED_BLOCK // q.scale.shape[-1]
    scale = np.repeat(np.asarray(q.scale, np.float32), repeat, axis=-1)
    offset = np.zeros_like(scale) if q.offset is None else np.repeat(np.asarray(q.offset, np.float32), repeat, axis=-1)
    return Quantized(values.astype(np.int8), scale, offset, jnp.int8)


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> rotate-half halves)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | pathlib.Path, keep_quantized: bool = False) -> tuple[LlamaConfig, dict[str, Any], GGUFFile]:
    f = GGUFFile(path)
    cfg = f.config()
    arch = f.field("general.architecture")
    permuted = arch == "llama"  # llama.cpp's converter permutes llama's q and k only
    names = _names(arch)
    rows = keep_quantized and ggml.available()
    kept, mixed = _kept_names(f, cfg, names, rows) if keep_quantized else (set(), set())
    blocks = kept | mixed

    def tensor(hf_name: str) -> np.ndarray | Quantized:
        m = re.match(r"model\.layers\.(\d+)\.(.*)", hf_name)
        key = f"model.layers.{{i}}.{m.group(2)}" if m else hf_name
        name = names[key].format(i=m.group(1) if m else "")
        w = (f.rows(name) if rows else f.blocks(name)) if names[key] in blocks else f.tensor(name)
        if names[key] in mixed:
            w = mixed_layout(w)
        if arch == "gemma3" and key.endswith("norm.weight"):  # llama.cpp stores Gemma's norms as 1 + weight
            w = w - np.float32(1.0)
        if permuted and key.endswith("q_proj.weight"):
            w = jax.tree.map(lambda a: _unpermute(a, cfg.num_heads), w)
        elif permuted and key.endswith("k_proj.weight"):
            w = jax.tree.map(lambda a: _unpermute(a, cfg.num_kv_heads), w)
        return w

    return cfg, params_from_hf(cfg, phi3_split(cfg, tensor) if arch == "phi3" else tensor), f


def _names(arch: str) -> dict[str, str]:
    """Hugging Face tensor name (with {i} for the layer) -> GGUF tensor name, for `arch`."""
    return {**_HF_TO_GGUF, **_GEMMA3} if arch == "gemma3" else _HF_TO_GGUF


def _kept_names(f: GGUFFile, cfg: LlamaConfig, names: dict[str, str], rows: bool = False) -> tuple[set[str], set[str]]:
    """The GGUF names (with {i} for the layer) of the weights kept quantized: those whose every layer has one
    type in KEPT (kept as stored), and those whose layers' types differ, each in KEPT (mixed_layout; with `rows`,
    ggml's, none: they are dequantized). The others are dequantized, with a line in the log."""
    kept, mixed, dequantized = set(), set(), set()
    for pattern in names.values():
        tensors = [pattern.format(i=i) for i in range(cfg.num_layers)] if "{i}" in pattern else [pattern]
        types = {f.tensor_type(n) for n in tensors if f.has_tensor(n)}
        if types and types <= set(KEPT) and not (rows and len(types) > 1):
            (kept if len(types) == 1 else mixed).add(pattern)
        elif types - {_T.F32, _T.F16, _T.BF16}:
            dequantized.add(f"{pattern} ({', '.join(sorted(t.name for t in types))})")
    if dequantized:
        logging.warning("%s: dequantized (types not kept): %s", f.path, "; ".join(sorted(dequantized)))
    return kept, mixed
