"""Map Hugging Face-named Llama tensors onto the Flax parameter tree of `jaxserve.models.llama.Llama`."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from jaxserve.models.config import LlamaConfig

_LAYER_LINEARS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def params_from_hf(cfg: LlamaConfig, tensor: Callable[[str], np.ndarray]) -> dict[str, Any]:
    """Build `{'params': ...}` from `tensor(hf_name) -> [out, in]` arrays (Linear weights transpose to kernels)."""

    def linear(name: str) -> dict[str, np.ndarray]:
        return {"kernel": np.ascontiguousarray(tensor(name).T)}

    def norm(name: str) -> dict[str, np.ndarray]:
        return {"weight": tensor(name)}

    params: dict[str, Any] = {"embed_tokens": {"embedding": tensor("model.embed_tokens.weight")}}
    for i in range(cfg.num_layers):
        prefix = f"model.layers.{i}"
        layer: dict[str, Any] = {
            "input_layernorm": norm(f"{prefix}.input_layernorm.weight"),
            "post_attention_layernorm": norm(f"{prefix}.post_attention_layernorm.weight"),
        }
        for block, names in _LAYER_LINEARS.items():
            layer[block] = {n: linear(f"{prefix}.{block}.{n}.weight") for n in names}
        params[f"layers_{i}"] = layer
    params["norm"] = norm("model.norm.weight")
    if not cfg.tie_word_embeddings:
        params["lm_head"] = linear("lm_head.weight")
    return {"params": params}
