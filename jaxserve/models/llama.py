"""Llama-family decoder in Flax: RMSNorm, RoPE (Llama-3 scaling), GQA, SwiGLU, tied or untied embeddings; with
Gemma 3's differences where its config asks (config.py: Gemma's norms, q/k norms, GeGLU, a scaled embedding,
per-layer windows and RoPE bases, logit soft-capping).

The model does not know where its KV lives or how many devices hold the sequence: each layer hands its
rotated q/k/v to an attention backend (models/attention.py),
`backend(q, k, v, positions, caches, layer, metadata) -> (out, caches)`. The engine's paged-cache backend
serves prefill chunks and decode on one device; the sharding layer's ring backend runs the same layers over an
SP group inside `shard_map`. With `tp_axis` (inside shard_map) each device holds its tensor-parallel share of
the heads and MLP features (sharding/tp.py) and the two row-split projections are summed over that axis.
Parameter names follow Hugging Face's so that loaders map tensors one to one. A linear kernel and the embedding
table may be kept quantized (models/quantize.py); the layers read either.

The layers run one of two ways (`unrolled`):
- scanned: `nn.scan` over one `DecoderLayer`, so a compile does not grow with depth. `params['layers']` is the
  layer's parameter tree with every leaf stacked along a leading layer axis (how loaders and checkpoints keep
  it). Each iteration reads its layer by a dynamic slice, which a GPU materialises as a copy of the weights.
- unrolled: a Python loop over per-layer parameter trees `params['layers_{i}']` (`unstack_layers`), so each
  GEMM reads its weights in place. Compiles grow with depth. Layers that differ (Gemma 3's windows and RoPE
  bases: LlamaConfig.per_layer) run this way only, each with its own window in its backend.
Either way the backend's caches (every array with a leading layer axis) ride in the carry, not as scanned inputs
and outputs, so XLA updates the (donated) buffers in place; each layer gets its index (traced when scanned,
static when unrolled) and touches only its own slice.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxserve.models.attention import (
    AttentionBackend,
    AttentionMetadata,
    Caches,
    DenseCausalBackend,
    DenseCausalMetadata,
)
from jaxserve.models import quantize
from jaxserve.models.config import LlamaConfig
from jaxserve.models.quantize import Quantized


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype
    gemma: bool = False  # Gemma's: scaled by (1 + weight), in float32 before the cast

    @nn.compact
    def __call__(self, x: Float[Array, "... e"]) -> Float[Array, "... e"]:
        init = nn.initializers.zeros if self.gemma else nn.initializers.ones
        weight = self.param("weight", init, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.gemma:
            return (normed * (1.0 + weight.astype(jnp.float32))).astype(self.dtype)
        return weight * normed.astype(self.dtype)


def rope_cos_sin(
    cfg: LlamaConfig, positions: Int[Array, "b t"], local: bool = False
) -> tuple[Float[Array, "b t d"], Float[Array, "b t d"]]:
    """RoPE's cos and sin at each position: a sliding layer's with `local` (LlamaConfig.inv_freq); with LongRoPE,
    a position past the original context by the long factors; times LongRoPE's or YaRN's attention factor."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(cfg.inv_freq(local))
    if cfg.long_rope is not None:
        long = positions[..., None].astype(jnp.float32) * jnp.asarray(cfg.inv_freq(long=True))
        angles = jnp.where(positions[..., None] >= cfg.long_rope.original_context, long, angles)
    angles = jnp.concatenate([angles, angles], axis=-1)
    factor = 1.0 if local and cfg.rope_local_theta is not None else cfg.rope_attention_factor
    if factor == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rope(
    x: Float[Array, "b t h d"], cos: Float[Array, "b t d"], sin: Float[Array, "b t d"]
) -> Float[Array, "b t h d"]:
    """Rotate-half RoPE (Hugging Face convention), computed in float32."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, :, None] + rotated * sin[:, :, None]).astype(x.dtype)


def _weight(module: nn.Module, name: str, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array | Quantized:
    """A weight as given (float, or kept quantized: models/quantize.py), or a fresh one when initialising."""
    if module.has_variable("params", name):
        return module.get_variable("params", name)
    return module.param(name, nn.initializers.lecun_normal(), shape, dtype)


class Linear(nn.Module):
    """nn.Dense's parameters ('kernel' [in, out], 'bias'), whose kernel may be kept quantized."""

    features: int
    dtype: jnp.dtype
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: Float[Array, "... k"]) -> Float[Array, "... n"]:
        x = x.astype(self.dtype)
        y = quantize.dense(x, _weight(self, "kernel", (x.shape[-1], self.features), self.dtype))
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype).astype(self.dtype)
        return y


