"""Map Hugging Face-named Llama tensors onto the Flax parameter tree of `jaxserve.models.llama.Llama`.

The decoder layers run under `nn.scan`: `params['layers']` holds one layer's tree with every leaf stacked along a
leading layer axis (model.layers.{i}.* is row i)."""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from jaxserve.models.config import LlamaConfig
from jaxserve.models.quantize import GGMLBlocks

QKV = ("q_proj", "k_proj", "v_proj")
_LAYER_LINEARS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def params_from_hf(cfg: LlamaConfig, tensor: Callable[[str], np.ndarray]) -> dict[str, Any]:
    """Build `{'params': ...}` from `tensor(hf_name) -> [out, in]` arrays, or a GGUF file's blocks kept quantized
    (quantize.Quantized, each of its arrays [out, ..]). Linear weights transpose to kernels. A float tensor with
    a NaN or an infinity (a damaged file) is refused by name: it would be served as silent garbage."""
    read = tensor

    def tensor(name: str) -> np.ndarray:
        w = read(name)
        if isinstance(w, np.ndarray) and not np.isfinite(w).all():
            raise ValueError(
                f"tensor {name} holds {int(np.size(w) - np.isfinite(w).sum())} values that are not "
                "finite (NaN or infinity): the file is damaged"
            )
        return w

    def linear(name: str, bias: bool = False) -> dict[str, Any]:
        w = tensor(name)  # ggml's rows are the kernel's columns as they are
        out = {"kernel": w if isinstance(w, GGMLBlocks) else jax.tree.map(lambda a: np.ascontiguousarray(a.T), w)}
        if bias:
            out["bias"] = tensor(name.removesuffix("weight") + "bias")
        return out

    def norm(name: str) -> dict[str, np.ndarray]:
        return {"weight": tensor(name)}

    def layer(i: int) -> dict[str, Any]:
        prefix = f"model.layers.{i}"
        tree: dict[str, Any] = {
            "input_layernorm": norm(f"{prefix}.input_layernorm.weight"),
            "post_attention_layernorm": norm(f"{prefix}.post_attention_layernorm.weight"),
        }
        for block, names in _LAYER_LINEARS.items():
            tree[block] = {n: linear(f"{prefix}.{block}.{n}.weight", cfg.qkv_bias and n in QKV) for n in names}
        if cfg.qk_norm:
            tree["self_attn"] |= {n: norm(f"{prefix}.self_attn.{n}.weight") for n in ("q_norm", "k_norm")}
        if cfg.gemma_norms:
            tree |= {
                n: norm(f"{prefix}.{n}.weight") for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")
            }
        return tree

    params: dict[str, Any] = {"embed_tokens": {"embedding": tensor("model.embed_tokens.weight")}}
    per_layer = [layer(i) for i in range(cfg.num_layers)]
    params["layers"] = jax.tree.map(lambda *xs: np.stack(xs), *per_layer)
    params["norm"] = norm("model.norm.weight")
    if not cfg.tie_word_embeddings:
        params["lm_head"] = linear("lm_head.weight")
    return {"params": params}
