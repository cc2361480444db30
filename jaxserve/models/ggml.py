"""ggml's CPU kernels inside jaxserve's XLA programs: a GGUF tensor's blocks multiplied as stored, as llama.cpp
multiplies them (docs/MODELS.md, "Weights kept quantized").

XLA's CPU backend has no dot over 4-bit blocks, and none it compiles beats its float32 GEMM at one row
(docs/BENCHMARKS.md, "Weights kept quantized"). ggml's kernels, the library llama.cpp runs on, do: each row of the
input is rounded to 8 bits in blocks (Q8_1 for Q4_1, Q8_K for the K types: ggml's vec_dot type), then integer dot
products run over the weight's blocks as they lie in the file. ggml_ffi.cc wraps them as XLA FFI calls.

ggml comes from llama-cpp-python (`pip install 'jaxserve[ggml]'`), which installs its libraries. The wrapper is
compiled here on first use (pallas_kernels/cpu_ffi.py: against jaxlib's FFI headers and those libraries, into the
cache), and every load checks it on random blocks against the `gguf` package's own dequantization
before any model uses it.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
from collections.abc import Sequence

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, UInt8

from jaxserve.pallas_kernels import cpu_ffi

SOURCE = pathlib.Path(__file__).with_name("ggml_ffi.cc")
TARGETS = ("jaxserve_ggml_matmul", "jaxserve_ggml_to_float", "jaxserve_ggml_round")
# Rows of input up to which ggml's vec_dot takes each (row, column) pair. Past it the weight is dequantized and
# XLA's float32 GEMM multiplies the input rounded as vec_dot rounds it: the same sums, in another order
# (docs/BENCHMARKS.md, "Weights kept quantized"). Float32 rows go to XLA's GEMM sooner: from 16 rows it is as fast
# (docs/BENCHMARKS.md, "Beside llama.cpp and vLLM's CPU build").
FEW_ROWS = 64
F32_FEW_ROWS = 8
F32 = int(gguf.GGMLQuantizationType.F32)  # rows of float32 values, held as a float32 array [.., n, k]
CHECKED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")  # the load's check: the default model's and the common


def library_dir() -> pathlib.Path | None:
    """The folder holding ggml's libraries, as llama-cpp-python installs them (None: not installed)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    lib = pathlib.Path(spec.origin).parent / "lib"
    return lib if (lib / "libggml-cpu.so").is_file() else None


@functools.cache
def available() -> bool:
    """Whether ggml's kernels run here: a CPU backend, ggml installed, and the wrapper built, registered and checked
    (load). A compiler that cannot build it leaves XLA's kept blocks in its place, with a warning; a build that
    disagrees with the gguf package raises (cpu_ffi.builds)."""
    if jax.default_backend() != "cpu" or library_dir() is None:
        return False
    return cpu_ffi.builds(load, "a GGUF file's blocks run on XLA, not ggml")


@functools.cache
def load() -> None:
    """Build (or find) the wrapper, register its FFI targets and check them. Raises where ggml cannot run here."""
    if library_dir() is None or cpu_ffi.compiler() is None:
        raise RuntimeError(
            "a GGUF file's blocks run on a CPU through ggml's kernels: install them with "
            "`pip install 'jaxserve[ggml]'` (llama-cpp-python) and a C++ compiler"
        )
    libs = [library_dir() / "libggml-cpu.so", library_dir() / "libggml-base.so"]
    cpu_ffi.load(SOURCE, TARGETS, _check, libs, init="jaxserve_ggml_init")


def _ggml_type(qtype: str | int) -> int:
    return int(gguf.GGMLQuantizationType[qtype] if isinstance(qtype, str) else qtype)


def few_rows(qtype: int) -> int:
    """Rows of input up to which `qtype`'s weights go to ggml's vec_dot (FEW_ROWS, F32_FEW_ROWS)."""
    return F32_FEW_ROWS if qtype == F32 else FEW_ROWS


def columns(raw: Array, qtype: int) -> int:
    """The values a row of `raw` holds as `qtype`'s blocks: its bytes (uint8 blocks, or F32's float32 values) over a
    block's, times a block's values."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    row = raw.shape[-1] * raw.dtype.itemsize
    if row % size:
        raise ValueError(f"a row of {row} bytes is not whole {gguf.GGMLQuantizationType(qtype).name} blocks")
    return row // size * block


def matmul(x: Float[Array, "... k"], raw: UInt8[Array, "n bytes"], qtype: int) -> Float[Array, "... n"]:
    """x @ w.T in float32, w [n, k] the rows of `qtype`'s blocks in `raw`; x rounded to ggml's vec_dot type."""
    return matmuls(x, [raw], qtype)[0]


def matmuls(x: Float[Array, "... k"], raws: Sequence[UInt8[Array, "n bytes"]], qtype: int) -> list[Array]:
    """matmul for weights of one type that share their input (q/k/v, gate/up): x rounded once, one call."""
    load()
    return _matmuls(x, raws, qtype)


def to_float(raw: UInt8[Array, "... bytes"], qtype: int) -> Float[Array, "... k"]:
    """The rows of `qtype`'s blocks in `raw`, dequantized to float32."""
    load()
    return _to_float(raw, qtype)