class Embed(nn.Module):
    """nn.Embed's table ('embedding' [vocab, e]), which may be kept quantized: rows looked up, or the tied LM head."""

    num_embeddings: int
    features: int
    dtype: jnp.dtype

    def setup(self):
        self.embedding = _weight(self, "embedding", (self.num_embeddings, self.features), self.dtype)

    def __call__(self, ids: Int[Array, "..."]) -> Float[Array, "... e"]:
        return quantize.take(self.embedding, ids, self.dtype)

    def attend(self, x: Float[Array, "... e"]) -> Float[Array, "... vocab"]:
        return quantize.attend(x.astype(self.dtype), self.embedding)


def _dense(features: int, dtype: jnp.dtype, name: str, bias: bool = False) -> Linear:
    return Linear(features, dtype, bias, name=name)


def _shared_input(
    module: nn.Module, x: Float[Array, "... k"], linears: list[tuple[int, str, bool]]
) -> list[Float[Array, "... n"]]:
    """x through the Linears (features, name, bias) of `module` that read it alike (q/k/v, gate/up): in one call
    where their kernels allow it (quantize.dense_shared: ggml's blocks), each Linear by itself otherwise."""
    params = module.variables.get("params", {})
    kernels = [params.get(name, {}).get("kernel") for _, name, _ in linears]
    if any(not isinstance(w, quantize.GGMLBlocks) for w in kernels):
        return [_dense(features, module.dtype, name, bias)(x) for features, name, bias in linears]
    ys = quantize.dense_shared(x.astype(module.dtype), kernels)
    return [y + params[name]["bias"].astype(y.dtype) if bias else y for y, (_, name, bias) in zip(ys, linears)]


def _split(cfg: LlamaConfig, tp_axis: str | None):
    """This device's share of the layer: all of it, or its tensor-parallel slice inside shard_map."""
    return cfg.split(jax.lax.axis_size(tp_axis) if tp_axis else 1)


def _reduce(x, tp_axis: str | None):
    """Sum a row-split projection's partial outputs over the tensor-parallel devices."""
    return jax.lax.psum(x, tp_axis) if tp_axis else x


