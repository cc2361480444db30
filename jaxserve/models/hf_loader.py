"""Load a Hugging Face Llama-family directory (Llama, Qwen2 / Qwen2.5, Qwen3 (dense), Mistral, Phi-3, Gemma 3's text
models): config.json and *.safetensors files."""

from __future__ import annotations

import json
import pathlib
from typing import Any, Callable

import jax
import numpy as np
from safetensors import safe_open

from jaxserve.models.config import LlamaConfig
from jaxserve.models.weights import params_from_hf

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3_text")


def load_hf_dir(path: str | pathlib.Path) -> tuple[LlamaConfig, dict[str, Any]]:
    root = pathlib.Path(path)
    raw = json.loads((root / "config.json").read_text())
    archs = raw.get("architectures") or ["LlamaForCausalLM"]
    image_text = raw.get("model_type") == "gemma3"  # gemma-3-4b and larger: the text model, images refused
    if image_text:  # whose logits transformers does not soft-cap (Gemma3ForConditionalGeneration)
        raw = {**raw.get("text_config", {}), "model_type": "gemma3_text", "final_logit_softcapping": None}
    if raw.get("model_type", "llama") not in MODEL_TYPES and "LlamaForCausalLM" not in archs:
        raise ValueError(f"{root}: unsupported model_type {raw.get('model_type')!r} (served: {', '.join(MODEL_TYPES)})")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError(f"{root}: Llama variants with attention/MLP biases are not supported")
    cfg = LlamaConfig.from_hf(raw)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{root}: no *.safetensors files")
    where: dict[str, pathlib.Path] = {}
    for file in files:
        with safe_open(str(file), framework="flax") as f:
            where.update({k: file for k in f.keys()})

    def tensor(name: str) -> np.ndarray:
        if image_text:
            name = _text_tower(name, where)
        if name not in where:
            raise ValueError(f"{root}: tensor {name!r} missing from the safetensors files")
        # framework='flax' reads bfloat16 too, which plain numpy cannot.
        with safe_open(str(where[name]), framework="flax") as f:
            return np.asarray(f.get_tensor(name), dtype=np.float32)

    if raw.get("model_type") == "phi3":
        tensor = phi3_split(cfg, tensor)
    return cfg, params_from_hf(cfg, tensor)


def _text_tower(name: str, where: dict[str, pathlib.Path]) -> str:
    """Where an image-text checkpoint keeps the text model's tensor `name`: under language_model.model (the hub's
    files) or model.language_model (as transformers 5 saves them); lm_head under language_model too."""
    inner = name.removeprefix("model.")
    candidates = (
        [f"model.language_model.{inner}", f"language_model.model.{inner}"]
        if inner != name
        else [name, f"language_model.{name}"]
    )
    return next((c for c in candidates if c in where), name)


def phi3_split(cfg: LlamaConfig, fused: Callable[[str], np.ndarray]) -> Callable[[str], np.ndarray]:
    """Phi-3's tensors by Llama's names: its qkv_proj holds q, k and v's rows, its gate_up_proj gate's then up's
    (each array of a GGUF file's quantized blocks split alike)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    rows = {
        "q_proj": ("qkv_proj", 0, q),
        "k_proj": ("qkv_proj", q, q + kv),
        "v_proj": ("qkv_proj", q + kv, q + 2 * kv),
        "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
        "up_proj": ("gate_up_proj", cfg.intermediate_size, 2 * cfg.intermediate_size),
    }

    def tensor(name: str) -> np.ndarray:
        parts = name.split(".")
        if len(parts) > 2 and parts[-2] in rows:
            source, lo, hi = rows[parts[-2]]
            return jax.tree.map(lambda w: w[lo:hi], fused(".".join([*parts[:-2], source, parts[-1]])))
        return fused(name)

    return tensor