def rounded(x: Float[Array, "... k"], qtype: int) -> Float[Array, "... k"]:
    """x rounded to the blocks ggml multiplies `qtype`'s with (Q8_1 for Q4_1, ...), back in float32."""
    load()
    return _rounded(x, qtype)


def _matmuls(x: Float[Array, "... k"], raws: Sequence[UInt8[Array, "n bytes"]], qtype: int) -> list[Array]:
    k, lead = x.shape[-1], x.shape[:-1]
    for raw in raws:
        if columns(raw, qtype) != k:
            raise ValueError(f"x has {k} columns; the weight's rows hold {columns(raw, qtype)}")
    x = x.reshape(-1, k).astype(jnp.float32)
    if x.shape[0] <= few_rows(qtype):
        outs = [jax.ShapeDtypeStruct((x.shape[0], raw.shape[0]), jnp.float32) for raw in raws]
        ys = jax.ffi.ffi_call("jaxserve_ggml_matmul", outs)(x, *raws, type=np.int64(qtype))
    else:  # x rounded as vec_dot rounds it
        rounded = _rounded(x, qtype)
        ys = [jax.lax.dot_general(rounded, _to_float(raw, qtype), (((1,), (1,)), ((), ()))) for raw in raws]
    return [y.reshape(*lead, raw.shape[0]) for y, raw in zip(ys, raws)]


def _rounded(x: Float[Array, "... k"], qtype: int) -> Float[Array, "... k"]:
    x = x.astype(jnp.float32)
    if qtype == F32:  # vec_dot takes float32 rows as they are
        return x
    return jax.ffi.ffi_call("jaxserve_ggml_round", jax.ShapeDtypeStruct(x.shape, jnp.float32))(x, type=np.int64(qtype))


def _to_float(raw: UInt8[Array, "... bytes"], qtype: int) -> Float[Array, "... k"]:
    if qtype == F32:
        return raw
    out = jax.ShapeDtypeStruct((*raw.shape[:-1], columns(raw, qtype)), jnp.float32)
    return jax.ffi.ffi_call("jaxserve_ggml_to_float", out)(raw, type=np.int64(qtype))


def random_blocks(qtype: str | int, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random rows of `qtype`'s blocks, [rows, bytes], with finite float16 scales (random bytes elsewhere)."""
    t = gguf.GGMLQuantizationType(_ggml_type(qtype))
    values = rng.standard_normal((rows, k)).astype(np.float32)
    return np.asarray(gguf.quants.quantize(values, t)) if t in _QUANTIZABLE else _random_k_blocks(t, values, rng)


_QUANTIZABLE = {gguf.GGMLQuantizationType[t] for t in ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1")}


def _random_k_blocks(t: gguf.GGMLQuantizationType, values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """K-type blocks the gguf package cannot write: random bytes, each block's float16 super-scales set finite."""
    block, size = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (values.shape[0], values.shape[1] // block, size), dtype=np.uint8)
    at = {"Q4_K": (0, 2), "Q6_K": (size - 2,)}[t.name]  # where each keeps its float16 d (and dmin)
    scales = rng.uniform(1e-3, 2e-2, (*raw.shape[:2], len(at))).astype(np.float16).view(np.uint8)
    for i, offset in enumerate(at):
        raw[..., offset : offset + 2] = scales[..., 2 * i : 2 * i + 2]
    return raw.reshape(values.shape[0], -1)


def rounding_bound(x: Float[np.ndarray, "m k"], w: Float[np.ndarray, "n k"]) -> Float[np.ndarray, "m n"]:
    """How far ggml's x @ w.T may be from the exact product, w dequantized: each input moves at most half a step
    (its block's largest value / 127, at most its row's), and its block's scale and sum are kept in float16
    (2^-11 relative: 2e-3 of the row's sum of |x| times w's row's largest |w| bounds both)."""
    step = np.abs(x).max(-1, keepdims=True) / 127
    return step / 2 * np.abs(w).sum(-1) + 2e-3 * np.abs(x).sum(-1, keepdims=True) * np.abs(w).max(-1)


def _check() -> None:
    """The wrapper against the gguf package on random blocks, every type in one program (op by op, each call
    compiled alone would take seconds): dequantized rows equal (float16 scales times small integers, exact in
    float32 either way but for an ulp where an offset is added); products at a row and past FEW_ROWS within
    rounding_bound."""
    rng = np.random.default_rng(0)
    k, many = 512, FEW_ROWS + 1
    raws = {name: random_blocks(name, 24, k, rng) for name in CHECKED_TYPES}
    x = rng.standard_normal((many, k)).astype(np.float32)

    @jax.jit
    def run(raws, x):
        out = {}
        for name, raw in raws.items():
            qtype = _ggml_type(name)
            out[name] = (_to_float(raw, qtype), _matmuls(x[:1], [raw], qtype)[0], _matmuls(x, [raw], qtype)[0])
        return out

    for name, (got, one, all_rows) in run(raws, x).items():
        w = gguf.quants.dequantize(raws[name], gguf.GGMLQuantizationType[name]).astype(np.float32)
        assert np.allclose(got, w, rtol=1e-6, atol=1e-6 * np.abs(w).max()), f"{name}: dequantized rows differ"
        for rows, y in ((1, one), (many, all_rows)):
            bound = rounding_bound(x[:rows], w)
            assert (np.abs(np.asarray(y) - x[:rows] @ w.T) <= bound).all(), f"{name}: products at {rows} rows beyond"
