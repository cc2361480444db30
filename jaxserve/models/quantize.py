"""Weights kept quantized: int8, int4 and fp8 weight-only through qwix, or a GGUF file's blocks as stored.

A quantized weight is a `Quantized`: values, a scale per column or per block (int4's 128, or fewer where they do
not divide; GGUF's 32, 16 for Q6_K) and, for affine blocks (int4, GGUF's Q4_1 and Q4_K), an offset per block;
w = values * scale + offset.

No matmul writes a dequantized weight out where it can be helped (on a GPU that copy made decode several times
slower than bfloat16: docs/BENCHMARKS.md, "Weights kept quantized"). A scale per output column (int8, fp8) scales
the GEMM's output; the GEMM reads the values, converted in its operand read. Blocks, on a GPU at few rows, run a
GEMM per block, each block's float32 sums scaled, then summed; elsewhere qwix's dot_general dequantizes the weight
into the model's dtype first. The offsets' share is each block's inputs summed, times its offsets. Either way a
quantized model computes what its dequantized weights would.

On a CPU where ggml's kernels run (models/ggml.py: llama-cpp-python installed), a GGUF file's blocks are
`GGMLBlocks` instead: each tensor's rows as stored, multiplied as llama.cpp multiplies them (each input row rounded
to 8-bit blocks, then integer dot products), several times faster than the XLA path at a few rows.

Two weights are quantized: the linear kernels `[.., in, out]` (blocks run along `in`, the contracted axis) and the
embedding table `[vocab, hidden]` (blocks along `hidden`, which the tied LM head contracts). Norms and biases stay
in the model's dtype. Scales and offsets are float16, as GGUF keeps them (a GGUF file's Q4_K products float32).
4-bit values are kept as the backend wants them (_store): on a CPU packed two to a byte along the last axis, as
uint8; on a GPU as XLA's own signed int4, whose convert its GEMMs fuse.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import qwix
from jaxtyping import Array, Float, Int

from jaxserve.models import ggml

SCALE_DTYPE = jnp.float16
MAX_BLOCK = 128  # int4's largest block along the contracted axis: 4.25 bits a weight with its scale and offset
CPU_ROWS = 4096  # rows of the embedding table a CPU's LM head dequantizes at once
_QTYPES = {"int8": jnp.int8, "int4": jnp.int4, "fp8": jnp.float8_e4m3fn}


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

    def unpacked(self) -> Array:
        """The values, one an element (4-bit ones unpacked from their bytes)."""
        if not self.packed:
            return self.values
        return jax.lax.bitcast_convert_type(self.values, self.qtype).reshape(*self.values.shape[:-1], -1)

    def qarray(self, dtype: jnp.dtype) -> qwix.QArray:
        """The values and scales as qwix's QArray, which dequantizes into `dtype`."""
        return qwix.QArray(self.unpacked(), self.scale.astype(dtype), qtype=self.qtype)

    def dequantize(self, dtype: jnp.dtype) -> Array:
        w = qwix.dequantize(self.qarray(dtype))
        if self.offset is None:
            return w
        offset = self.offset.astype(dtype)
        for axis, (b, n) in enumerate(zip(offset.shape, w.shape)):  # one value per block over its elements
            offset = jnp.repeat(offset, n // b, axis=axis) if b != n else offset
        return w + offset


@flax.struct.dataclass
class GGMLBlocks:
    """A GGUF tensor's rows of blocks as stored, `raw` [.., n, row bytes], multiplied by ggml's kernels on a CPU
    (models/ggml.py). It stands for a linear kernel [.., k, n] and for an embedding table [n, k] alike: a
    GGUF file's rows run along the axis a matmul contracts, so neither is transposed. ggml's F32 rows are float32
    values, [.., n, k] (float_rows)."""

    raw: Any
    qtype: int = flax.struct.field(pytree_node=False)  # gguf.GGMLQuantizationType's value


KEPT = (Quantized, GGMLBlocks)  # a weight held as a tree of arrays, not one float array


# XLA's GPU compiler merges dots that share an input (q, k and v) into one GEMM over their weights concatenated;
# over block-quantized weights it writes their converted values out to do so. Their programs compile without it.
UNMERGED_DOTS = {"xla_gpu_dot_merger_threshold_mb": 0}


def kept(params: Any) -> list[Quantized]:
    """The tree's weights kept quantized."""
    return [x for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Quantized)) if isinstance(x, Quantized)]


