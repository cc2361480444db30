"""Compiled step functions: one forward + sampling over a padded batch, jitted once per shape bucket.

A step takes rows of new tokens (a prefill chunk or one decode token per request), writes their K/V into the
paged cache and returns one sampled token per row. Shapes are padded to powers of two (batch, new tokens,
context blocks) so a handful of compiled programs serve every request mix; the cache buffers are donated so
XLA updates them in place.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine.kv_cache import SCRATCH_BLOCK, LayerCache
from jaxserve.engine.sampling import SamplingParams, sample
from jaxserve.models.llama import Llama


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


@dataclasses.dataclass
class Row:
    """One request's part of a step: `tokens` at positions start..start+len-1, cached in `block_table`."""

    tokens: Sequence[int]
    start: int
    block_table: Sequence[int]
    params: SamplingParams
    seed: int
    counter: int  # tokens this request has generated so far: the sampler's per-request step


class StepRunner:
    def __init__(self, model: Llama, params: Any, caches: list[LayerCache], block_size: int,
                 min_token_bucket: int = 16, min_block_bucket: int = 4):
        self.model = model
        self.params = params
        self.caches = caches
        self.block_size = block_size
        self.min_token_bucket = min_token_bucket
        self.min_block_bucket = min_block_bucket
        self._step = jax.jit(self._forward_sample, static_argnames=("all_greedy",), donate_argnums=(1,))
        self._logits = jax.jit(self._forward_logits, donate_argnums=(1,))

    def _forward_sample(self, params, caches, arrays, sampling, *, all_greedy):
        logits, caches = self._apply(params, caches, arrays)
        tokens = sample(logits[:, 0], *sampling, all_greedy=all_greedy)
        return tokens, caches

    def _apply(self, params, caches, arrays, all_logits: bool = False):
        tokens, positions, slots, tables, kv_lens, last = arrays
        return self.model.apply(params, tokens, positions, caches, (slots, tables, kv_lens),
                                None if all_logits else last)

    def _forward_logits(self, params, caches, arrays):
        return self._apply(params, caches, arrays, all_logits=True)

    def _pack(self, rows: Sequence[Row]) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
        bs = self.block_size
        b = bucket(len(rows))
        t = bucket(max(len(r.tokens) for r in rows), 1 if all(len(r.tokens) == 1 for r in rows) else self.min_token_bucket)
        nblk = bucket(max(-(-(r.start + len(r.tokens)) // bs) for r in rows), self.min_block_bucket)
        tokens = np.zeros((b, t), np.int32)
        positions = np.zeros((b, t), np.int32)
        slots = np.full((b, t), SCRATCH_BLOCK * bs, np.int32)
        tables = np.full((b, nblk), SCRATCH_BLOCK, np.int32)
        kv_lens = np.zeros((b,), np.int32)
        last = np.zeros((b,), np.int32)
        temperature = np.zeros((b,), np.float32)
        top_k = np.zeros((b,), np.int32)
        top_p = np.ones((b,), np.float32)
        seeds = np.zeros((b,), np.uint32)
        counters = np.zeros((b,), np.int32)
        for i, r in enumerate(rows):
            n = len(r.tokens)
            pos = np.arange(r.start, r.start + n)
            table = np.asarray(r.block_table, np.int32)
            tokens[i, :n] = r.tokens
            positions[i, :n] = pos
            slots[i, :n] = table[pos // bs] * bs + pos % bs
            used = min(len(table), nblk)  # a table may hold blocks reserved beyond this step
            tables[i, :used] = table[:used]
            kv_lens[i] = r.start + n
            last[i] = n - 1
            temperature[i] = r.params.temperature
            top_k[i] = r.params.top_k
            top_p[i] = r.params.top_p
            seeds[i] = r.seed
            counters[i] = r.counter
        return (tokens, positions, slots, tables, kv_lens, last), (temperature, top_k, top_p, seeds, counters)

    def step(self, rows: Sequence[Row]) -> np.ndarray:
        """Run the rows, update the cache, and return the sampled next token of each row."""
        arrays, sampling = self._pack(rows)
        all_greedy = all(r.params.greedy for r in rows)
        tokens, self.caches = self._step(self.params, self.caches, arrays, sampling, all_greedy=all_greedy)
        return np.asarray(tokens)[: len(rows)]

    def logits(self, row: Row) -> np.ndarray:
        """Logits [len(tokens), vocab] of every token of one row (the cache is updated as by `step`)."""
        arrays, _ = self._pack([row])
        logits, self.caches = self._logits(self.params, self.caches, arrays)
        return np.asarray(logits)[0, : len(row.tokens)]
