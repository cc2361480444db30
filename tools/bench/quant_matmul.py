"""One quantized weight's matmul, in the ways XLA could compute it: which one reads only the quantized bytes.

    .venv/bin/python tools/bench/quant_matmul.py [--k=4096 --n=14336 --rows=1,16 --dtype=bfloat16]

For int8 and fp8 (a scale per output column) and int4 (blocks of 128 along k: a scale and an offset each), x
[rows, k] times the weight [k, n], kept as the backend keeps it:
- dequant: the weight dequantized in the model's dtype, then one GEMM (what qwix's weight-only dot_general does);
- served: models/quantize.dense, as the model computes it (int8, fp8: the values converted in the GEMM's operand
  read, the scale applied to the output columns; int4 on a GPU at few rows: a GEMM per block, each block's sums
  scaled, then the offsets' share; else as dequant);
- reduce: the weight dequantized inside one reduction over k, never written out (what a fused loop could do);
- float32: the dequantized weight kept in float32, one GEMM: the time a quantized matmul has to beat.
Each variant's result is checked against float32 math on the dequantized weight (relative error printed), then
timed: each call multiplies x by --copies distinct weights in one program (so neither the cache nor the dispatch
counts); printed are the median ms a matmul over --repeats calls and the weight's bytes over that time (GB/s).
On an H200 (2026-11-28) a first version timed one matmul a call, and the dispatch (about 0.1 ms) hid the rest.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxserve.models import quantize

FLAGS = flags.FLAGS
flags.DEFINE_integer("k", 4096, "Contracted features.")
flags.DEFINE_integer("n", 14336, "Output features.")
flags.DEFINE_list("rows", ["1", "16"], "Rows of x.")
flags.DEFINE_string("dtype", "bfloat16", "The model's dtype.")
flags.DEFINE_integer("repeats", 20, "Timed calls per variant.")
flags.DEFINE_integer("copies", 8, "Distinct weights a timed call multiplies by, one after another.")


def dequant(x, w: quantize.Quantized):
    return jnp.dot(x, w.dequantize(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def reduce(x, w: quantize.Quantized):
    return (x.astype(jnp.float32)[:, :, None] * w.dequantize(jnp.float32)[None]).sum(1).astype(x.dtype)


def float32(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def timed(fn, x, weights) -> float:
    """Median ms of one matmul: each call runs it over all `weights` in one program (distinct weights, so the
    cache holds none of them; one dispatch for many matmuls, so dispatch does not count)."""

    def chain(x, weights):
        return sum(fn(x, w).astype(jnp.float32).sum() for w in weights)

    chain = jax.jit(chain)
    jax.block_until_ready(chain(x, weights))
    times = []
    for _ in range(FLAGS.repeats):
        start = time.perf_counter()
        jax.block_until_ready(chain(x, weights))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3 / len(weights)


def main(argv: list[str]) -> None:
    del argv
    dtype = jnp.dtype(FLAGS.dtype)
    key = jax.random.key(0)
    weight = jax.random.normal(key, (FLAGS.k, FLAGS.n), jnp.float32) * 0.02
    fns = {"dequant": dequant, "served": quantize.dense, "reduce": reduce}
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, weight {FLAGS.k} x {FLAGS.n}, {dtype.name}")
    print(f"{'method':<6}{'rows':>6}{'variant':>12}{'ms':>10}{'GB/s':>10}{'rel err':>10}")
    quantized = jax.jit(quantize._quantize_leaf, static_argnums=(1, 2))
    for method in ("int8", "fp8", "int4"):
        weights = [quantize._store(quantized(weight * (1 + i / 8), method, 0)) for i in range(FLAGS.copies)]
        w = weights[0]
        nbytes = quantize.nbytes(w)  # int4 as XLA lays it out on a GPU
        dense = np.asarray(w.dequantize(jnp.float32))
        floats = [q.dequantize(jnp.float32) for q in weights]
        for rows in map(int, FLAGS.rows):
            x = jax.random.normal(jax.random.fold_in(key, rows), (rows, FLAGS.k), jnp.float32).astype(dtype)
            ref = np.asarray(x, np.float32) @ dense
            for name, fn, ws in [*((n, f, weights) for n, f in fns.items()), ("float32", float32, floats)]:
                fn = jax.jit(fn)
                err = np.linalg.norm(np.asarray(fn(x, ws[0]), np.float32) - ref) / np.linalg.norm(ref)
                ms = timed(fn, x, ws)
                print(f"{method:<6}{rows:>6}{name:>12}{ms:>10.4f}{nbytes / ms / 1e6:>10.1f}{err:>10.2e}")


if __name__ == "__main__":
    app.run(main)
