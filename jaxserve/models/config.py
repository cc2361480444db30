"""Llama-family model configuration, shared by every loader. Qwen2 / Qwen2.5 are Llama with biases on the q, k
and v projections (qkv_bias); Mistral and Phi-3 are Llama (Phi-3's fused projections are split on load).

A sliding window (Mistral v0.1, Phi-3-mini) is one width for every layer: each query attends to the keys of the
last `sliding_window` positions. Windows that differ between layers (Qwen2's max_window_layers) are refused."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class TPShape:
    """What one device of a tp-way tensor-parallel instance holds (LlamaConfig.split)."""

    tp: int
    heads: int  # query heads
    kv_heads: int  # KV heads (1 when repeated)
    kv_repeat: int  # devices sharing each of the model's KV heads
    intermediate: int

    @property
    def cache_heads(self) -> int:
        """KV heads of the instance's cache, all devices together (a repeated head once per device)."""
        return self.kv_heads * self.tp

    def kv_start(self, rank):
        """The first of the model's KV heads that device `rank` (an int or a traced index) holds."""
        return rank * self.kv_heads // self.kv_repeat


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3 rope scaling: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).
    rope_scaling: tuple[float, float, float, int] | None = None
    # The same scaling as llama.cpp stores it: inv_freq is divided by these, one per frequency.
    rope_freq_factors: tuple[float, ...] | None = None
    tie_word_embeddings: bool = True
    qkv_bias: bool = False  # Qwen2: the q, k and v projections add a bias
    sliding_window: int | None = None  # Mistral v0.1, Phi-3: each query sees the last this many positions

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "LlamaConfig":
        """Build from a Hugging Face config.json dict (transformers 5 writes RoPE's theta and scaling together as
        rope_parameters; earlier versions as rope_theta and rope_scaling)."""
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        rope_scaling = None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind != "llama3":
                raise ValueError(f"unsupported rope_scaling type {kind!r} (only 'llama3')")
            rope_scaling = (
                float(scaling["factor"]),
                float(scaling["low_freq_factor"]),
                float(scaling["high_freq_factor"]),
                int(scaling["original_max_position_embeddings"]),
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        qwen2 = cfg.get("model_type") == "qwen2"
        window = cfg.get("sliding_window") if (not qwen2 or cfg.get("use_sliding_window")) else None
        if qwen2 and window and int(cfg.get("max_window_layers", 0)) > 0:
            if int(cfg["max_window_layers"]) < int(cfg["num_hidden_layers"]):
                raise ValueError("sliding windows on some layers only (Qwen2's max_window_layers) are not supported")
            window = None  # the window starts past the last layer
        context = int(cfg.get("max_position_embeddings", 2048))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            max_position_embeddings=context,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qwen2,
            sliding_window=int(window) if window and window < context else None,
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "LlamaConfig":
        raw = json.loads(text)
        for key in ("rope_scaling", "rope_freq_factors"):
            if raw[key] is not None:
                raw[key] = tuple(raw[key])
        return cls(**raw)

    def split(self, tp: int) -> TPShape:
        """What one device of a tp-way tensor-parallel instance holds, or a ValueError naming what does not
        divide. When tp exceeds the KV heads each is repeated on tp / num_kv_heads devices."""
        if tp < 1:
            raise ValueError(f"tp must be a positive integer, got {tp}")
        kvh = self.num_kv_heads
        problems = [f"{n} {what}" for n, what in ((self.num_heads, "attention heads"),
                                                  (self.intermediate_size, "MLP features")) if n % tp]
        if kvh % tp and tp % kvh:
            problems.append(f"{kvh} KV heads (nor is tp a multiple of them)")
        if problems:
            raise ValueError(f"tensor parallelism over {tp} devices does not divide the model's "
                             + ", ".join(problems))
        repeat = max(tp // kvh, 1)
        return TPShape(tp, self.num_heads // tp, kvh * repeat // tp, repeat, self.intermediate_size // tp)

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies (head_dim // 2,), with Llama-3 scaling applied when configured."""
        inv = 1.0 / (self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim))
        if self.rope_freq_factors is not None:
            return (inv / np.asarray(self.rope_freq_factors)).astype(np.float32)
        if self.rope_scaling is None:
            return inv.astype(np.float32)
        factor, low, high, original = self.rope_scaling
        low_wavelen = original / low
        high_wavelen = original / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (original / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(is_mid, mid, scaled).astype(np.float32)


def llama3_8b(num_layers: int = 32) -> LlamaConfig:
    """Meta-Llama-3.1-8B's shapes (its config.json), for benchmarks and GPU compiles with random weights; fewer
    layers keep a compile short without changing any layer."""
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=num_layers,
                       num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
                       rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=(8.0, 1.0, 4.0, 8192),
                       tie_word_embeddings=False)
