"""Paged KV cache: fixed-size blocks, a free-block pool, per-request block tables, and the model's attention
backend that writes new K/V into the blocks and attends over them."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxserve.models.config import LlamaConfig
from jaxserve.pallas_kernels.paged_attention import paged_attention

LayerCache = tuple[Float[Array, "slots kvh d"], Float[Array, "slots kvh d"]]

SCRATCH_BLOCK = 0  # never handed out: padded tokens write here, so real blocks are never touched by padding


class OutOfBlocks(RuntimeError):
    """The pool cannot hand out the blocks asked for; the caller preempts or waits."""


class BlockPool:
    """Free-block pool. Block ids index the cache's slot axis in units of `block_size` slots."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is scratch), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # LIFO: recently freed blocks are reused first.
        self._free = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Blocks any one request can ever hold."""
        return self.num_blocks - 1

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def grow(self, table: list[int], tokens: int) -> None:
        """Extend `table` in place so it covers `tokens` positions."""
        need = self.blocks_for(tokens) - len(table)
        if need > len(self._free):
            raise OutOfBlocks(f"need {need} KV blocks, {len(self._free)} free")
        for _ in range(max(need, 0)):
            table.append(self._free.pop())

    def release(self, table: list[int]) -> None:
        self._free.extend(reversed(table))
        table.clear()


@dataclasses.dataclass(frozen=True)
class PagedBackend:
    """Attention backend over the paged cache; ctx = (write_slots [b, t], block_tables [b, nblk], kv_lens [b])."""

    block_size: int

    def __call__(self, q, k, v, positions, cache: LayerCache, ctx):
        write_slots, block_tables, kv_lens = ctx
        b, t = write_slots.shape
        k_cache, v_cache = cache
        flat = write_slots.reshape(-1)
        k_cache = k_cache.at[flat].set(k.reshape(b * t, *k.shape[2:]).astype(k_cache.dtype))
        v_cache = v_cache.at[flat].set(v.reshape(b * t, *v.shape[2:]).astype(v_cache.dtype))
        out = paged_attention(q, k_cache, v_cache, block_tables, positions, kv_lens, block_size=self.block_size)
        return out, (k_cache, v_cache)


def allocate_caches(cfg: LlamaConfig, num_blocks: int, block_size: int, dtype: jnp.dtype) -> list[LayerCache]:
    shape = (num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)]
