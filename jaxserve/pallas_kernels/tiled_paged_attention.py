"""Pallas kernel of `ragged_paged_attention.tiled_paged_attention`: query tiles of one request each over that
request's paged KV cache, the engine's attention on GPU.

Grid over (tile, KV head). A program holds the KV head's whole query group for the tile's tokens as one
[g * tq, d] matrix (each cached row is read once for all of them) and walks key blocks of `key_block` tokens,
`key_block / block_size` pages per step: the block ids come from the tile's table row and the pages' rows are
gathered into one [key_block, d] tile by an index vector (interpret mode and the Triton lowering both load
through an index array), so one dot covers several pages. The loop stops at the tile's own last position (a
decode's context, a chunk's end): a short request in a batch with a long one reads only its own pages. Key
positions come from each entry's first position (page_pos: a KV-parallel device lists its own entries first), and
where each tile's loop starts and ends, in entries, is reduced before the kernel.

Split along the context (split-K, as FlashDecoding): when tiles x KV heads are fewer programs than the GPU has
SMs (a decode of few rows), each tile's key blocks are cut into `splits` ranges, one program each, and their
(output, log-sum-exp) partials merge after the kernel (in jnp, fused by XLA). Splits past a short context run no block.

As in the decode kernel, the table and the cache are plain inputs (the cache as one KV head's [slots, d] view)
rather than TPU-only scalar prefetch, and nothing is gathered outside the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from jaxserve.pallas_kernels import common, reference
from jaxserve.pallas_kernels.paged_attention import pages_in_order, walk_bounds


MAX_SPLITS = 16


def context_splits(programs: int, key_blocks: int, cores: int, most: int = MAX_SPLITS) -> int:
    """How many ranges to cut each tile's key blocks into so that `programs` (tiles x KV heads) fill `cores` SMs:
    1 once they do, at most `most` and at most the table's `key_blocks`."""
    return max(1, min(cores // max(programs, 1), key_blocks, most))


def _kernel(
    pos_ref,
    table_ref,
    page_pos_ref,
    entries_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    lse_ref,
    *,
    block_size: int,
    key_block: int,
    scale: float,
    splits: int,
    window: int | None,
):
    pages = key_block // block_size
    q = q_ref[...]  # [rows, d]: the group's heads x the tile's tokens
    pos = pos_ref[...]  # [rows]; -1: padding
    # the table entries before the tile's first key, and to its last (scalar loads: Triton lowers no slice)
    steps = lax.div(entries_ref[1] + pages - 1, pages)
    start = jnp.minimum(lax.div(entries_ref[0], pages), steps)
    per = lax.div(steps - start + splits - 1, splits)  # this program's key blocks: [first, last)
    first = start + pl.program_id(2) * per
    last = jnp.minimum(first + per, steps)
    offsets = jnp.arange(block_size, dtype=jnp.int32)

    def body(j, carry):
        blocks = table_ref[pl.ds(pl.multiple_of(j * pages, pages), pages)]  # [pages]; -1: held elsewhere
        slots = (jnp.maximum(blocks, 0)[:, None] * block_size + offsets[None, :]).reshape(key_block)
        here = jnp.broadcast_to((blocks >= 0)[:, None], (pages, block_size)).reshape(key_block)
        key_pos = (page_pos_ref[pl.ds(pl.multiple_of(j * pages, pages), pages)][:, None] + offsets[None, :]).reshape(
            key_block
        )
        s = common.scores(q, k_ref[slots, :].astype(q.dtype), scale)  # the cache may be narrower
        s = jnp.where(reference.visible(key_pos[None, :], pos[:, None], window) & here[None, :], s, -jnp.inf)
        return common.online_softmax(carry, s, v_ref[slots, :].astype(q.dtype))

    o, lse = common.finish(lax.fori_loop(first, last, body, common.init_carry(*q.shape)))
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = lse


@functools.partial(jax.jit, static_argnames=("block_size", "key_block", "window", "splits", "interpret"))
def tiled_paged_attention(
    q: Float[Array, "n tq h d"],
    q_pos: Int[Array, "n tq"],
    k_cache: Float[Array, "slots kvh d"],
    v_cache: Float[Array, "slots kvh d"],
    tables: Int[Array, "n w"],
    *,
    block_size: int,
    key_block: int,
    window: int | None = None,
    page_pos: Int[Array, "n w"] | None = None,
    splits: int | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "n tq h d"], Float[Array, "n tq h"]]:
    """The reference's semantics (ragged_paged_attention.tiled_paged_attention): output in q's dtype, 0 where no
    key is visible, and float32 log-sum-exp, -inf there. splits: key-block ranges per tile (None: by
    context_splits for the GPU's SMs when compiled, 1 in interpret mode)."""
    n, tq, h, d = q.shape
    kvh = k_cache.shape[1]
    g = h // kvh
    if key_block % block_size or tables.shape[1] % (key_block // block_size):
        raise ValueError(
            f"key_block {key_block} must be whole pages of {block_size}, and the table width "
            f"{tables.shape[1]} whole key blocks"
        )
    if splits is None:
        splits = (
            1 if interpret else context_splits(n * kvh, tables.shape[1] * block_size // key_block, common.gpu_cores())
        )
    rows, d_pad = max(16, pl.next_power_of_2(g * tq)), pl.next_power_of_2(d)  # Triton: power-of-two dots >= 16
    # [n, kvh, g*tq, d]: row r is group member r // tq, token r % tq (as the reference)
    qg = q.reshape(n, tq, kvh, g, d).transpose(0, 2, 3, 1, 4).reshape(n, kvh, g * tq, d)
    qg = common.pad_axis(common.pad_axis(qg, 2, rows), 3, d_pad)
    pos = common.pad_axis(jnp.tile(q_pos.astype(jnp.int32), (1, g)), 1, rows, value=-1)
    k_cache, v_cache = common.pad_axis(k_cache, 2, d_pad), common.pad_axis(v_cache, 2, d_pad)
    size = jnp.dtype(k_cache.dtype).itemsize
    stages = common.pipeline_stages(stage_bytes=2 * key_block * d_pad * size, fixed_bytes=rows * d_pad * size)
    if page_pos is None:
        page_pos = pages_in_order(tables, block_size)
    start, _, end = walk_bounds(q_pos, page_pos, block_size, window)  # reduced by XLA, not in each program
    entries = jnp.stack([start, end], axis=1)
    cache_spec = pl.BlockSpec((k_cache.shape[0], None, d_pad), lambda i, kh, j: (0, kh, 0))
    o, lse = pl.pallas_call(
        functools.partial(
            _kernel, block_size=block_size, key_block=key_block, scale=d**-0.5, splits=splits, window=window
        ),
        grid=(n, kvh, splits),
        in_specs=[
            pl.BlockSpec((None, rows), lambda i, kh, j: (i, 0)),
            pl.BlockSpec((None, tables.shape[1]), lambda i, kh, j: (i, 0)),
            pl.BlockSpec((None, tables.shape[1]), lambda i, kh, j: (i, 0)),
            pl.BlockSpec((None, 2), lambda i, kh, j: (i, 0)),
            pl.BlockSpec((None, None, rows, d_pad), lambda i, kh, j: (i, kh, 0, 0)),
            cache_spec,
            cache_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, d_pad), lambda i, kh, j: (j, i, kh, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda i, kh, j: (j, i, kh, 0)),
        ],
        out_shape=[  # partials in float32: a split's output is rounded once, after the merge
            jax.ShapeDtypeStruct((splits, n, kvh, rows, d_pad), q.dtype if splits == 1 else jnp.float32),
            jax.ShapeDtypeStruct((splits, n, kvh, rows), jnp.float32),
        ],
        compiler_params=common.gpu_params(d_pad, interpret, stages),
        interpret=interpret,
        name="tiled_paged_attention",
    )(pos, tables.astype(jnp.int32), page_pos.astype(jnp.int32), entries, qg, k_cache, v_cache)
    if splits == 1:
        o, lse = o[0], lse[0]
    else:
        # in jnp, not the merge kernel: XLA fuses it with its neighbours (a kernel launch a layer saved:
        # docs/BENCHMARKS.md, "Serving on one H200, profiled, and on one H100")
        o, lse = reference.merge_attention(o, lse)
        o = o.astype(q.dtype)
    o = o[:, :, : g * tq, :d].reshape(n, kvh, g, tq, d).transpose(0, 3, 1, 2, 4).reshape(n, tq, h, d)
    return o, lse[:, :, : g * tq].reshape(n, kvh, g, tq).transpose(0, 3, 1, 2).reshape(n, tq, h)
