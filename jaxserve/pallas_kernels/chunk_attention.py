"""Flash-attention Pallas kernel for a chunk of queries over keys with arbitrary positions.

Same signature and semantics as `reference.chunk_attention`: key j is visible to query i iff k_pos[j] <= q_pos[i];
rows that see nothing give o=0, lse=-inf. Grid over (query head, query block); each program walks the key
blocks with an online softmax in float32 (base 2). Which key blocks a query block can see at all (smallest key
position <= its last query position) is worked out before the kernel, for any order of positions (zigzag
shards, history stores): each program gets the list of its visible blocks and loops over just those, with no
branch in the loop (the causal tail and padding cost nothing). GQA: the K/V BlockSpecs map query head i to KV
head i // (h // kvh).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from jaxserve.pallas_kernels import common
from jaxserve.pallas_kernels import reference
from jaxserve.pallas_kernels.reference import NO_POSITION


def _kernel(
    visible_ref,
    q_pos_ref,
    k_pos_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    lse_ref,
    *,
    block_k: int,
    scale: float,
    window: int | None,
):
    q = q_ref[...]  # [block_q, d]
    q_pos = q_pos_ref[...]
    count = jnp.sum((visible_ref[...] >= 0).astype(jnp.int32))  # visible blocks, listed first (-1 after)

    def body(j, carry):
        start = pl.multiple_of(visible_ref[j] * block_k, block_k)
        k_pos = k_pos_ref[pl.ds(start, block_k)]
        s = common.scores(q, k_ref[pl.ds(start, block_k), :].astype(q.dtype), scale)  # the cache may be narrower
        s = jnp.where(reference.visible(k_pos[None, :], q_pos[:, None], window), s, -jnp.inf)
        return common.online_softmax(carry, s, v_ref[pl.ds(start, block_k), :].astype(q.dtype))

    o, lse = common.finish(lax.fori_loop(0, count, body, common.init_carry(*q.shape)))
    o_ref[...] = o
    lse_ref[...] = lse


def visible_blocks(
    q_pos: Int[Array, " t"], k_pos: Int[Array, " s"], block_q: int, block_k: int, width: int
) -> Int[Array, "nq width"]:
    """Per query block, the key blocks it can see (smallest key position <= its largest query position) in
    increasing order, then -1 up to `width` columns."""
    q_last = q_pos.reshape(-1, block_q).max(axis=1)
    k_first = k_pos.reshape(-1, block_k).min(axis=1)
    seen = k_first[None, :] <= q_last[:, None]  # [nq, nk]
    order = jnp.argsort(~seen, axis=1, stable=True).astype(jnp.int32)  # visible blocks first, in order
    listed = jnp.where(jnp.take_along_axis(seen, order, axis=1), order, -1)
    return common.pad_axis(listed, 1, width, -1)


# block_q / block_k: 128 / 64 suit head_dim 128 on H100 in Triton flash kernels; tune with tools/bench/attention.py.
@functools.partial(jax.jit, static_argnames=("window", "block_q", "block_k", "interpret"))
def chunk_attention(
    q: Float[Array, "t h d"],
    k: Float[Array, "s kvh d"],
    v: Float[Array, "s kvh d"],
    q_pos: Int[Array, " t"],
    k_pos: Int[Array, " s"],
    window: int | None = None,
    *,
    block_q: int = 128,
    block_k: int = 64,
    interpret: bool = False,
) -> tuple[Float[Array, "t h d"], Float[Array, "t h"]]:
    """Softmax attention of each query over the keys `visible` to it: float32 output and log-sum-exp."""
    t, h, d = q.shape
    s, kvh = k.shape[:2]
    group = h // kvh
    block_q, block_k = common.tile(t, block_q), common.tile(s, block_k)
    t_pad, s_pad, d_pad = common.round_up(t, block_q), common.round_up(s, block_k), pl.next_power_of_2(d)
    # Padded queries see nothing, padded keys are never seen; zero head-dim padding leaves q.k unchanged.
    q_pos = common.pad_axis(q_pos.astype(jnp.int32), 0, t_pad, -1)
    k_pos = common.pad_axis(k_pos.astype(jnp.int32), 0, s_pad, NO_POSITION)
    q = common.pad_axis(common.pad_axis(q, 0, t_pad), 2, d_pad)
    k = common.pad_axis(common.pad_axis(k, 0, s_pad), 2, d_pad)
    v = common.pad_axis(common.pad_axis(v, 0, s_pad), 2, d_pad)

    width = pl.next_power_of_2(s_pad // block_k)  # Triton blocks are powers of two
    visible = visible_blocks(q_pos, k_pos, block_q, block_k, width)

    kv_spec = pl.BlockSpec((s_pad, None, d_pad), lambda i, j: (0, i // group, 0))
    o, lse = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, scale=d**-0.5, window=window),
        grid=(h, t_pad // block_q),
        in_specs=[
            pl.BlockSpec((None, width), lambda i, j: (j, 0)),
            pl.BlockSpec((block_q,), lambda i, j: (j,)),
            pl.BlockSpec((s_pad,), lambda i, j: (0,)),
            pl.BlockSpec((block_q, None, d_pad), lambda i, j: (j, i, 0)),
            kv_spec,
            kv_spec,
        ],
        out_specs=[
            pl.BlockSpec((block_q, None, d_pad), lambda i, j: (j, i, 0)),
            pl.BlockSpec((block_q, None), lambda i, j: (j, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((t_pad, h, d_pad), jnp.float32),
            jax.ShapeDtypeStruct((t_pad, h), jnp.float32),
        ],
        compiler_params=common.gpu_params(d_pad, interpret),
        interpret=interpret,
        name="chunk_attention",
    )(visible, q_pos, k_pos, q, k, v)
    return o[:t, :, :d], lse[:t]
