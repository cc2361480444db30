"""Split-KV paged decode attention in Pallas: one new query per request over its paged cache.

Same signature and semantics as `reference.paged_decode_attention`: split i covers block-table columns
[i * nblk / n, (i + 1) * nblk / n), and returns per-split partials (o, lse) for `merge_attention`. Grid over
(request, KV head, split); a program holds the KV head's whole query group as one [g, d] tile, so each cached
K/V row is read once for all of its query heads.

Block tables: `pltpu.PrefetchScalarGridSpec` (block ids in SMEM driving the index maps) is TPU-only, and
gathering the pages in the wrapper would write a copy of every request's KV before reading it again, doubling
the HBM traffic of a memory-bound kernel. So the table and the cache (one KV head's [slots, d] view) are plain
inputs. Each loop step reads `key_block / block_size` block ids and gathers their rows through an index vector
into one [key_block, d] tile (interpret mode and the Triton lowering both load through an index array), so one
dot covers several pages instead of one 16-token page per step. Steps past kv_len are never taken.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from jaxserve.pallas_kernels import common


def _kernel(kv_len_ref, table_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, block_size: int, pages: int, scale: float):
    per_split = table_ref.shape[0]
    kv_len = kv_len_ref[0]
    first = pl.program_id(2) * per_split  # first block-table column of this split
    used = lax.div(kv_len + block_size - 1, block_size) - first  # this split's blocks holding tokens < kv_len
    steps = jnp.clip(lax.div(used + pages - 1, pages), 0, per_split // pages)
    q = q_ref[...]  # [group, d]
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    key_block = pages * block_size

    def body(j, carry):
        blocks = table_ref[pl.ds(pl.multiple_of(j * pages, pages), pages)]  # [pages]
        slots = (jnp.maximum(blocks, 0)[:, None] * block_size + offsets[None, :]).reshape(key_block)
        pos = (first + j * pages) * block_size + jnp.arange(key_block, dtype=jnp.int32)
        s = common.scores(q, k_ref[slots, :].astype(q.dtype), scale)  # the cache may be narrower
        s = jnp.where(pos[None, :] < kv_len, s, -jnp.inf)
        return common.online_softmax(carry, s, v_ref[slots, :].astype(q.dtype))

    o, lse = common.finish(lax.fori_loop(0, steps, body, common.init_carry(*q.shape)))
    o_ref[...] = o
    lse_ref[...] = lse


# block_size: a power of two on GPU (Triton tiles). key_block: tokens per loop step (a power of two >= 16), cut
# to what a split's columns divide into; 128 is a first guess, to tune with tools/bench/attention.py on H100.
@functools.partial(jax.jit, static_argnames=("block_size", "num_splits", "key_block", "interpret"))
def paged_decode_attention(
    q: Float[Array, "b h d"],
    k_cache: Float[Array, "slots kvh d"],
    v_cache: Float[Array, "slots kvh d"],
    block_tables: Int[Array, "b nblk"],
    kv_lens: Int[Array, " b"],
    *,
    block_size: int,
    num_splits: int,
    key_block: int = 128,
    interpret: bool = False,
) -> tuple[Float[Array, "b n h d"], Float[Array, "b n h"]]:
    """Per-split float32 partial outputs and log-sum-exps of each request's query over its first kv_lens tokens."""
    b, h, d = q.shape
    kvh = k_cache.shape[1]
    group = h // kvh
    nblk = block_tables.shape[1]
    if nblk % num_splits:
        raise ValueError(f"block table width {nblk} is not a multiple of num_splits {num_splits}")
    per_split = nblk // num_splits
    pages = math.gcd(per_split, max(key_block // block_size, 1))  # whole pages per step, dividing a split
    # The query group is padded to a dot tile (>= 16 rows on GPU); padded rows are computed and dropped.
    g_pad, d_pad = common.tile(group, 16), pl.next_power_of_2(d)
    q = common.pad_axis(common.pad_axis(q.reshape(b, kvh, group, d), 2, g_pad), 3, d_pad)
    k_cache, v_cache = common.pad_axis(k_cache, 2, d_pad), common.pad_axis(v_cache, 2, d_pad)
    slots, size = k_cache.shape[0], jnp.dtype(k_cache.dtype).itemsize
    stages = common.pipeline_stages(stage_bytes=2 * pages * block_size * d_pad * size, fixed_bytes=g_pad * d_pad * size)
    cache_spec = pl.BlockSpec((slots, None, d_pad), lambda i, kh, sp: (0, kh, 0))
    o, lse = pl.pallas_call(
        functools.partial(_kernel, block_size=block_size, pages=pages, scale=d**-0.5),
        grid=(b, kvh, num_splits),
        in_specs=[
            pl.BlockSpec((1,), lambda i, kh, sp: (i,)),
            pl.BlockSpec((None, None, per_split), lambda i, kh, sp: (i, sp, 0)),
            pl.BlockSpec((None, None, g_pad, d_pad), lambda i, kh, sp: (i, kh, 0, 0)),
            cache_spec,
            cache_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, g_pad, d_pad), lambda i, kh, sp: (i, sp, kh, 0, 0)),
            pl.BlockSpec((None, None, None, g_pad), lambda i, kh, sp: (i, sp, kh, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, num_splits, kvh, g_pad, d_pad), jnp.float32),
            jax.ShapeDtypeStruct((b, num_splits, kvh, g_pad), jnp.float32),
        ],
        compiler_params=common.gpu_params(d_pad, interpret, stages),
        interpret=interpret,
        name="paged_decode_attention",
    )(kv_lens.astype(jnp.int32), block_tables.astype(jnp.int32).reshape(b, num_splits, per_split), q, k_cache, v_cache)
    o = o[:, :, :, :group, :d].reshape(b, num_splits, h, d)
    return o, lse[:, :, :, :group].reshape(b, num_splits, h)