class Attention(nn.Module):
    cfg: LlamaConfig
    dtype: jnp.dtype
    backend: AttentionBackend
    tp_axis: str | None = None

    @nn.compact
    def __call__(self, x, cos, sin, positions, caches: Caches, layer, metadata: AttentionMetadata):
        cfg, share = self.cfg, _split(self.cfg, self.tp_axis)
        b, t, _ = x.shape
        qh, kvh, bias = share.heads * cfg.head_dim, share.kv_heads * cfg.head_dim, cfg.qkv_bias
        q, k, v = _shared_input(self, x, [(qh, "q_proj", bias), (kvh, "k_proj", bias), (kvh, "v_proj", bias)])
        q = q.reshape(b, t, share.heads, cfg.head_dim)
        k, v = (a.reshape(b, t, share.kv_heads, cfg.head_dim) for a in (k, v))
        if cfg.qk_norm:
            q = RMSNorm(cfg.rms_norm_eps, self.dtype, cfg.gemma_norms, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, self.dtype, cfg.gemma_norms, name="k_norm")(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cfg.query_scale is not None and cfg.query_scale != cfg.head_dim:  # the kernels scale by head_dim ** -0.5
            q = (q.astype(jnp.float32) * (cfg.head_dim / cfg.query_scale) ** 0.5).astype(q.dtype)
        out, caches = self.backend(q, k, v, positions, caches, layer, metadata)
        out = _dense(cfg.hidden_size, self.dtype, "o_proj")(out.reshape(b, t, -1).astype(self.dtype))
        return _reduce(out, self.tp_axis), caches


class MLP(nn.Module):
    cfg: LlamaConfig
    dtype: jnp.dtype
    tp_axis: str | None = None

    @nn.compact
    def __call__(self, x):
        features = _split(self.cfg, self.tp_axis).intermediate
        gate, up = _shared_input(self, x, [(features, "gate_proj", False), (features, "up_proj", False)])
        act = nn.silu if self.cfg.activation == "silu" else functools.partial(nn.gelu, approximate=True)
        return _reduce(_dense(self.cfg.hidden_size, self.dtype, "down_proj")(act(gate) * up), self.tp_axis)


class DecoderLayer(nn.Module):
    """One layer as a scan body: carry (x, caches), scanned input the layer index, the rest broadcast."""

    cfg: LlamaConfig
    dtype: jnp.dtype
    backend: AttentionBackend
    tp_axis: str | None = None

    @nn.compact
    def __call__(self, carry, layer, cos, sin, positions, metadata: AttentionMetadata):
        x, caches = carry
        eps, gemma = self.cfg.rms_norm_eps, self.cfg.gemma_norms
        norm = functools.partial(RMSNorm, eps, self.dtype, gemma)
        attn, caches = Attention(self.cfg, self.dtype, self.backend, self.tp_axis, name="self_attn")(
            norm(name="input_layernorm")(x), cos, sin, positions, caches, layer, metadata
        )
        if gemma:  # Gemma norms each block's output too, and names the MLP's input norm pre_feedforward
            attn = norm(name="post_attention_layernorm")(attn)
        x = x + attn
        mlp = MLP(self.cfg, self.dtype, self.tp_axis, name="mlp")(
            norm(name="pre_feedforward_layernorm" if gemma else "post_attention_layernorm")(x)
        )
        if gemma:
            mlp = norm(name="post_feedforward_layernorm")(mlp)
        return (x + mlp, caches), None


# Parameters stacked on axis 0 (one slice per layer, each initialised with its own rng); the layer index is
# the scanned input; cos/sin/positions/metadata are the same for every layer.
ScannedLayers = nn.scan(
    DecoderLayer,
    variable_axes={"params": 0},
    split_rngs={"params": True},
    in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
)


def is_stacked(params: Any) -> bool:
    """Are the layers' parameters stacked (the scanned model's layout) rather than per layer?"""
    return "layers" in params["params"]


def unstack_layers(params: Any) -> Any:
    """The stacked `{'params': {..., 'layers': ...}}` tree as per-layer trees `layers_0`, `layers_1`, ... (what the
    unrolled model reads; a copy of the layers' weights). A tree already per layer is returned as it is."""
    if not is_stacked(params):
        return params
    inner = dict(params["params"])
    stacked = inner.pop("layers")
    count = jax.tree.leaves(stacked)[0].shape[0]
    inner.update({f"layers_{i}": jax.tree.map(lambda x: x[i], stacked) for i in range(count)})  # noqa: B023
    return {"params": inner}


class Llama(nn.Module):
    """Decoder over the backend's KV.

    tokens/positions: the new tokens of each request. caches: the backend's KV pytree (leading layer axis);
    metadata: the backend's arrays shared by all layers. logits_index [b, n]: which new tokens' logits to return
    per request (indices into the t axis), giving [b, n, vocab]; None returns all [b, t, vocab]. Logits are
    float32.

    A pipeline stage runs `layers` = [first, last) alone, its caches holding those layers: a stage after the first
    takes the previous stage's hidden states [b, t, e] in place of tokens, and a stage before the last returns
    its hidden states (every token's; logits_index is ignored) in place of logits.
    """

    cfg: LlamaConfig
    backend: AttentionBackend
    dtype: jnp.dtype = jnp.float32
    tp_axis: str | None = None  # inside shard_map: the mesh axis over which layers are tensor-parallel
    unrolled: bool = False  # per-layer parameters (unstack_layers) in a Python loop, instead of the scan
    layers: tuple[int, int] | None = None  # a pipeline stage's [first, last) (None: every layer)

    @nn.compact
    def __call__(
        self,
        tokens: Int[Array, "b t"] | Float[Array, "b t e"],
        positions: Int[Array, "b t"],
        caches: Caches,
        metadata: AttentionMetadata,
        logits_index: Int[Array, "b n"] | None = None,
    ) -> tuple[Float[Array, "b n vocab"] | Float[Array, "b t e"], Caches]:
        cfg = self.cfg
        first, last = self.layers or (0, cfg.num_layers)
        if self.layers is not None and not self.unrolled:
            raise ValueError("a pipeline stage runs its layers unrolled (stage_params gives them per layer)")
        embed = Embed(cfg.vocab_size, cfg.hidden_size, self.dtype, name="embed_tokens")
        x = tokens
        if first == 0:
            x = embed(tokens)
            if cfg.embed_scale:  # Gemma: sqrt(hidden_size), rounded to the model's dtype as transformers does
                x = x * jnp.asarray(cfg.hidden_size**0.5, self.dtype)
        cos, sin = rope_cos_sin(cfg, positions)
        if self.unrolled:
            local = rope_cos_sin(cfg, positions, local=True) if cfg.rope_local_theta is not None else (cos, sin)
            for i in range(first, last):
                layer = DecoderLayer(cfg, self.dtype, self._backend(i), self.tp_axis, name=f"layers_{i}")
                (x, caches), _ = layer(
                    (x, caches), i - first, *(local if cfg.local(i) else (cos, sin)), positions, metadata
                )
        else:
            if (cfg.per_layer or cfg.rope_local_theta is not None) and not self.is_initializing():
                raise ValueError("layers that differ in window or RoPE base (Gemma 3) run unrolled")
            layers = ScannedLayers(cfg, self.dtype, self.backend, self.tp_axis, name="layers")
            (x, caches), _ = layers(
                (x, caches), jnp.arange(last - first, dtype=jnp.int32), cos, sin, positions, metadata
            )
        if last < cfg.num_layers:
            return x, caches
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, :, None], axis=1)
        x = RMSNorm(cfg.rms_norm_eps, self.dtype, cfg.gemma_norms, name="norm")(x)
        if cfg.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = _dense(cfg.vocab_size, self.dtype, "lm_head")(x)
        logits = logits.astype(jnp.float32)
        if cfg.final_logit_softcap:
            logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
        return logits, caches

    def _backend(self, layer: int) -> AttentionBackend:
        """Layer `layer`'s backend: the model's, or with the layer's own sliding window where layers differ."""
        if not self.cfg.per_layer:
            return self.backend
        if not hasattr(self.backend, "window"):
            raise ValueError(
                f"{type(self.backend).__name__} has no sliding window: it cannot serve layers whose "
                "windows differ (Gemma 3)"
            )
        return dataclasses.replace(self.backend, window=self.cfg.layer_window(layer))


