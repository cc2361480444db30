"""Llama-family decoder in Flax: RMSNorm, RoPE (Llama-3 scaling), GQA, SwiGLU, tied or untied embeddings.

The model does not know where its KV lives or how many devices hold the sequence: each layer hands its
rotated q/k/v to an attention backend, `backend(q, k, v, positions, layer_cache, ctx) -> (out, layer_cache)`.
The engine's paged-cache backend serves prefill chunks and decode on one device; the sharding layer's ring
backend runs the same layers over an SP group inside `shard_map`. Parameter names follow Hugging Face's so that
loaders map tensors one to one.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxserve.models.config import LlamaConfig

LayerCache = Any  # whatever the backend keeps per layer, e.g. (k, v) arrays


class AttentionBackend(Protocol):
    """Attention over wherever the KV lives. ctx holds the arrays shared by all layers (slots, tables, ...)."""

    def __call__(self, q: Float[Array, "b t h d"], k: Float[Array, "b t kvh d"], v: Float[Array, "b t kvh d"],
                 positions: Int[Array, "b t"], cache: LayerCache, ctx: Any
                 ) -> tuple[Float[Array, "b t h d"], LayerCache]: ...


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: Float[Array, "... e"]) -> Float[Array, "... e"]:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return weight * normed.astype(self.dtype)


def rope_cos_sin(cfg: LlamaConfig, positions: Int[Array, "b t"]) -> tuple[Float[Array, "b t d"], Float[Array, "b t d"]]:
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(cfg.inv_freq())
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: Float[Array, "b t h d"], cos: Float[Array, "b t d"], sin: Float[Array, "b t d"]) -> Float[Array, "b t h d"]:
    """Rotate-half RoPE (Hugging Face convention), computed in float32."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, :, None] + rotated * sin[:, :, None]).astype(x.dtype)


def _dense(features: int, dtype: jnp.dtype, name: str) -> nn.Dense:
    return nn.Dense(features, use_bias=False, dtype=dtype, param_dtype=dtype, name=name)


class Attention(nn.Module):
    cfg: LlamaConfig
    dtype: jnp.dtype
    backend: AttentionBackend

    @nn.compact
    def __call__(self, x, cos, sin, positions, cache: LayerCache, ctx):
        cfg = self.cfg
        b, t, _ = x.shape
        q = _dense(cfg.num_heads * cfg.head_dim, self.dtype, "q_proj")(x).reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = _dense(cfg.num_kv_heads * cfg.head_dim, self.dtype, "k_proj")(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = _dense(cfg.num_kv_heads * cfg.head_dim, self.dtype, "v_proj")(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, cache = self.backend(q, k, v, positions, cache, ctx)
        out = _dense(cfg.hidden_size, self.dtype, "o_proj")(out.reshape(b, t, -1).astype(self.dtype))
        return out, cache


class MLP(nn.Module):
    cfg: LlamaConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        gate = _dense(self.cfg.intermediate_size, self.dtype, "gate_proj")(x)
        up = _dense(self.cfg.intermediate_size, self.dtype, "up_proj")(x)
        return _dense(self.cfg.hidden_size, self.dtype, "down_proj")(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    cfg: LlamaConfig
    dtype: jnp.dtype
    backend: AttentionBackend

    @nn.compact
    def __call__(self, x, cos, sin, positions, cache, ctx):
        eps = self.cfg.rms_norm_eps
        h = RMSNorm(eps, self.dtype, name="input_layernorm")(x)
        attn, cache = Attention(self.cfg, self.dtype, self.backend, name="self_attn")(h, cos, sin, positions, cache, ctx)
        x = x + attn
        x = x + MLP(self.cfg, self.dtype, name="mlp")(RMSNorm(eps, self.dtype, name="post_attention_layernorm")(x))
        return x, cache


class Llama(nn.Module):
    """Decoder over the backend's KV.

    tokens/positions: the new tokens of each request. caches: one entry per layer for the backend; ctx: the
    backend's shared arrays. logits_index: which new token's logits to return per request; None returns all.
    """

    cfg: LlamaConfig
    backend: AttentionBackend
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(
        self,
        tokens: Int[Array, "b t"],
        positions: Int[Array, "b t"],
        caches: Sequence[LayerCache],
        ctx: Any,
        logits_index: Int[Array, "b"] | None = None,
    ) -> tuple[Float[Array, "b n vocab"], list[LayerCache]]:
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, param_dtype=self.dtype, name="embed_tokens")
        x = embed(tokens)
        cos, sin = rope_cos_sin(cfg, positions)
        new_caches = []
        for i in range(cfg.num_layers):
            x, cache = DecoderLayer(cfg, self.dtype, self.backend, name=f"layers_{i}")(
                x, cos, sin, positions, caches[i], ctx)
            new_caches.append(cache)
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)
        x = RMSNorm(cfg.rms_norm_eps, self.dtype, name="norm")(x)
        if cfg.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = _dense(cfg.vocab_size, self.dtype, "lm_head")(x)
        return logits.astype(jnp.float32), new_caches
