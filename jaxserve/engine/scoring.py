"""Scoring: the logits (or logprobs) of every prompt position in one pass, outside the serving path (it touches no KV
block, so it never competes with requests for the cache; it compiles per prompt-length bucket, which serving never
does)."""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine.batch import powers_of_two
from jaxserve.engine.sampling import Logprobs, logprobs_of
from jaxserve.models.attention import DenseCausalBackend, DenseCausalMetadata
from jaxserve.models.config import LlamaConfig
from jaxserve.models.llama import Llama, is_stacked, unstack_layers


@functools.lru_cache(maxsize=8)
def _forward(cfg: LlamaConfig, dtype: Any, unrolled: bool):
    model = Llama(cfg, DenseCausalBackend(cfg.uniform_window), dtype, unrolled=unrolled)

    def run(params, tokens, q_pos, k_pos):
        logits, _ = model.apply(params, tokens[None], q_pos[None], (), DenseCausalMetadata(k_pos))
        return logits[0]

    return jax.jit(run)


@functools.lru_cache(maxsize=8)
def _logprobs(cfg: LlamaConfig, dtype: Any, unrolled: bool):
    forward = _forward(cfg, dtype, unrolled)

    def run(params, tokens, q_pos, k_pos):
        logits = forward(params, tokens, q_pos, k_pos)[:-1].astype(jnp.float32)
        # each token's rank among the vocabulary's (1: the most likely), as vLLM's prompt_logprobs report it: by
        # the logits themselves (the softmax keeps their order)
        chosen = jnp.take_along_axis(logits, tokens[1:, None], axis=-1)
        return logprobs_of(logits, tokens[1:]), 1 + jnp.sum(logits > chosen, axis=-1)

    return jax.jit(run)


def _padded(ids: Sequence[int]) -> tuple[np.ndarray, ...]:
    """The prompt padded to a power of two (one program per length bucket), its query and key positions."""
    n = len(ids)
    t = powers_of_two(16, n)[-1]
    tokens = np.zeros(t, np.int32)
    tokens[:n] = ids
    pos = np.arange(t, dtype=np.int32)
    # padded queries see nothing (position -1) and padded keys are never visible (a position past every query)
    return tokens, np.where(pos < n, pos, -1), np.where(pos < n, pos, 2**30)


def _layout(cfg: LlamaConfig, params: Any) -> tuple[Any, bool]:
    """The params as the model reads them, and whether unrolled: as given, but per layer where layers differ
    (Gemma 3; a copy of the weights for this call when they came stacked)."""
    params = unstack_layers(params) if cfg.per_layer else params
    return params, not is_stacked(params)


def prompt_logits(cfg: LlamaConfig, params: Any, dtype: Any, ids: Sequence[int]) -> np.ndarray:
    """Logits [len(ids), vocab] (float32); params stacked or per layer (models/llama.py)."""
    params, unrolled = _layout(cfg, params)
    return np.asarray(_forward(cfg, dtype, unrolled)(params, *_padded(ids)))[: len(ids)]


def prompt_logprobs(cfg: LlamaConfig, params: Any, dtype: Any, ids: Sequence[int]) -> tuple[Logprobs, np.ndarray]:
    """Each prompt token's logprob given the tokens before it, and the sampling.MAX_LOGPROBS most likely there
    ([len(ids) - 1, ...]: the first token has none), and its rank there (1: the most likely); computed on the
    device, so only these come back."""
    params, unrolled = _layout(cfg, params)
    lp, ranks = _logprobs(cfg, dtype, unrolled)(params, *_padded(ids))
    n = len(ids) - 1
    return Logprobs(*(np.asarray(x)[:n] for x in lp)), np.asarray(ranks)[:n]
