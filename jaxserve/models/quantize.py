"""Weights kept quantized: int8, int4 and fp8 weight-only through qwix, or a GGUF file's blocks as stored.

A quantized weight is a `Quantized`: values, a scale per column or per block (of 32; of 16 for GGUF's Q6_K) and,
for affine blocks (int4, GGUF's Q4_1 and Q4_K), an offset per block; w = values * scale + offset.

A weight with a scale per output column (int8, fp8) is multiplied as stored values, converted in the GEMM's
operand read, and the scale is applied to the output. Block-scaled weights (int4, GGUF's) go through qwix's
dot_general, which dequantizes the weight into the model's dtype first (on a GPU XLA writes that copy out: a
Pallas kernel that dequantizes in registers is what would avoid it), plus the offsets' share. Either way a
quantized model computes what its dequantized weights would.

Two weights are quantized: the linear kernels `[.., in, out]` (blocks run along `in`, the contracted axis) and the
embedding table `[vocab, hidden]` (blocks along `hidden`, which the tied LM head contracts). Norms and biases stay
in the model's dtype. Scales and offsets are float16, as GGUF keeps them (a GGUF file's Q4_K products float32).
4-bit values are kept packed two to a byte along the last axis, as uint8: XLA's own 4-bit arrays carry a layout
that compiled programs refuse (JAX 0.10 on CPU).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import qwix
from jaxtyping import Array, Float, Int

SCALE_DTYPE = jnp.float16
BLOCK = 32  # int4's block along the contracted axis: llama.cpp's Q4 block, so GGUF files load into the same layout
CPU_ROWS = 4096  # rows of the embedding table a CPU's LM head dequantizes at once
_QTYPES = {"int8": jnp.int8, "int4": jnp.uint4, "fp8": jnp.float8_e4m3fn}


def _is_4bit(qtype: Any) -> bool:
    return jnp.dtype(qtype) in (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4))


@flax.struct.dataclass
class Quantized:
    """w = values * scale + offset. scale and offset (None: symmetric) have the values' rank, one element per
    block (each axis divides the values'). `packed`: 4-bit values as bytes, two along the last axis."""

    values: Any
    scale: Any
    offset: Any = None
    qtype: Any = flax.struct.field(pytree_node=False, default=jnp.int8)
    packed: bool = flax.struct.field(pytree_node=False, default=False)

    def qarray(self, dtype: jnp.dtype) -> qwix.QArray:
        """The values and scales as qwix's QArray, which dequantizes into `dtype`."""
        values = self.values
        if self.packed:
            values = jax.lax.bitcast_convert_type(values, self.qtype).reshape(*values.shape[:-1], -1)
        return qwix.QArray(values, self.scale.astype(dtype), qtype=self.qtype)

    def dequantize(self, dtype: jnp.dtype) -> Array:
        w = qwix.dequantize(self.qarray(dtype))
        if self.offset is None:
            return w
        offset = self.offset.astype(dtype)
        for axis, (b, n) in enumerate(zip(offset.shape, w.shape)):  # one value per block over its elements
            offset = jnp.repeat(offset, n // b, axis=axis) if b != n else offset
        return w + offset


def _block_sums(x: Float[Array, "... k"], blocks: int) -> Float[Array, "... blocks"]:
    return x.reshape(*x.shape[:-1], blocks, x.shape[-1] // blocks).sum(-1)


def _matmul(x: Float[Array, "... k"], w: Array | Quantized, contracted: int) -> Array:
    """x times w contracted over w's axis `contracted` (0: a kernel [k, n]; 1: a table [n, k]), in x's dtype; a
    float w is cast (as nn.Dense casts it)."""
    dims = (((x.ndim - 1,), (contracted,)), ((), ()))
    if not isinstance(w, Quantized):
        return jax.lax.dot_general(x, w.astype(x.dtype), dims)
    if w.offset is None and w.scale.shape[contracted] == 1:
        # a scale per output column scales the output: the GEMM reads the values, converted in its operand read
        # (qwix dequantizes the whole weight first, which XLA's GPU compiler writes out: 3x slower on an H200)
        y = jax.lax.dot_general(x, w.qarray(x.dtype).qvalue.astype(x.dtype), dims,
                                preferred_element_type=jnp.float32)
        return (y * jnp.squeeze(w.scale, contracted).astype(jnp.float32)).astype(x.dtype)
    # float32 sums, rounded once: in bfloat16 the offsets' share and the product nearly cancel for inputs with a
    # mean (14% error against 1.4% for one bfloat16 matmul of the dequantized weight)
    y = qwix.dot_general(x, w.qarray(x.dtype), dims, preferred_element_type=jnp.float32)
    if w.offset is not None:  # sum_k x_k * offset[block(k), n]: each block's x summed, times its offset
        offset = w.offset.astype(jnp.float32)
        offset = offset if contracted == 0 else offset.T
        y = y + _block_sums(x.astype(jnp.float32), offset.shape[0]) @ offset
    return y.astype(x.dtype)


def dense(x: Float[Array, "... k"], kernel: Array | Quantized) -> Float[Array, "... n"]:
    """x @ kernel [k, n] in x's dtype, the kernel float or quantized."""
    return _matmul(x, kernel, 0)


def attend(x: Float[Array, "... e"], table: Array | Quantized) -> Float[Array, "... vocab"]:
    """x @ table.T in x's dtype for the embedding table [vocab, e] (a tied LM head)."""
    if not isinstance(table, Quantized):
        return _matmul(x, table, 1)

    def by_rows(x, table):  # a CPU dequantizes a piece of the table at a time (the whole: 113 MB for SmolLM2)
        vocab = table.values.shape[0]
        pieces = next(p for p in range(-(-vocab // CPU_ROWS), vocab + 1) if vocab % p == 0)
        split = jax.tree.map(lambda a: a.reshape(pieces, vocab // pieces, *a.shape[1:]), table)
        y = jax.lax.map(lambda piece: _matmul(x, piece, 1), split)  # [pieces, ..., vocab / pieces]
        return jnp.moveaxis(y, 0, -2).reshape(*x.shape[:-1], vocab)

    return jax.lax.platform_dependent(x, table, cpu=by_rows, default=lambda x, table: _matmul(x, table, 1))


def take(table: Array | Quantized, ids: Int[Array, "..."], dtype: jnp.dtype) -> Float[Array, "... e"]:
    """The embedding table's rows `ids`, dequantized row by row (never the whole table)."""
    if not isinstance(table, Quantized):
        return jnp.take(table, ids, axis=0).astype(dtype)
    return jax.tree.map(lambda a: jnp.take(a, ids, axis=0), table).dequantize(dtype)


def _pack(values: Array) -> Array:
    """4-bit values [.., n] as bytes [.., n / 2]: the first of each pair in the low nibble."""
    return jax.lax.bitcast_convert_type(values.reshape(*values.shape[:-1], -1, 2), jnp.uint8)


def _quantize_leaf(x: Array, method: str, contracted: int) -> Quantized:
    """One weight quantized: int8 and fp8 by qwix, a scale per output channel (and per layer: the leading axes);
    int4 as llama.cpp's Q4_1: blocks of 32 along the contracted axis, values 0-15 times a scale plus the block's
    minimum as offset (qwix's zero point is an integer, which would move a Q4_1 file's values off their grid)."""
    if method != "int4":
        channels = [a for a in range(x.ndim) if a != contracted]
        q = qwix.quantize(x, _QTYPES[method], channelwise_axes=channels, scale_dtype=SCALE_DTYPE)
        return Quantized(q.qvalue, q.scale, qtype=_QTYPES[method])
    n = x.shape[contracted]
    if n % BLOCK or x.shape[-1] % 2:
        raise ValueError(f"int4 quantizes blocks of {BLOCK} along a weight's input axis and packs pairs along its "
                         f"last; a weight of shape {x.shape} has neither")
    blocks = x.reshape(*x.shape[:contracted], n // BLOCK, BLOCK, *x.shape[contracted + 1:]).astype(jnp.float32)
    lo = blocks.min(contracted + 1, keepdims=True).astype(SCALE_DTYPE)
    scale = (blocks.max(contracted + 1, keepdims=True) - lo) / 15
    scale = jnp.where(scale > 0, scale, 1.0).astype(SCALE_DTYPE)  # a constant block: any scale holds it
    q = jnp.clip(jnp.round((blocks - lo) / scale), 0, 15)  # from the stored (rounded) offset and scale
    squeeze = lambda a: a.squeeze(contracted + 1)  # noqa: E731
    return Quantized(_pack(q.reshape(x.shape).astype(jnp.uint4)), squeeze(scale), squeeze(lo), jnp.uint4, True)


def quantize_params(params: Any, method: str) -> Any:
    """`{'params': ...}` with every linear kernel and the embedding table quantized by `method` (int8, int4, fp8);
    each weight replaced on the device as it is quantized, so the float copy of one weight at a time is extra."""
    if method not in _QTYPES:
        raise ValueError(f"quantization must be one of {', '.join(_QTYPES)} to quantize float weights, got {method!r}")
    quantize = jax.jit(_quantize_leaf, static_argnums=(1, 2))

    def leaf(path, x):
        name = getattr(path[-1], "key", "")
        if name == "kernel":
            return quantize(x, method, x.ndim - 2)
        if name == "embedding":
            return quantize(x, method, x.ndim - 1)
        return x

    return jax.tree_util.tree_map_with_path(leaf, params)


def on_device(x: np.ndarray | Quantized, dtype: jnp.dtype) -> Array | Quantized:
    """A loader's host array on the device: a float one in `dtype`, a GGUF file's `Quantized` blocks as stored
    (4-bit values, one to an int8 on the host, packed here)."""
    if not isinstance(x, Quantized):
        return jnp.asarray(x, dtype)
    values = np.asarray(x.values)
    if _is_4bit(x.qtype) and not x.packed:
        nibbles = values.astype(np.uint8) & 0x0F
        values = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return jax.tree.map(jnp.asarray, x.replace(values=values, packed=_is_4bit(x.qtype)))