def has_blocks(params: Any) -> bool:
    """Whether a linear kernel is quantized in blocks along its input (int4, GGUF's types), not per column."""
    return any(x.scale.shape[-2] > 1 and x.scale.shape[-1] > 1 for x in kept(params))


def nbytes(params: Any) -> int:
    """The bytes a tree of arrays holds on its device: a 4-bit array's nbytes counts a byte an element, but XLA's
    GPU transfer manager lays them out two to a byte."""
    return sum(-(-x.size // 2) if _is_4bit(x.dtype) else x.nbytes for x in jax.tree.leaves(params))


def float_rows(params: Any) -> Any:
    """On a CPU where ggml's kernels run (models/ggml.py), the float32 linear kernels [.., k, n] and embedding
    table [n, k] as ggml's F32 rows (GGMLBlocks, [.., n, k]): at up to ggml.F32_FEW_ROWS rows of input ggml's dot
    products, on every core, read them faster than XLA's GEMM (docs/BENCHMARKS.md, "Beside llama.cpp and vLLM's
    CPU build"); past it XLA's GEMM multiplies the same array. Elsewhere, and any other weight, as it is."""
    if not ggml.available():
        return params

    def leaf(path, x):
        name = getattr(path[-1], "key", "")
        if isinstance(x, KEPT) or name not in ("kernel", "embedding") or x.dtype != jnp.float32:
            return x
        return GGMLBlocks(x if name == "embedding" else jnp.swapaxes(x, -1, -2), ggml.F32)

    return jax.tree_util.tree_map_with_path(leaf, params, is_leaf=lambda x: isinstance(x, KEPT))


def _block_sums(x: Float[Array, "... k"], blocks: int) -> Float[Array, "... blocks"]:
    return x.reshape(*x.shape[:-1], blocks, x.shape[-1] // blocks).sum(-1)


def _matmul(x: Float[Array, "... k"], w: Array | Quantized | GGMLBlocks, contracted: int) -> Array:
    """x times w contracted over w's axis `contracted` (0: a kernel [k, n]; 1: a table [n, k]), in x's dtype; a
    float w is cast (as nn.Dense casts it)."""
    dims = (((x.ndim - 1,), (contracted,)), ((), ()))
    if isinstance(w, GGMLBlocks):
        return ggml.matmul(x, w.raw, w.qtype).astype(x.dtype)
    if not isinstance(w, Quantized):
        return jax.lax.dot_general(x, w.astype(x.dtype), dims)
    if w.offset is None and w.scale.shape[contracted] == 1:
        # a scale per output column scales the output: the GEMM reads the values, converted in its operand read
        # (qwix dequantizes the whole weight first, which XLA's GPU compiler writes out: docs/BENCHMARKS.md,
        # "Weights kept quantized")
        y = jax.lax.dot_general(x, w.unpacked().astype(x.dtype), dims, preferred_element_type=jnp.float32)
        return (y * jnp.squeeze(w.scale, contracted).astype(jnp.float32)).astype(x.dtype)
    rows, block = math.prod(x.shape[:-1]), x.shape[-1] // w.scale.shape[contracted]
    if not w.packed and rows * 4 < block * x.dtype.itemsize:  # float32 sums per block: fewer bytes than a copy
        y = jax.lax.platform_dependent(
            x,
            w,
            cpu=functools.partial(_dequantized, contracted=contracted),
            default=functools.partial(_by_block, contracted=contracted),
        )
    else:
        y = _dequantized(x, w, contracted)
    if w.offset is not None:  # sum_k x_k * offset[block(k), n]: each block's x summed, times its offset
        offset = w.offset.astype(jnp.float32)
        offset = offset if contracted == 0 else offset.T
        y = y + _block_sums(x.astype(jnp.float32), offset.shape[0]) @ offset
    return y.astype(x.dtype)


def _dequantized(x: Float[Array, "... k"], w: Quantized, contracted: int) -> Float[Array, "... n"]:
    """x times the values times their scales, by qwix: the weight dequantized into x's dtype, then one GEMM. The
    sums are float32, rounded once: in bfloat16 the offsets' share and the product nearly cancel for inputs with a
    mean (14% error against 1.4% for one bfloat16 matmul of the dequantized weight)."""
    dims = (((x.ndim - 1,), (contracted,)), ((), ()))
    return qwix.dot_general(x, w.qarray(x.dtype), dims, preferred_element_type=jnp.float32)


def _by_block(x: Float[Array, "... k"], w: Quantized, contracted: int) -> Float[Array, "... n"]:
    """The same as one GEMM per block (a batched dot whose operand read converts the values), each block's float32
    sums times its scales, then summed: the weight is never dequantized into a buffer of its own. XLA's CPU
    runtime has no batched bfloat16 dot into float32; a CPU takes _dequantized."""
    values, blocks = w.unpacked().astype(x.dtype), w.scale.shape[contracted]
    xb = x.reshape(*x.shape[:-1], blocks, x.shape[-1] // blocks)
    if contracted == 0:  # a kernel [k, n]
        y = jnp.einsum(
            "...bk,bkn->...bn", xb, values.reshape(blocks, -1, values.shape[-1]), preferred_element_type=jnp.float32
        )
        scale = w.scale
    else:  # a table [n, k]
        y = jnp.einsum(
            "...bk,nbk->...bn", xb, values.reshape(values.shape[0], blocks, -1), preferred_element_type=jnp.float32
        )
        scale = w.scale.T
    return (y * scale.astype(jnp.float32)).sum(-2)  # [..., blocks, n] -> [..., n]


def dense(x: Float[Array, "... k"], kernel: Array | Quantized) -> Float[Array, "... n"]:
    """x @ kernel [k, n] in x's dtype, the kernel float or quantized."""
    return _matmul(x, kernel, 0)


def dense_shared(x: Float[Array, "... k"], kernels: Sequence[Array | Quantized | GGMLBlocks]) -> list[Array]:
    """dense(x, kernel) for each of kernels that share their input (q/k/v, gate/up): ggml's blocks of one type in
    one call (x rounded once, one parallel loop: ggml.matmuls), any others one by one."""
    types = {w.qtype if isinstance(w, GGMLBlocks) else None for w in kernels}
    if len(kernels) > 1 and len(types) == 1 and None not in types:
        return [y.astype(x.dtype) for y in ggml.matmuls(x, [w.raw for w in kernels], types.pop())]
    return [dense(x, w) for w in kernels]


def attend(x: Float[Array, "... e"], table: Array | Quantized) -> Float[Array, "... vocab"]:
    """x @ table.T in x's dtype for the embedding table [vocab, e] (a tied LM head)."""
    if not isinstance(table, Quantized):  # float, or ggml's blocks
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
    if isinstance(table, GGMLBlocks):
        return ggml.to_float(jnp.take(table.raw, ids, axis=0), table.qtype).astype(dtype)
    if not isinstance(table, Quantized):
        return jnp.take(table, ids, axis=0).astype(dtype)
    return jax.tree.map(lambda a: jnp.take(a, ids, axis=0), table).dequantize(dtype)


def _store(q: Quantized) -> Quantized:
    """4-bit values as this backend keeps them: on a CPU packed two to a byte; elsewhere as XLA's own int4 array,
    whose convert a GPU's GEMM does in its operand read (XLA's GPU compiler fuses int4's, not uint4's: uint4
    values v become v - 8 and their offset offset + 8 x scale, in float32)."""
    if not _is_4bit(q.qtype):
        return q
    values = jnp.asarray(q.unpacked())
    if jax.default_backend() == "cpu":  # XLA's CPU programs refuse int4 arrays (JAX 0.10)
        pairs = values.reshape(*values.shape[:-1], -1, 2)
        return q.replace(values=jax.lax.bitcast_convert_type(pairs, jnp.uint8), packed=True)
    if jnp.dtype(q.qtype) == jnp.dtype(jnp.uint4):
        shift = 8 * jnp.asarray(q.scale, jnp.float32)
        offset = shift if q.offset is None else jnp.asarray(q.offset, jnp.float32) + shift
        values, q = (values.astype(jnp.int8) - 8).astype(jnp.int4), q.replace(offset=offset, qtype=jnp.int4)
    return q.replace(values=values.astype(jnp.int4), packed=False)


def int4_block(n: int) -> int:
    """int4's block along a contracted axis of n features: the largest multiple of 32 up to 128 that divides n
    (128 as GPTQ and AWQ; 96 for SmolLM2's 576)."""
    block = next((b for b in range(MAX_BLOCK, 0, -32) if n % b == 0), None)
    if block is None:
        raise ValueError(
            f"int4 quantizes blocks of a multiple of 32 along a weight's input axis; {n} features have none"
        )
    return block


def _quantize_leaf(x: Array, method: str, contracted: int) -> Quantized:
    """One weight quantized: int8 and fp8 by qwix, a scale per output channel (and per layer: the leading axes);
    int4 affine in blocks along the contracted axis (int4_block), values -8..7 times a scale plus an offset per
    block, as llama.cpp's Q4_1 but signed (qwix's zero point is an integer, which would move a Q4_1 file's values
    off their grid). 4-bit values come unpacked: _store keeps them as the backend wants."""
    if method != "int4":
        channels = [a for a in range(x.ndim) if a != contracted]
        q = qwix.quantize(x, _QTYPES[method], channelwise_axes=channels, scale_dtype=SCALE_DTYPE)
        return Quantized(q.qvalue, q.scale, qtype=_QTYPES[method])
    n = x.shape[contracted]
    block = int4_block(n)
    if x.shape[-1] % 2:
        raise ValueError(
            f"int4 packs pairs of values along a weight's last axis; a weight of shape {x.shape} has an odd one"
        )
    blocks = x.reshape(*x.shape[:contracted], n // block, block, *x.shape[contracted + 1 :]).astype(jnp.float32)
    low = blocks.min(contracted + 1, keepdims=True)
    scale = (blocks.max(contracted + 1, keepdims=True) - low) / 15
    scale = jnp.where(scale > 0, scale, 1.0).astype(SCALE_DTYPE)  # a constant block: any scale holds it
    offset = (low + 8 * scale.astype(jnp.float32)).astype(SCALE_DTYPE)  # values -8..7 about it span the block
    q = jnp.clip(jnp.round((blocks - offset) / scale), -8, 7)  # from the stored (rounded) offset and scale
    squeeze = lambda a: a.squeeze(contracted + 1)  # noqa: E731
    return Quantized(q.reshape(x.shape).astype(jnp.int4), squeeze(scale), squeeze(offset), jnp.int4)


def quantize_params(params: Any, method: str) -> Any:
    """`{'params': ...}` with every linear kernel and the embedding table quantized by `method` (int8, int4, fp8);
    each weight replaced on the device as it is quantized, so the float copy of one weight at a time is extra."""
    if method not in _QTYPES:
        raise ValueError(f"quantization must be one of {', '.join(_QTYPES)} to quantize float weights, got {method!r}")
    quantize = jax.jit(_quantize_leaf, static_argnums=(1, 2))

    def leaf(path, x):
        name = getattr(path[-1], "key", "")
        if name == "kernel":
            return _store(quantize(x, method, x.ndim - 2))
        if name == "embedding":
            return _store(quantize(x, method, x.ndim - 1))
        return x

    return jax.tree_util.tree_map_with_path(leaf, params)


def on_device(x: np.ndarray | Quantized | GGMLBlocks, dtype: jnp.dtype) -> Array | Quantized | GGMLBlocks:
    """A loader's host array on the device: a float one in `dtype`, a GGUF file's blocks as stored (`Quantized`:
    4-bit values, one to an int8 on the host, as _store keeps them; `GGMLBlocks`: its bytes)."""
    if isinstance(x, GGMLBlocks):
        return x.replace(raw=jnp.asarray(x.raw))
    if not isinstance(x, Quantized):
        return jnp.asarray(x, dtype)
    if _is_4bit(x.qtype):
        x = x.replace(values=np.asarray(x.values).astype(x.qtype))
    return _store(jax.tree.map(jnp.asarray, x))
