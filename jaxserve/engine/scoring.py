"""Scoring: the logits of every prompt position in one pass, outside the serving path (it touches no KV block,
so it never competes with requests for the cache; it compiles per prompt-length bucket, which serving never
does)."""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import numpy as np

from jaxserve.engine.batch import powers_of_two
from jaxserve.models.attention import DenseCausalBackend, DenseCausalMetadata
from jaxserve.models.config import LlamaConfig
from jaxserve.models.llama import Llama, is_stacked


@functools.lru_cache(maxsize=8)
def _forward(cfg: LlamaConfig, dtype: Any, unrolled: bool):
    model = Llama(cfg, DenseCausalBackend(), dtype, unrolled=unrolled)

    def run(params, tokens, q_pos, k_pos):
        logits, _ = model.apply(params, tokens[None], q_pos[None], (), DenseCausalMetadata(k_pos))
        return logits[0]

    return jax.jit(run)


def prompt_logits(cfg: LlamaConfig, params: Any, dtype: Any, ids: Sequence[int]) -> np.ndarray:
    """Logits [len(ids), vocab] (float32); params stacked or per layer (models/llama.py)."""
    n = len(ids)
    t = powers_of_two(16, n)[-1]
    tokens = np.zeros(t, np.int32)
    tokens[:n] = ids
    pos = np.arange(t, dtype=np.int32)
    # padded queries see nothing (position -1) and padded keys are never visible (a position past every query)
    q_pos, k_pos = np.where(pos < n, pos, -1), np.where(pos < n, pos, 2**30)
    return np.asarray(_forward(cfg, dtype, not is_stacked(params))(params, tokens, q_pos, k_pos))[:n]
