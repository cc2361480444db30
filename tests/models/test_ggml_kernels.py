"""ggml's CPU kernels in XLA programs (jaxserve/models/ggml.py) against numpy on the gguf package's
dequantization, on random blocks of each type the default models use, at the row counts either path takes, and
split over tensor-parallel devices; a damaged cached build is rebuilt; and the default model served from its Q4_1
blocks against the same weights in float32."""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib
import shutil
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve.models import ggml, quantize
from jaxserve.sampling_params import SamplingParams

TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")


def _dequantized(raw: np.ndarray, qtype: str) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float32)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows,n", [(1, 64), (3, 7), (ggml.FEW_ROWS, 100), (ggml.FEW_ROWS + 1, 33), (40, 64)])
def test_blocks_multiply_as_their_dequantized_values_within_8_bit_inputs(qtype, rows, n):
    """x @ w.T for w in blocks as stored, at few rows (ggml's vec_dot) and many (x rounded by ggml times w
    dequantized by ggml, in XLA's GEMM): within the rounding of x to 8-bit blocks of the exact product, and a row
    gets the same from either path up to float16's share (vec_dot keeps a Q8_1 block's sum in float16)."""
    rng = np.random.default_rng(rows * 1000 + n)
    k = 512
    raw = ggml.random_blocks(qtype, n, k, rng)
    w = _dequantized(raw, qtype)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    t = int(gguf.GGMLQuantizationType[qtype])
    matmul = jax.jit(ggml.matmul, static_argnums=2)
    y = np.asarray(matmul(jnp.asarray(x), jnp.asarray(raw), t))
    assert y.shape == (rows, n)
    assert (np.abs(y - x @ w.T) <= ggml.rounding_bound(x, w)).all()
    other = x[:1] if rows > ggml.FEW_ROWS else np.concatenate([x[:1]] * (ggml.FEW_ROWS + 1))
    y_other = np.asarray(matmul(jnp.asarray(other), jnp.asarray(raw), t))[0]
    assert (np.abs(y[0] - y_other) <= 2e-3 * np.abs(x[0]).sum() * np.abs(w).max(-1) + 1e-5 * np.abs(y[0])).all()


def _ggml_vec_dot(x: np.ndarray, raw: np.ndarray, qtype: int) -> np.ndarray:
    """x @ w.T by ggml's own calls, as llama.cpp makes them at a few rows: each row of x rounded by its vec_dot
    type's from_float, then vec_dot for each (row, column) pair."""
    lib = ctypes.CDLL(str(ggml.library_dir() / "libggml-cpu.so"))
    base = ctypes.CDLL(str(ggml.library_dir() / "libggml-base.so"))
    vp, size = ctypes.c_void_p, ctypes.c_size_t

    class Traits(ctypes.Structure):  # ggml-cpu.h's ggml_type_traits_cpu
        _fields_ = [
            ("from_float", ctypes.CFUNCTYPE(None, vp, vp, ctypes.c_int64)),
            ("vec_dot", ctypes.CFUNCTYPE(None, ctypes.c_int, vp, size, vp, size, vp, size, ctypes.c_int)),
            ("vec_dot_type", ctypes.c_int),
            ("nrows", ctypes.c_int64),
        ]

    lib.ggml_cpu_init()  # its kernels' tables (once a process; the wrapper's load also calls it)
    lib.ggml_get_type_traits_cpu.restype = ctypes.POINTER(Traits)
    base.ggml_row_size.restype, base.ggml_row_size.argtypes = size, [ctypes.c_int, ctypes.c_int64]
    traits = lib.ggml_get_type_traits_cpu(qtype).contents
    from_float = lib.ggml_get_type_traits_cpu(traits.vec_dot_type).contents.from_float
    k = x.shape[1]
    xq = np.zeros((len(x), base.ggml_row_size(traits.vec_dot_type, k)), np.uint8)
    out = np.zeros((len(x), len(raw)), np.float32)
    for r in range(len(x)):
        from_float(x[r].ctypes.data, xq[r].ctypes.data, k)
        for j in range(len(raw)):
            traits.vec_dot(k, out[r:, j:].ctypes.data, 0, raw[j].ctypes.data, 0, xq[r].ctypes.data, 0, 1)
    return out


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("rows,n,k", [(1, 64, 576), (3, 37, 1536), (16, 9, 256), (2, 3, 64)])
def test_few_rows_multiply_as_ggml_vec_dot_does_within_float32_sums(qtype, rows, n, k):
    """At a few rows the product is ggml's vec_dot's, column by column: Q4_1 and Q8_0 four columns a call where
    the CPU has AVX2 (ggml_ffi.cc's FourRows, the same steps as ggml's AVX2 vec_dot), Q4_0 by vec_dot itself; n
    leaves columns past the last four. Within float32 sums over k terms (the same bits where ggml was built for
    AVX2 as the wrapper is)."""
    rng = np.random.default_rng(rows * 100 + n)
    t = int(gguf.GGMLQuantizationType[qtype])
    raw = np.ascontiguousarray(ggml.random_blocks(qtype, n, k, rng))
    x = rng.standard_normal((rows, k)).astype(np.float32)
    y = np.asarray(jax.jit(ggml.matmul, static_argnums=2)(jnp.asarray(x), jnp.asarray(raw), t))
    bound = k * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(_dequantized(raw, qtype)).T)
    assert (np.abs(y - _ggml_vec_dot(x, raw, t)) <= bound).all()


