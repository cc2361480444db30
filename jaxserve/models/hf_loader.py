"""Load a Hugging Face Llama-family directory (Llama, Qwen2 / Qwen2.5): config.json and *.safetensors files."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
from safetensors import safe_open

from jaxserve.models.config import LlamaConfig
from jaxserve.models.weights import params_from_hf


def load_hf_dir(path: str | pathlib.Path) -> tuple[LlamaConfig, dict[str, Any]]:
    root = pathlib.Path(path)
    raw = json.loads((root / "config.json").read_text())
    archs = raw.get("architectures") or ["LlamaForCausalLM"]
    if raw.get("model_type", "llama") not in ("llama", "qwen2") and "LlamaForCausalLM" not in archs:
        raise ValueError(f"{root}: unsupported model_type {raw.get('model_type')!r} (llama and qwen2 are served)")
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
        if name not in where:
            raise ValueError(f"{root}: tensor {name!r} missing from the safetensors files")
        # framework='flax' reads bfloat16 too, which plain numpy cannot.
        with safe_open(str(where[name]), framework="flax") as f:
            return np.asarray(f.get_tensor(name), dtype=np.float32)

    return cfg, params_from_hf(cfg, tensor)
