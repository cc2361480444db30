"""Paged KV cache: fixed-size blocks, a free-block pool, per-request block tables, and the model's attention
backend that writes new K/V into the blocks and attends over them."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxserve.models.config import LlamaConfig
from jaxserve.pallas_kernels.paged_attention import paged_attention

# (k_all, v_all): every layer's cache stacked on a leading layer axis.
Caches = tuple[Float[Array, "layers slots kvh d"], Float[Array, "layers slots kvh d"]]

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
    """Attention backend over the paged cache; caches = (k_all, v_all) [layers, slots, kvh, d];
    ctx = (write_slots [b, t], block_tables [b, nblk], kv_lens [b]).

    Writes the new K/V into the rows of `layer` only (a scatter into the whole buffer, done in place when the
    caller donates it) and attends over that layer's slice."""

    block_size: int

    def __call__(self, q, k, v, positions, caches: Caches, layer, ctx):
        write_slots, block_tables, kv_lens = ctx
        b, t = write_slots.shape
        k_all, v_all = caches
        flat = write_slots.reshape(-1)
        k_all = k_all.at[layer, flat].set(k.reshape(b * t, *k.shape[2:]).astype(k_all.dtype))
        v_all = v_all.at[layer, flat].set(v.reshape(b * t, *v.shape[2:]).astype(v_all.dtype))
        out = paged_attention(q, k_all[layer], v_all[layer], block_tables, positions, kv_lens,
                              block_size=self.block_size)
        return out, (k_all, v_all)


def allocate_caches(cfg: LlamaConfig, num_blocks: int, block_size: int, dtype: jnp.dtype) -> Caches:
    """Zeroed (k_all, v_all), each [num_layers, num_blocks * block_size, kvh, d]."""
    shape = (cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
