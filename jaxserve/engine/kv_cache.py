"""The paged KV cache on the device: one (k, v) pair of arrays over every layer, and the model's attention backend
that writes a step's new K/V into the blocks the scheduler granted and attends over them. Which blocks a request
holds is decided by sched/kv_manager.py; block 0 is scratch (padding writes there).

A KV-parallel group (Medha's KVP) spreads one cache over `kvp` devices: block b lives on device b % kvp as its
local block b // kvp, so the blocks 0..kvp-1 are the devices' scratch blocks. Which blocks a request gets is the KV
manager's choice: by default they alternate devices (each holds about 1/kvp of every context and reads that much
per decode); with kvp_tokens a request fills one device's share before the next's. The step runs on
every device of the group with the same batch; each writes the new K/V it owns, attends over its own blocks, and
one all-gather of (output, log-sum-exp) per layer merges the partials: the query moves, the KV stays.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxserve.models.attention import AttentionMetadata
from jaxserve.models.config import LlamaConfig
from jaxserve.pallas_kernels.dispatch import Implementation
from jaxserve.pallas_kernels.paged_attention import held_pages
from jaxserve.pallas_kernels.ragged_paged_attention import ragged_paged_attention
from jaxserve.pallas_kernels.reference import NO_POSITION
from jaxserve.sharding.lse import merge_gathered
from jaxserve.sharding.mesh import SP
from jaxserve.sharding.rows import as_cache

# (k_all, v_all): every layer's cache stacked on a leading layer axis.
Caches = tuple[Float[Array, "layers slots kvh d"], Float[Array, "layers slots kvh d"]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedPagedMetadata(AttentionMetadata):
    """What RaggedPagedBackend reads: a flat ragged batch of t tokens in r rows (batch.StepArrays), in the
    group's global block numbers."""

    slots: Int[Array, " t"]
    """Where each token's K/V is written (padding: the scratch block)."""
    tables: Int[Array, "r w"]
    """Each row's block table."""
    decode_token: Int[Array, " r"]
    """The flat index of a decode row's token; t for other rows."""
    tile_tokens: Int[Array, "nt tq"]
    """Each attention tile's flat token indices; t where padded."""
    tile_row: Int[Array, " nt"]
    """The row each tile's tokens belong to."""
    page_pos: Int[Array, "r w"] | None = None
    """Each table entry's first key position, where a KV-parallel device lists its own blocks first
    (RaggedPagedBackend.local); None: entry c holds positions c * block_size on."""


@dataclasses.dataclass(frozen=True)
class RaggedPagedBackend:
    """The model's attention over the paged cache for a flat ragged batch.

    caches = (k [layers, slots, kvh, d], v [...]) (this device's share when kvp > 1, inside shard_map over the
    'sp' axis)."""

    block_size: int
    key_block: int
    kvp: int = 1
    implementation: Implementation | None = None  # of the attention kernel (default: the kernel on GPU only)
    window: int | None = None  # a sliding window's keys only (LlamaConfig.sliding_window)

    def __call__(self, q, k, v, positions, caches, layer, metadata: RaggedPagedMetadata):
        slots, tables = metadata.slots, metadata.tables
        k_all, v_all = caches
        k_new, v_new = k[0], v[0]
        if slots.shape[0] == 1:
            # XLA rewrites a one-row scatter as a dynamic-update-slice, which it then fuses twice (once for the
            # attention's flat view, once for the next layer) and copies the whole cache for; a second write, to
            # the scratch slot 0, keeps it a scatter, in place
            slots = jnp.concatenate([slots, jnp.zeros_like(slots)])
            k_new, v_new = (jnp.concatenate([x, jnp.zeros_like(x)]) for x in (k_new, v_new))
        k_all = k_all.at[layer, slots].set(as_cache(k_new, k_all.dtype))
        v_all = v_all.at[layer, slots].set(as_cache(v_new, v_all.dtype))
        # k_all[layer] with a traced layer would copy the layer's whole cache every step; the attention reads
        # the flattened cache instead (a free reshape), the layer's blocks numbered from layer * blocks_per_layer
        layers, slots_per_layer = k_all.shape[:2]
        flat = (layers * slots_per_layer, *k_all.shape[2:])
        tables = jnp.where(tables >= 0, tables + layer * (slots_per_layer // self.block_size), -1)
        out, lse = ragged_paged_attention(
            q[0],
            positions[0],
            k_all.reshape(flat),
            v_all.reshape(flat),
            tables,
            metadata.decode_token,
            metadata.tile_tokens,
            metadata.tile_row,
            block_size=self.block_size,
            key_block=self.key_block,
            window=self.window,
            page_pos=metadata.page_pos,
            implementation=self.implementation,
        )
        if self.kvp > 1:
            out, _ = merge_gathered(out, lse, SP)
        return out[None], (k_all, v_all)

    def local(self, metadata: RaggedPagedMetadata) -> RaggedPagedMetadata:
        """This device's view of a step's global slots and tables, made once per step before the layers (inside
        shard_map): the slots it owns as local slots (the others write to its scratch block); the blocks it holds
        as local ids, first in each table, with their positions (the attention walks this device's share of each
        context alone). One device's metadata is its own view."""
        if self.kvp == 1:
            return metadata
        me, bs = jax.lax.axis_index(SP), self.block_size
        slots, tables = metadata.slots, metadata.tables
        block = slots // bs
        slots = jnp.where(block % self.kvp == me, (block // self.kvp) * bs + slots % bs, slots % bs)
        local, page_pos = held_pages(tables // self.kvp, (tables >= 0) & (tables % self.kvp == me), bs, NO_POSITION)
        return dataclasses.replace(metadata, slots=slots, tables=local, page_pos=page_pos)


def cache_dtype(dtype: jnp.dtype, platform: str, requested: str = "auto") -> jnp.dtype:
    """The cache's dtype: `requested` (CacheConfig.kv_cache_dtype), or for auto the model's, but float32 on a CPU.
    XLA's CPU backend writes into a 16-bit float cache by converting the whole cache to float32 and back (seconds
    a step even for a tiny model)."""
    if requested != "auto":
        return jnp.dtype(jnp.float8_e4m3fn if requested == "fp8" else requested)
    return jnp.dtype(jnp.float32) if platform == "cpu" else jnp.dtype(dtype)


def allocate_caches(
    cfg: LlamaConfig, num_blocks: int, block_size: int, dtype: jnp.dtype, tp: int = 1, layers: int | None = None
) -> Caches:
    """Zeroed (k_all, v_all), each [layers, num_blocks * block_size, kvh, d]: kvh counts the KV heads of
    all tp devices (repeated heads once per device that holds them); layers: a pipeline stage's (default all)."""
    shape = (layers or cfg.num_layers, num_blocks * block_size, cfg.split(tp).cache_heads, cfg.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