@pytest.mark.parametrize("rows", [1, 5, ggml.FEW_ROWS + 1])
def test_weights_sharing_an_input_multiply_in_one_call_as_one_by_one(rows):
    """quantize.dense_shared (q/k/v, gate/up): ggml's blocks of one type in one call (x rounded once, one loop over
    every weight's columns) give each weight's own call's result to the bit; kernels of mixed kinds go one by one."""
    rng = np.random.default_rng(rows)
    t = int(gguf.GGMLQuantizationType.Q4_1)
    kernels = [quantize.GGMLBlocks(jnp.asarray(ggml.random_blocks("Q4_1", n, 256, rng)), t) for n in (96, 32, 33)]
    x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.float32)
    shared = jax.jit(quantize.dense_shared)(x, kernels)
    for y, w in zip(shared, kernels):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(quantize.dense(x, w)))
    mixed = [kernels[0], jnp.asarray(rng.standard_normal((256, 8)), jnp.float32)]
    for y, w in zip(quantize.dense_shared(x, mixed), mixed):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(quantize.dense(x, w)))


@pytest.mark.parametrize("rows", [1, 3, ggml.F32_FEW_ROWS, ggml.F32_FEW_ROWS + 1, 40])
def test_float32_rows_multiply_as_numpy_within_float32_sums(rows):
    """ggml's F32 rows (a float32 array [n, k]) at few rows (vec_dot_f32, x as it is) and past F32_FEW_ROWS
    (XLA's GEMM over the same array): x @ w.T within float32 rounding of sums over k terms (k ulps of the sum of
    |x_i w_i|, far below any error of layout or transposition)."""
    rng = np.random.default_rng(rows)
    k, n = 320, 33
    w, x = (rng.standard_normal(s).astype(np.float32) for s in ((n, k), (rows, k)))
    y = np.asarray(jax.jit(ggml.matmul, static_argnums=2)(jnp.asarray(x), jnp.asarray(w), ggml.F32))
    bound = k * np.finfo(np.float32).eps * np.abs(x) @ np.abs(w).T
    assert y.shape == (rows, n) and (np.abs(y - x.astype(np.float64) @ w.T.astype(np.float64)) <= bound).all()


def test_float32_weights_are_held_as_ggml_rows_on_a_cpu():
    """quantize.float_rows: a float32 linear kernel [layers, k, n] becomes ggml's F32 rows [layers, n, k], the
    embedding table its rows as they are; norms, other dtypes and quantized weights stay. Each computes what the
    float weight does: dense, dense_shared, the tied head (attend) and the lookup (take)."""
    rng = np.random.default_rng(7)
    kernel = jnp.asarray(rng.standard_normal((2, 64, 48)), jnp.float32)
    table = jnp.asarray(rng.standard_normal((40, 64)), jnp.float32)
    norm = jnp.asarray(rng.standard_normal(64), jnp.float32)
    half = jnp.asarray(rng.standard_normal((64, 8)), jnp.bfloat16)
    blocks = quantize.GGMLBlocks(jnp.asarray(ggml.random_blocks("Q4_1", 8, 64, rng)), 3)
    tree = {"q": {"kernel": kernel}, "embed": {"embedding": table}, "norm": {"weight": norm}}
    tree |= {"half": {"kernel": half}, "kept": {"kernel": blocks}}
    rows = quantize.float_rows(tree)
    assert isinstance(rows["q"]["kernel"], quantize.GGMLBlocks) and rows["q"]["kernel"].qtype == ggml.F32
    np.testing.assert_array_equal(rows["q"]["kernel"].raw, np.swapaxes(kernel, 1, 2))
    assert rows["embed"]["embedding"].raw is table
    assert rows["norm"]["weight"] is norm and rows["half"]["kernel"] is half and rows["kept"]["kernel"] is blocks
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5)
    close(quantize.dense(x, rows["q"]["kernel"].replace(raw=rows["q"]["kernel"].raw[0])), x @ kernel[0])
    layer = [rows["q"]["kernel"].replace(raw=rows["q"]["kernel"].raw[i]) for i in range(2)]
    for y, i in zip(quantize.dense_shared(x, layer), range(2)):
        close(y, x @ kernel[i])
    close(quantize.attend(x, rows["embed"]["embedding"]), x @ table.T)
    ids = jnp.asarray([3, 0, 39])
    np.testing.assert_array_equal(quantize.take(rows["embed"]["embedding"], ids, jnp.float32), table[ids])


