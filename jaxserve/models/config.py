"""Llama-family model configuration, shared by every loader. Qwen2 / Qwen2.5 are Llama with biases on the q, k
and v projections (qkv_bias), Qwen3 with q/k norms instead; Mistral and Phi-3 are Llama (Phi-3's fused
projections are split on load). Gemma 3 is Llama with Gemma's norms, a scaled embedding, GeGLU, q/k norms and
sliding windows on some layers.

A sliding window (Mistral v0.1, Phi-3-mini, Gemma 3, Qwen with use_sliding_window) makes each query attend to the
keys of the last `sliding_window` positions. It covers every layer, or only `window_layers` (Gemma 3: five of
every six, whose RoPE base is rope_local_theta; Qwen: those from max_window_layers on)."""

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
class LongRoPE:
    """LongRoPE (Phi-3's 128K variants): inv_freq divided by one factor per frequency, the short ones at positions
    inside the original context, the long ones past it, and RoPE's cos and sin times `attention_factor`.
    transformers picks one set for a whole forward, by its last position; per position the two agree while a
    sequence stays inside the original context, and the choice does not depend on how requests are batched."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_context: int
    attention_factor: float

    @classmethod
    def make(
        cls, short: list[float], long: list[float], original: int, context: int, attention_factor: float | None = None
    ) -> "LongRoPE":
        """With the attention factor the paper suggests (transformers' and llama.cpp's) unless given."""
        scale = context / original
        if attention_factor is None:
            attention_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        return cls(tuple(map(float, short)), tuple(map(float, long)), int(original), float(attention_factor))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context stretched `factor` times (the paper's 0.1 ln(s) + 1)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


@dataclasses.dataclass(frozen=True)
class YaRN:
    """YaRN (Qwen2.5, Qwen3 and most long-context checkpoints since): a frequency making more than beta_fast turns
    over the original context keeps its value, one making fewer than beta_slow is divided by `factor`, and those
    between ramp linearly (by dimension); RoPE's cos and sin are multiplied by attention_factor. The same at
    every position, so a position's rotation never depends on the sequence around it."""

    factor: float
    original_context: int
    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # the ramp's ends rounded out to whole dimensions (transformers' default)

    @classmethod
    def make(
        cls,
        factor: float,
        original: int,
        attention_factor: float | None = None,
        mscale: float | None = None,
        mscale_all_dim: float | None = None,
        beta_fast: float | None = None,
        beta_slow: float | None = None,
        truncate: bool = True,
    ) -> "YaRN":
        """With transformers' defaults for what is not given (DeepSeek's mscale / mscale_all_dim pair included)."""
        if attention_factor is None:
            attention_factor = (
                yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                if mscale and mscale_all_dim
                else yarn_mscale(factor)
            )
        return cls(
            float(factor),
            int(original),
            float(attention_factor),
            float(beta_fast or 32.0),
            float(beta_slow or 1.0),
            bool(truncate),
        )

    def scale(self, inv: np.ndarray, theta: float) -> np.ndarray:
        """inv (head_dim // 2 RoPE inverse frequencies of base theta), interpolated as YaRN does."""
        dim = 2 * len(inv)

        def dimension(turns: float) -> float:  # the dimension whose frequency turns this often over the context
            return dim * math.log(self.original_context / (turns * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dimension(self.beta_fast), dimension(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = np.clip((np.arange(dim // 2) - low) / ((high - low) or 0.001), 0, 1)  # 0: kept, 1: interpolated
        return inv / self.factor * ramp + inv * (1 - ramp)


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
    long_rope: LongRoPE | None = None  # Phi-3's 128K variants
    yarn: YaRN | None = None  # Qwen2.5's, Qwen3's (and others') long contexts
    tie_word_embeddings: bool = True
    qkv_bias: bool = False  # Qwen2: the q, k and v projections add a bias
    qk_norm: bool = False  # Qwen3, Gemma 3: each head's q and k RMS-normed before RoPE
    sliding_window: int | None = None  # Mistral v0.1, Phi-3, Gemma 3: a query sees the last this many positions
    window_layers: tuple[int, ...] | None = None  # the layers that slide, when only some do (None: all)
    rope_local_theta: float | None = None  # the sliding layers' RoPE base, unscaled (None: rope_theta's)
    # Gemma 3:
    gemma_norms: bool = False  # RMSNorm scales by (1 + weight) in float32; attention and MLP outputs normed too
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size)
    activation: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    query_scale: float | None = None  # scores scaled by query_scale ** -0.5 (None: by head_dim ** -0.5)
    final_logit_softcap: float | None = None  # logits become cap * tanh(logits / cap)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "LlamaConfig":
        """Build from a Hugging Face config.json dict (transformers 5 writes RoPE's theta and scaling together as
        rope_parameters; earlier versions as rope_theta and rope_scaling)."""
        if cfg.get("model_type") == "gemma3_text":
            return cls._gemma3(cfg)
        rope = cfg.get("rope_parameters") or {}
        if float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ValueError("RoPE over part of each head (partial_rotary_factor, Phi-4-mini) is not supported")
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        rope_scaling = long_rope = yarn = None
        kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
        context = int(cfg.get("max_position_embeddings", 2048))
        theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
        original = (scaling or {}).get("original_max_position_embeddings") or cfg.get(
            "original_max_position_embeddings"
        )
        if kind in ("longrope", "su"):
            long_rope = LongRoPE.make(
                scaling["short_factor"], scaling["long_factor"], original, context, scaling.get("attention_factor")
            )
        elif kind == "yarn":
            original = int(original or context)
            factor = float(scaling.get("factor") or context / original)
            yarn = YaRN.make(
                factor,
                original,
                scaling.get("attention_factor"),
                scaling.get("mscale"),
                scaling.get("mscale_all_dim"),
                scaling.get("beta_fast"),
                scaling.get("beta_slow"),
                scaling.get("truncate", True),
            )
            context = max(context, int(original * factor))  # Qwen2.5 keeps 32,768 here and its original (vLLM's rule)
        elif kind == "dynamic":
            # dynamic NTK as vLLM serves it: the base fixed where transformers puts it for the stretched context
            # (factor x positions), so a position's rotation never depends on the sequence's length
            factor, d = (
                float(scaling["factor"]),
                int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])),
            )
            theta *= (factor * factor - (factor - 1)) ** (d / (d - 2))
            context = int(context * factor)
        elif scaling:
            if kind != "llama3":
                raise ValueError(f"unsupported rope_scaling type {kind!r} (llama3, longrope, yarn or dynamic)")
            rope_scaling = (
                float(scaling["factor"]),
                float(scaling["low_freq_factor"]),
                float(scaling["high_freq_factor"]),
                int(scaling["original_max_position_embeddings"]),
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        qwen = cfg.get("model_type") in ("qwen2", "qwen3")
        layers = int(cfg["num_hidden_layers"])
        window = cfg.get("sliding_window") if (not qwen or cfg.get("use_sliding_window")) else None
        # Qwen's windows cover the layers from max_window_layers on; transformers 5 writes layer_types
        sliding = tuple(range(int(cfg.get("max_window_layers", 0)) if qwen else 0, layers))
        if cfg.get("layer_types"):
            sliding = tuple(i for i, t in enumerate(cfg["layer_types"]) if t == "sliding_attention")
        window = int(window) if window and sliding and window < context else None
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            max_position_embeddings=context,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            long_rope=long_rope,
            yarn=yarn,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=cfg.get("model_type") == "qwen2",
            sliding_window=window,
            window_layers=sliding if window and len(sliding) < layers else None,
            qk_norm=cfg.get("model_type") == "qwen3",
        )

    @classmethod
    def _gemma3(cls, cfg: dict[str, Any]) -> "LlamaConfig":
        """Gemma 3's text model (model_type gemma3_text), with transformers' Gemma3TextConfig defaults."""
        if cfg.get("attn_logit_softcapping") or cfg.get("use_bidirectional_attention"):
            raise ValueError("Gemma 3 with attention soft-capping or bidirectional attention is not supported")
        if cfg.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported Gemma 3 activation {cfg['hidden_activation']!r}")
        layers = int(cfg.get("num_hidden_layers", 26))
        types = cfg.get("layer_types")
        sliding = (
            tuple(i for i, t in enumerate(types) if t == "sliding_attention")
            if types
            else gemma3_sliding(layers, int(cfg.get("sliding_window_pattern", GEMMA3_PATTERN)))
        )
        rope = cfg.get("rope_parameters") or {}
        full = dict(rope.get("full_attention") or {})
        scaling = cfg.get("rope_scaling") or full
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "linear"):
            raise ValueError(f"unsupported Gemma 3 rope scaling {kind!r} (default or linear)")
        d = int(cfg.get("head_dim", 256))
        factor = float(scaling.get("factor", 1.0)) if kind == "linear" else 1.0
        context = int(cfg.get("max_position_embeddings", 131072))
        window = cfg.get("sliding_window", 4096)
        base = cls(
            vocab_size=int(cfg.get("vocab_size", 262208)),
            hidden_size=int(cfg.get("hidden_size", 2304)),
            intermediate_size=int(cfg.get("intermediate_size", 9216)),
            num_layers=layers,
            num_heads=int(cfg.get("num_attention_heads", 8)),
            num_kv_heads=int(cfg.get("num_key_value_heads", 4)),
            head_dim=d,
            max_position_embeddings=context,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", 1e6))),
            rope_freq_factors=(factor,) * (d // 2) if factor != 1.0 else None,  # linear: every frequency / factor
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            sliding_window=int(window) if window and window < context else None,
        )
        local_theta = (rope.get("sliding_attention") or {}).get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
        return base.gemma3(
            sliding,
            float(local_theta),
            float(cfg.get("query_pre_attn_scalar", 256)),
            cfg.get("final_logit_softcapping"),
        )

    def gemma3(
        self, sliding: tuple[int, ...], local_theta: float, query_scale: float, softcap: float | None
    ) -> "LlamaConfig":
        """This config as Gemma 3's (both loaders' last step): its norms, q/k norms, embedding scale and GeGLU;
        the `sliding` layers with sliding_window and RoPE base local_theta (none: every layer global)."""
        return dataclasses.replace(
            self,
            window_layers=sliding if 0 < len(sliding) < self.num_layers else None,
            sliding_window=self.sliding_window if sliding else None,
            rope_local_theta=local_theta if sliding else None,
            query_scale=query_scale,
            final_logit_softcap=float(softcap) if softcap else None,
            gemma_norms=True,
            qk_norm=True,
            embed_scale=True,
            activation="gelu_tanh",
        )

    def local(self, layer: int) -> bool:
        """Is `layer` a sliding one (its window, and RoPE from rope_local_theta when set)?"""
        return self.window_layers is None or layer in self.window_layers

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: it sees every earlier position)."""
        return self.sliding_window if self.local(layer) else None

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer slides alike (blocks behind it can be released), else None."""
        return self.sliding_window if self.window_layers is None else None

    @property
    def per_layer(self) -> bool:
        """Do the layers differ (window, RoPE base)? Then the model runs unrolled, each layer its own code."""
        return self.window_layers is not None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "LlamaConfig":
        raw = json.loads(text)  # a field added since the text was written keeps its default
        for key in ("rope_scaling", "rope_freq_factors", "window_layers"):
            if raw.get(key) is not None:
                raw[key] = tuple(raw[key])
        if raw.get("long_rope") is not None:
            long = raw["long_rope"]
            raw["long_rope"] = LongRoPE(
                tuple(long["short_factor"]),
                tuple(long["long_factor"]),
                long["original_context"],
                long["attention_factor"],
            )
        if raw.get("yarn") is not None:
            raw["yarn"] = YaRN(**raw["yarn"])
        return cls(**raw)

    @property
    def rope_attention_factor(self) -> float:
        """What RoPE's cos and sin are multiplied by: LongRoPE's or YaRN's attention factor, else 1."""
        scaled = self.long_rope or self.yarn
        return scaled.attention_factor if scaled is not None else 1.0

    def split(self, tp: int) -> TPShape:
        """What one device of a tp-way tensor-parallel instance holds, or a ValueError naming what does not
        divide. When tp exceeds the KV heads each is repeated on tp / num_kv_heads devices."""
        if tp < 1:
            raise ValueError(f"tp must be a positive integer, got {tp}")
        kvh = self.num_kv_heads
        problems = [
            f"{n} {what}"
            for n, what in ((self.num_heads, "attention heads"), (self.intermediate_size, "MLP features"))
            if n % tp
        ]
        if kvh % tp and tp % kvh:
            problems.append(f"{kvh} KV heads (nor is tp a multiple of them)")
        if problems:
            raise ValueError(f"tensor parallelism over {tp} devices does not divide the model's " + ", ".join(problems))
        repeat = max(tp // kvh, 1)
        return TPShape(tp, self.num_heads // tp, kvh * repeat // tp, repeat, self.intermediate_size // tp)

    def inv_freq(self, local: bool = False, long: bool = False) -> np.ndarray:
        """RoPE inverse frequencies (head_dim // 2,), with Llama-3 scaling or YaRN applied when configured; `local`:
        a sliding layer's, from rope_local_theta, unscaled; with LongRoPE its short factors, or with `long` its long
        ones."""
        theta = self.rope_local_theta if local and self.rope_local_theta is not None else self.rope_theta
        inv = 1.0 / (theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim))
        if local and self.rope_local_theta is not None:
            return inv.astype(np.float32)
        if self.long_rope is not None:
            factors = self.long_rope.long_factor if long else self.long_rope.short_factor
            return (inv / np.asarray(factors)).astype(np.float32)
        if self.rope_freq_factors is not None:
            return (inv / np.asarray(self.rope_freq_factors)).astype(np.float32)
        if self.yarn is not None:
            return self.yarn.scale(inv, theta).astype(np.float32)
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


GEMMA3_PATTERN = 6  # Gemma 3's layers by default: five sliding, then a global one


def gemma3_sliding(layers: int, pattern: int = GEMMA3_PATTERN) -> tuple[int, ...]:
    """The sliding layers of Gemma 3's default layout: all but every `pattern`-th."""
    return tuple(i for i in range(layers) if (i + 1) % pattern)


def llama3_8b(num_layers: int = 32) -> LlamaConfig:
    """Meta-Llama-3.1-8B's shapes (its config.json), for benchmarks and GPU compiles with random weights; fewer
    layers keep a compile short without changing any layer."""
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=num_layers,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=(8.0, 1.0, 4.0, 8192),
        tie_word_embeddings=False,
    )