def stage_layers(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Each pipeline stage's [first, last) layers: as even as they split (sizes differ by one at most)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"{num_layers} layers do not split into {stages} pipeline stages")
    bounds = [num_layers * s // stages for s in range(stages + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _layer(x: jax.Array, i: int) -> jax.Array:
    return x[i]


def stage_params(params: Any, cfg: LlamaConfig, layers: tuple[int, int]) -> Any:
    """The parameters a stage running `layers` reads, per layer (unstack_layers' layout): the embedding on the
    first stage (and the last, where tied), its layers, the final norm and head on the last."""
    first, last = layers
    inner = dict(params["params"])
    if "layers" in inner:  # stacked: slice out this stage's layers only
        stacked = inner.pop("layers")
        inner.update({f"layers_{i}": jax.tree.map(functools.partial(_layer, i=i), stacked) for i in range(first, last)})
    keep = {f"layers_{i}" for i in range(first, last)}
    if first == 0 or (last == cfg.num_layers and cfg.tie_word_embeddings):
        keep.add("embed_tokens")
    if last == cfg.num_layers:
        keep |= {"norm", "lm_head"}
    return {"params": {k: v for k, v in inner.items() if k in keep}}


def init_params(cfg: LlamaConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32, unrolled: bool = False) -> Any:
    """Flax's initial parameters: random matrices, norms at 1 (Gemma's weights at 0); stacked layers unless
    unrolled."""
    one = jnp.zeros((1, 1), jnp.int32)
    model = Llama(cfg, DenseCausalBackend(), dtype, unrolled=unrolled)
    return model.init(key, one, one, (), DenseCausalMetadata(one[0]))


def param_shapes(cfg: LlamaConfig, dtype: jnp.dtype, unrolled: bool = False) -> Any:
    """The parameters' shapes and dtypes (jax.ShapeDtypeStruct leaves), nothing allocated."""
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), dtype, unrolled))