def test_inputs_round_to_8_bit_blocks():
    """x as ggml rounds it for Q4_1's vec_dot (Q8_1: blocks of 32, a step of the block's largest |x| / 127, kept
    in float16: up to 127 steps times its 2^-11 more)."""
    x = np.random.default_rng(3).standard_normal((3, 256)).astype(np.float32)
    xr = np.asarray(ggml.rounded(jnp.asarray(x), int(gguf.GGMLQuantizationType.Q4_1)))
    step = np.repeat(np.abs(x).reshape(3, 8, 32).max(-1) / 127, 32, axis=-1)
    assert (np.abs(xr - x) <= step * (0.5 + 127 / 2**11)).all()
    assert not np.array_equal(xr, x)


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_dequantize_as_the_gguf_package_does(qtype):
    rng = np.random.default_rng(1)
    raw = ggml.random_blocks(qtype, 5, 768, rng)
    w = _dequantized(raw, qtype)
    got = np.asarray(ggml.to_float(jnp.asarray(raw), int(gguf.GGMLQuantizationType[qtype])))
    np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-6 * np.abs(w).max())


def test_embedding_rows_and_the_tied_head_read_the_table_in_place():
    """quantize.take looks up rows of a table kept in ggml's blocks, quantize.attend multiplies by all of them."""
    rng = np.random.default_rng(2)
    raw = ggml.random_blocks("Q8_0", 50, 256, rng)
    table = quantize.GGMLBlocks(jnp.asarray(raw), int(gguf.GGMLQuantizationType.Q8_0))
    w = _dequantized(raw, "Q8_0")
    ids = np.array([[3, 49], [0, 3]])
    np.testing.assert_allclose(np.asarray(quantize.take(table, jnp.asarray(ids), jnp.float32)), w[ids], rtol=1e-6)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    logits = np.asarray(quantize.attend(jnp.asarray(x), table))
    assert (np.abs(logits - x @ w.T) <= ggml.rounding_bound(x, w)).all()


def test_a_weight_whose_rows_are_not_whole_blocks_is_refused_by_name():
    raw = jnp.zeros((4, 30), jnp.uint8)  # Q4_1's blocks are 20 bytes
    with pytest.raises(ValueError, match="not whole Q4_1 blocks"):
        ggml.matmul(jnp.ones((1, 32)), raw, int(gguf.GGMLQuantizationType.Q4_1))
    with pytest.raises(ValueError, match="x has 64 columns; the weight's rows hold 32"):
        ggml.matmul(jnp.ones((1, 64)), jnp.zeros((4, 20), jnp.uint8), int(gguf.GGMLQuantizationType.Q4_1))


def test_a_damaged_cached_build_is_compiled_again(tmp_path):
    """The wrapper is cached per source, jaxlib, CPU and ggml; a file there that does not load (a half-written one from
    a crash) is replaced by a fresh build, which passes the load's check."""
    code = (
        "from jaxserve.models import ggml, registry; import pathlib; "
        "ggml.load(); print(*pathlib.Path(registry.cache_dir(), 'kernels').glob('ggml_ffi-*.so'))"
    )
    env = {**os.environ, "JAXSERVE_CACHE": str(tmp_path)}
    run = lambda: subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)  # noqa: E731
    built = pathlib.Path(run().stdout.split()[-1])
    built.write_bytes(b"not a shared library")
    assert pathlib.Path(run().stdout.split()[-1]) == built
    assert built.read_bytes()[:4] == b"\x7fELF"


