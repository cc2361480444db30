"""Log-sum-exp merge of partial attention results in Pallas.

Same signature and semantics as `reference.merge_attention`: n partials over disjoint key sets combine into the
exact softmax result; -inf partials drop out and rows where all are -inf give 0 and -inf. The leading dims
between n and d are flattened into rows; the grid runs over row blocks and each program loops over the n
partials twice (max, then weighted sum), the reference's arithmetic, so n needs no power-of-two tile.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from jaxserve.pallas_kernels import common


def _kernel(o_ref, lse_ref, out_ref, out_lse_ref):
    n, rows = lse_ref.shape
    m = lax.fori_loop(0, n, lambda i, m: jnp.maximum(m, lse_ref[i]), jnp.full((rows,), -jnp.inf, jnp.float32))
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)

    def body(i, carry):
        total, acc = carry
        w = jnp.exp(lse_ref[i] - m_safe)  # 0 for an empty partial
        return total + w, acc + o_ref[i].astype(jnp.float32) * w[:, None]

    zeros = jnp.zeros((rows,), jnp.float32)
    total, acc = lax.fori_loop(0, n, body, (zeros, jnp.zeros(out_ref.shape, jnp.float32)))
    seen = total > 0
    total_safe = jnp.where(seen, total, 1.0)
    out_ref[...] = (acc / total_safe[:, None]).astype(out_ref.dtype)
    out_lse_ref[...] = jnp.where(seen, m_safe + jnp.log(total_safe), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("block_rows", "interpret"))
def merge_attention(
    o: Float[Array, "n ... d"], lse: Float[Array, "n ..."], *, block_rows: int = 64, interpret: bool = False
) -> tuple[Float[Array, "... d"], Float[Array, "..."]]:
    """Combine n partial results over disjoint key sets into the exact softmax result (-inf partials drop out)."""
    n, *batch, d = o.shape
    rows = math.prod(batch)
    block_rows = common.tile(rows, block_rows, minimum=1)
    rows_pad, d_pad = common.round_up(rows, block_rows), pl.next_power_of_2(d)
    o2 = common.pad_axis(common.pad_axis(o.reshape(n, rows, d), 1, rows_pad), 2, d_pad)
    lse2 = common.pad_axis(lse.astype(jnp.float32).reshape(n, rows), 1, rows_pad, -jnp.inf)

    out, out_lse = pl.pallas_call(
        _kernel,
        grid=(rows_pad // block_rows,),
        in_specs=[
            pl.BlockSpec((n, block_rows, d_pad), lambda r: (0, r, 0)),
            pl.BlockSpec((n, block_rows), lambda r: (0, r)),
        ],
        out_specs=[
            pl.BlockSpec((block_rows, d_pad), lambda r: (r, 0)),
            pl.BlockSpec((block_rows,), lambda r: (r,)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((rows_pad, d_pad), jnp.result_type(o.dtype, jnp.float32)),
            jax.ShapeDtypeStruct((rows_pad,), jnp.float32),
        ],
        compiler_params=common.gpu_params(d_pad, interpret),
        interpret=interpret,
        name="merge_attention",
    )(o2, lse2)
    return out[:rows, :d].reshape(*batch, d), out_lse[:rows].reshape(batch)
