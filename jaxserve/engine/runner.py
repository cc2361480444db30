"""The compiled step: one jitted call runs any mix of prefill chunks and decodes (a flat ragged batch), writes
their K/V into the paged cache, and samples one token per row on the device.

Programs are keyed by the (tokens, rows) bucket alone (batch.Buckets), so a warm-up compiles every program a
configuration can use before the first request, and nothing compiles while serving. The cache buffers are
donated so XLA updates them in place; a step that fails inside the compiled call leaves them deleted, and
`recover` allocates fresh ones (their contents are gone: the caller recomputes whatever they held).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxserve.engine import batch
from jaxserve.engine.kv_cache import RaggedPagedBackend, allocate_caches
from jaxserve.engine.sampling import sample
from jaxserve.models.config import LlamaConfig
from jaxserve.models.llama import Llama
from jaxserve.sharding import rows


class ModelRunner:
    def __init__(self, cfg: LlamaConfig, params: Any, dtype: jnp.dtype, *, num_blocks: int, block_size: int,
                 buckets: batch.Buckets, key_block: int, device: jax.Device | None = None):
        """device: where the weights, the cache and the step run (default: JAX's default device)."""
        self.device = device or jax.devices()[0]
        self.cfg, self.params, self.dtype = cfg, jax.device_put(params, self.device), dtype
        self.num_blocks, self.block_size, self.buckets, self.key_block = num_blocks, block_size, buckets, key_block
        self.model = Llama(cfg, RaggedPagedBackend(block_size, key_block), dtype)
        self.caches = self._allocate()
        self._step = jax.jit(self._forward_sample, donate_argnums=(1,))

    def _forward_sample(self, params, caches, a: batch.StepArrays):
        ctx = (a.slots, a.tables, a.decode_token, a.tile_tokens, a.tile_row)
        logits, caches = self.model.apply(params, a.token_ids[None], a.positions[None], caches, ctx,
                                          a.logits_index[None])
        return sample(logits[0], a.temperature, a.top_k, a.top_p, a.seeds, a.counters), caches

    def warmup(self, progress: bool = True) -> None:
        """Compile (or load from the persistent cache) every program serving can run."""
        shapes = self.buckets.shapes()
        for t, r in tqdm(shapes, desc="compile step programs", unit="program", disable=not progress):
            tokens, self.caches = self._step(self.params, self.caches, batch.empty(self.buckets, t, r, self.block_size))
            jax.block_until_ready(tokens)

    def execute(self, rows: Sequence[batch.Row]) -> np.ndarray:
        """Run the rows, update the cache, and return the sampled next token of each row."""
        return self.execute_arrays(batch.pack(rows, self.buckets, self.block_size))[: len(rows)]

    def execute_arrays(self, arrays: batch.StepArrays) -> np.ndarray:
        """Run a packed step; the sampled token of every row of its bucket, padding included."""
        tokens, self.caches = self._step(self.params, self.caches, arrays)
        return np.asarray(tokens)

    def land(self, k_rows: jax.Array, v_rows: jax.Array, slots: np.ndarray) -> None:
        """Write KV computed elsewhere (a prefill pool's rows, [layers, n, kvh, d]) into the cache's `slots`."""
        self.caches = rows.scatter(*self.caches, k_rows, v_rows, slots)

    @property
    def caches_lost(self) -> bool:
        return any(x.is_deleted() for x in self.caches)

    def recover(self) -> None:
        """Fresh (zeroed) cache buffers after a failed step deleted the donated ones."""
        if self.caches_lost:
            self.caches = self._allocate()

    def _allocate(self):
        with jax.default_device(self.device):
            return allocate_caches(self.cfg, self.num_blocks, self.block_size, self.dtype)