def test_where_the_wrapper_cannot_be_built_xla_keeps_the_blocks_with_a_warning(tmp_path):
    """A compiler that cannot build it (here `false`, with an empty cache): ggml is not available, so a GGUF file's
    blocks load for XLA's kernels, and the log says why."""
    code = "from jaxserve.models import ggml; assert not ggml.available()"
    env = {**os.environ, "CXX": shutil.which("false"), "JAXSERVE_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "a GGUF file's blocks run on XLA, not ggml" in done.stderr


@pytest.mark.parametrize("tp", [2, 4])
def test_blocks_split_over_tensor_parallel_devices_multiply_as_the_whole(tp):
    """sharding/tp.py splits ggml's rows as each projection splits: q/k/v/gate/up by output columns (rows of
    blocks; k's repeated past the KV heads), o/down by input features (whole blocks of every row). Each device's
    share multiplied by its slice of x, concatenated or summed, gives the whole weight's product."""
    from jaxserve.models.config import LlamaConfig
    from jaxserve.sharding import tp as tensor_parallel

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=256,
        intermediate_size=512,
        num_layers=1,
        num_heads=4,
        num_kv_heads=1,
        head_dim=64,
        max_position_embeddings=128,
    )
    rng = np.random.default_rng(tp)
    t = int(gguf.GGMLQuantizationType.Q4_1)
    k_proj = quantize.GGMLBlocks(jnp.asarray(ggml.random_blocks("Q4_1", 64, 256, rng))[None], t)  # 1 KV head
    down = quantize.GGMLBlocks(jnp.asarray(ggml.random_blocks("Q4_1", 256, 512, rng))[None], t)
    tree = {"params": {"layers": {"self_attn": {"k_proj": {"kernel": k_proj}}, "mlp": {"down_proj": {"kernel": down}}}}}
    params, specs = tensor_parallel.shard_params(tree, cfg, tp)
    layers, layer_specs = params["params"]["layers"], specs["params"]["layers"]

    def shares(w: quantize.GGMLBlocks, spec) -> list[jax.Array]:
        axis = list(spec).index("tp")
        return np.split(np.asarray(w.raw[0]), tp, axis=axis - 1)

    x = rng.standard_normal((3, 256)).astype(np.float32)
    k_split = layers["self_attn"]["k_proj"]["kernel"]
    assert k_split.raw.shape == (1, 64 * tp, k_proj.raw.shape[-1])  # the KV head repeated for each device
    got = np.concatenate(
        [ggml.matmul(x, jnp.asarray(r), t) for r in shares(k_split, layer_specs["self_attn"]["k_proj"]["kernel"].raw)],
        -1,
    )
    np.testing.assert_allclose(got, np.tile(ggml.matmul(x, k_proj.raw[0], t), tp), rtol=1e-6)
    h = rng.standard_normal((3, 512)).astype(np.float32)
    parts = shares(layers["mlp"]["down_proj"]["kernel"], layer_specs["mlp"]["down_proj"]["kernel"].raw)
    got = sum(ggml.matmul(hp, jnp.asarray(r), t) for hp, r in zip(np.split(h, tp, axis=-1), parts))
    want = np.asarray(ggml.matmul(h, down.raw[0], t))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.fixture(scope="module")
def kept():
    return jaxserve.LLM(quantization="gguf", max_model_len=2048, kv_cache_tokens=4096, progress=False)


def test_smollm2_kept_in_ggml_blocks_scores_as_its_float32_weights_within_8_bit_inputs(kept, llm):
    """The default model, a Q4_1 GGUF, kept in its blocks on a CPU: every linear kernel and the embedding table are
    ggml's rows as stored, resident at under a fifth of float32's size. The float32 engine serves the same
    weights dequantized, so the two differ only by the 8-bit rounding of each matmul's input: scoring a text,
    they agree on the most likely next token at 95.9% of its positions and their logprobs differ by 0.07 nats on
    average (2026-12-07); a wrong block layout or scale misses by whole nats. Greedy tokens the kept model picks
    are, under float32, at most a near-tie from float32's own pick."""
    params = kept.builder.params["params"]
    assert isinstance(params["layers"]["mlp"]["down_proj"]["kernel"], quantize.GGMLBlocks)
    assert isinstance(params["embed_tokens"]["embedding"], quantize.GGMLBlocks)
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    assert nbytes(kept.builder.params) < 0.2 * nbytes(llm.builder.params)
    text = pathlib.Path(__file__).parents[2].joinpath("README.md").read_text()[:1500]
    ours, theirs = kept.prompt_logprobs(text, k=1)[1:], llm.prompt_logprobs(text, k=1)[1:]
    assert np.mean([a.top[0][0] == b.top[0][0] for a, b in zip(ours, theirs)]) > 0.9
    assert np.mean([abs(a.logprob - b.logprob) for a, b in zip(ours, theirs)]) < 0.15
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]
    for p, out in zip(prompts, kept.generate(prompts, SamplingParams(max_tokens=24))):
        ids = kept.tokenizer.encode(p)
        scored = llm.prompt_logprobs(ids + list(out.token_ids), k=1)[len(ids) :]
        assert max(s.top[0][1] - s.logprob for s in scored) < 1.0
