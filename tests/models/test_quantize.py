"""Weights kept quantized (jaxserve/models/quantize.py): the matmuls against numpy on the dequantized weights, the
quantization error within each method's step, a GGUF file's blocks against the gguf package's own dequantization,
and the real model served from its GGUF blocks against the float32 path."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve.models import ggml, loader, quantize
from jaxserve.models.gguf_loader import KEPT, GGUFFile, load_gguf
from jaxserve.sampling_params import SamplingParams

METHODS = ("int8", "int4", "fp8")


def _weights(seed: int, layers: int, k: int, n: int, vocab: int) -> dict:
    """Random float weights with an outlier column and a constant block, as real checkpoints have."""
    rng = np.random.default_rng(seed)
    kernel = rng.normal(0, 0.05, (layers, k, n)).astype(np.float32)
    kernel[..., 1] *= 20
    kernel[0, :32, 2] = 0.25
    table = rng.normal(0, 1.0, (vocab, k)).astype(np.float32)
    return {
        "params": {
            "proj": {"kernel": jnp.asarray(kernel)},
            "embed_tokens": {"embedding": jnp.asarray(table)},
            "norm": {"weight": jnp.asarray(rng.normal(1, 0.1, k).astype(np.float32))},
        }
    }


def _step(w: np.ndarray, q: quantize.Quantized) -> np.ndarray:
    """Each element's quantization step: its scale (the values are integers), or its size for fp8's 3 bits."""
    scale = np.asarray(q.scale, np.float32)
    for axis, (b, n) in enumerate(zip(scale.shape, w.shape)):
        scale = np.repeat(scale, n // b, axis=axis) if b != n else scale
    return scale if jnp.dtype(q.qtype) != jnp.dtype(jnp.float8_e4m3fn) else np.abs(w) / 8 + scale / 2**9


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("layers,k,n", [(1, 64, 96), (3, 128, 32)])
def test_quantized_weights_are_within_a_step_and_multiply_as_their_dequantized_values(
    method, layers, k, n, monkeypatch
):
    monkeypatch.setattr(quantize, "CPU_ROWS", 16)  # a CPU's LM head in pieces: 40 rows in 4 of 10
    params = _weights(layers * k + n, layers, k, n, vocab=40)
    q = quantize.quantize_params(params, method)["params"]
    kernel, table = q["proj"]["kernel"], q["embed_tokens"]["embedding"]
    assert q["norm"]["weight"] is params["params"]["norm"]["weight"]  # norms stay float
    for w, qw in ((params["params"]["proj"]["kernel"], kernel), (params["params"]["embed_tokens"]["embedding"], table)):
        w = np.asarray(w)
        error = np.abs(np.asarray(qw.dequantize(jnp.float32)) - w)
        # half a step, and the float16 scale's rounding (qwix rounds with the float32 scale, then stores float16)
        assert np.all(error <= 0.5 * _step(w, qw) + np.abs(w) * 2**-10 + 1e-7), (method, error.max())

    rng = np.random.default_rng(7)
    x = rng.normal(0, 1, (5, k)).astype(np.float32)
    wd = np.asarray(kernel.dequantize(jnp.float32), np.float64)
    for layer in range(layers):
        one = jax.tree.map(lambda a: a[layer], kernel)  # a layer's slice, as the scan reads it
        got = np.asarray(jax.jit(quantize.dense)(jnp.asarray(x), one))
        want = x @ wd[layer]
        bound = 1e-5 * (np.abs(x) @ np.abs(wd[layer])) + 1e-6  # float32 accumulation over k terms
        np.testing.assert_array_less(np.abs(got - want), bound)
    td = np.asarray(table.dequantize(jnp.float32), np.float64)
    got = np.asarray(jax.jit(quantize.attend)(jnp.asarray(x), table))
    np.testing.assert_array_less(np.abs(got - x @ td.T), 1e-5 * (np.abs(x) @ np.abs(td.T)) + 1e-6)
    ids = jnp.asarray([[3, 39, 0], [3, 3, 17]])
    np.testing.assert_array_equal(np.asarray(quantize.take(table, ids, jnp.float32)), td[np.asarray(ids)])


def test_resident_bytes_are_a_quarter_and_about_an_eighth_of_float32():
    params = _weights(0, 2, 256, 512, vocab=64)
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    full = nbytes(params)
    int8, int4 = (nbytes(quantize.quantize_params(params, m)) for m in ("int8", "int4"))
    assert 0.25 <= int8 / full < 0.26  # 8 bits and a float16 scale per column
    assert 0.125 <= int4 / full < 0.134  # 4 bits and a float16 scale and offset per 128: 4.25 bits


def test_int4_in_bfloat16_rounds_once():
    """In a bfloat16 model the product and the offsets' share are summed in float32: for inputs with a mean they
    nearly cancel, and rounding each to bfloat16 first cost 14% of the output (now about bfloat16's own 1%)."""
    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.02, (4096, 256)).astype(np.float32)
    kernel = quantize.quantize_params({"params": {"p": {"kernel": jnp.asarray(w)}}}, "int4")["params"]["p"]["kernel"]
    x = rng.normal(0.5, 1.0, (8, 4096)).astype(np.float32)
    exact = x.astype(np.float64) @ np.asarray(kernel.dequantize(jnp.float32), np.float64)
    got = np.asarray(jax.jit(quantize.dense)(jnp.asarray(x, jnp.bfloat16), kernel), np.float64)
    assert np.sqrt(np.mean((got - exact) ** 2) / np.mean(exact**2)) < 0.03


def test_int4_kv_heads_repeat_for_tensor_parallelism():
    """tp beyond the KV heads repeats each KV head's columns: packed 4-bit values (two columns a byte) repeat as the
    float weight's columns do."""
    from jaxserve.models.config import LlamaConfig
    from jaxserve.sharding import tp as tensor_parallel

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=128,
    )
    w = jnp.asarray(np.random.default_rng(4).normal(0, 0.1, (1, 64, 16)), jnp.float32)
    q = quantize.quantize_params({"params": {"layers": {"self_attn": {"k_proj": {"kernel": w}}}}}, "int4")
    kernel = q["params"]["layers"]["self_attn"]["k_proj"]["kernel"]
    float_tree = {"params": {"layers": {"self_attn": {"k_proj": {"kernel": kernel.dequantize(jnp.float32)}}}}}
    want = tensor_parallel.shard_params(float_tree, cfg, 2)[0]["params"]["layers"]["self_attn"]["k_proj"]["kernel"]
    got = tensor_parallel.shard_params(q, cfg, 2)[0]["params"]["layers"]["self_attn"]["k_proj"]["kernel"]
    assert want.shape == (1, 64, 32)
    np.testing.assert_array_equal(np.asarray(got.dequantize(jnp.float32)), np.asarray(want))


def test_int4_blocks_are_the_largest_multiple_of_32_up_to_128_that_divides_the_input():
    assert [quantize.int4_block(n) for n in (4096, 14336, 576, 1536, 64, 160)] == [128, 128, 96, 128, 64, 32]
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize.quantize_params({"params": {"p": {"kernel": jnp.ones((40, 8))}}}, "int4")


@pytest.mark.parametrize("contracted", [0, 1])
@pytest.mark.parametrize(
    "k,block,qtype", [(256, 128, jnp.int4), (192, 96, jnp.int4), (128, 32, jnp.int8), (64, 16, jnp.int8)]
)
def test_a_gemm_per_block_equals_the_dequantized_gemm(contracted, k, block, qtype):
    """_by_block (one GEMM per block, each scaled after: what a GPU runs at few rows) and _dequantized (the weight
    dequantized first) against float64 on random values and scales (offsets are added by their caller), for a
    kernel [k, n] and a table [n, k]."""
    rng = np.random.default_rng(k + block + contracted)
    n, blocks = 48, k // block
    shape, scale_shape = ((k, n), (blocks, n)) if contracted == 0 else ((n, k), (n, blocks))
    low, high = (-8, 8) if qtype == jnp.int4 else (-128, 128)
    w = quantize.Quantized(
        jnp.asarray(rng.integers(low, high, shape), qtype),
        jnp.asarray(rng.uniform(0.01, 0.1, scale_shape), jnp.float16),
        qtype=qtype,
    )
    weight = np.asarray(w.dequantize(jnp.float32), np.float64)
    weight = weight if contracted == 0 else weight.T  # [k, n]
    x = rng.normal(0.3, 1.0, (3, k)).astype(np.float32)
    bound = 1e-5 * (np.abs(x) @ np.abs(weight)) + 1e-6  # float32 sums of k terms
    for fn in (quantize._by_block, quantize._dequantized):
        got = np.asarray(jax.jit(fn, static_argnums=2)(jnp.asarray(x), w, contracted), np.float64)
        np.testing.assert_array_less(np.abs(got - x @ weight), bound)


@pytest.mark.parametrize("qtype,offset", [(jnp.uint4, True), (jnp.uint4, False), (jnp.int4, True)])
def test_an_accelerator_keeps_4bit_values_as_signed_int4_that_dequantize_the_same(monkeypatch, qtype, offset):
    """Off a CPU, 4-bit values stay XLA's own int4 (a GPU converts those inside its GEMM); unsigned ones (a GGUF
    file's Q4_1, Q4_K) become signed, their offset moved by 8 scales. Either way the weight is the same."""
    rng = np.random.default_rng(5)
    low = 0 if qtype == jnp.uint4 else -8
    q = quantize.Quantized(
        rng.integers(low, low + 16, (64, 32)).astype(np.int8),
        rng.uniform(0.01, 0.1, (2, 32)).astype(np.float16),
        rng.normal(0, 0.1, (2, 32)).astype(np.float16) if offset else None,
        qtype,
    )
    on_cpu = quantize.on_device(q, jnp.float32)
    assert on_cpu.packed and on_cpu.values.dtype == jnp.uint8 and on_cpu.values.shape == (64, 16)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    native = quantize.on_device(q, jnp.float32)
    assert not native.packed and native.values.dtype == jnp.int4 and native.values.shape == (64, 32)
    assert quantize.nbytes(native.values) == quantize.nbytes(on_cpu.values) == 64 * 16  # XLA packs int4 on a GPU
    want = np.asarray(on_cpu.dequantize(jnp.float32))
    # the same sums in another order: float32 rounding of weights of at most about 1.6
    np.testing.assert_allclose(
        np.asarray(native.dequantize(jnp.float32)), want, rtol=0, atol=4 * 2**-23 * np.abs(want).max()
    )


def _raw_blocks(qtype: gguf.GGMLQuantizationType, rows: int, cols: int, rng) -> np.ndarray:
    """Random bytes in a GGUF type's block layout, its float16 scale fields set to modest values (first in the
    block, but last in Q2_K's, Q3_K's and Q6_K's)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    halves = 2 if qtype.name in ("Q4_1", "Q4_K", "Q5_1", "Q5_K", "Q2_K") else 1
    scales = rng.uniform(-0.05, 0.05, (raw.shape[0], halves)).astype(np.float16).view(np.uint8)
    if qtype.name in ("Q2_K", "Q3_K", "Q6_K"):
        raw[:, -2 * halves :] = scales.reshape(raw.shape[0], -1)
    else:
        raw[:, : 2 * halves] = scales.reshape(raw.shape[0], -1)
    return raw.reshape(rows, cols // block * size)


@pytest.mark.parametrize("qtype", list(KEPT))
def test_gguf_blocks_kept_equal_the_gguf_packages_dequantization(qtype, tmp_path):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 6, 512
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tensor("w", _raw_blocks(qtype, rows, cols, rng), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = GGUFFile(tmp_path / "t.gguf")
    want = f.tensor("w")
    assert want.shape == (rows, cols) and np.all(np.isfinite(want)) and np.std(want) > 0
    kept = quantize.on_device(f.blocks("w"), jnp.float32)
    np.testing.assert_allclose(np.asarray(kept.dequantize(jnp.float32)), want, rtol=1e-6, atol=1e-7)
    # transposed to a kernel [in, out] (as loaders do) it multiplies as the dequantized weight
    kernel = quantize.on_device(jax.tree.map(lambda a: np.ascontiguousarray(a.T), f.blocks("w")), jnp.float32)
    x = rng.normal(0, 1, (3, cols)).astype(np.float32)
    got = np.asarray(quantize.dense(jnp.asarray(x), kernel))
    np.testing.assert_array_less(
        np.abs(got - x @ want.T.astype(np.float64)), 1e-5 * (np.abs(x) @ np.abs(want.T)) + 1e-6
    )


@pytest.mark.parametrize("first", ["Q4_K", "Q5_K"])
def test_layers_stored_in_different_types_stack_in_one_layout(tmp_path, first, monkeypatch):
    """Q4_K_M's files store some weights' layers in Q4_K and others in Q6_K (Q5_K_M's: Q5_K and Q6_K). Kept for
    XLA (mixed_layout: int8 values, a scale and offset per 16), each layer dequantizes to the file's own values
    and multiplies as them. (ggml's rows cannot stack layers of two row sizes: with ggml they are dequantized.)"""
    monkeypatch.setattr(ggml, "available", lambda: False)
    rng = np.random.default_rng(7)
    hidden, ffn, heads, kv_heads, head_dim = 256, 512, 4, 2, 64
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    for key, value in {
        "embedding_length": hidden,
        "feed_forward_length": ffn,
        "block_count": 2,
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
        "context_length": 512,
        "vocab_size": 64,
    }.items():
        writer.add_uint32(f"llama.{key}", value)
    shapes = {
        "attn_q": (hidden, hidden),
        "attn_k": (kv_heads * head_dim, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (ffn, hidden),
    }
    mixed = {"attn_v": (kv_heads * head_dim, hidden), "ffn_down": (hidden, ffn)}
    writer.add_tensor("token_embd.weight", rng.normal(0, 0.02, (64, hidden)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i, qtype in enumerate((gguf.GGMLQuantizationType[first], gguf.GGMLQuantizationType.Q6_K)):
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(hidden, np.float32))
        for name, shape in shapes.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", rng.normal(0, 0.02, shape).astype(np.float32))
        for name, (rows, cols) in mixed.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", _raw_blocks(qtype, rows, cols, rng), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _, floats, _ = load_gguf(tmp_path / "m.gguf")
    _, kept, _ = load_gguf(tmp_path / "m.gguf", keep_quantized=True)
    layers = kept["params"]["layers"]
    for block, name in (("self_attn", "v_proj"), ("mlp", "down_proj")):
        w = quantize.on_device(layers[block][name]["kernel"], jnp.float32)
        want = floats["params"]["layers"][block][name]["kernel"]
        assert isinstance(w, quantize.Quantized) and w.values.dtype == jnp.int8 and w.offset is not None
        assert w.values.shape == want.shape and w.scale.shape == (2, want.shape[1] // 16, want.shape[2])
        np.testing.assert_allclose(np.asarray(w.dequantize(jnp.float32)), want, rtol=1e-6, atol=1e-7)
        x = rng.normal(0, 1, (3, want.shape[1])).astype(np.float32)
        for i in range(2):
            got = np.asarray(quantize.dense(jnp.asarray(x), jax.tree.map(lambda a: a[i], w)))  # noqa: B023
            np.testing.assert_array_less(
                np.abs(got - x @ want[i].astype(np.float64)), 1e-5 * (np.abs(x) @ np.abs(want[i])) + 1e-6
            )
    assert not isinstance(layers["self_attn"]["q_proj"]["kernel"], quantize.Quantized)  # float32 stays float


def test_gguf_blocks_need_a_gguf_file():
    with pytest.raises(ValueError, match="not a .gguf file"):
        loader.load_weights("random:tiny", "float32", "gguf")


def test_smollm2_served_from_its_q4_1_blocks_through_xla_equals_the_float32_path(llm, monkeypatch):
    """The default model is a Q4_1 GGUF file: kept in its blocks (quantization=gguf) where ggml's kernels cannot
    run (XLA dequantizes them: tests/models/test_ggml_kernels.py has ggml's), resident at a fifth of the float32
    weights, it gives the float32 engine's greedy tokens."""
    monkeypatch.setattr(ggml, "available", lambda: False)
    kept = jaxserve.LLM(quantization="gguf", max_model_len=2048, kv_cache_tokens=4096, progress=False)
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    assert nbytes(kept.builder.params) < 0.2 * nbytes(llm.builder.params)
    prompts = ["The capital of France is", "Write a short poem about rain.", "def fibonacci(n):"]
    greedy = SamplingParams(max_tokens=24)
    assert [c.token_ids for c in kept.generate(prompts, greedy)] == [c.token_ids for c in llm.generate(prompts, greedy)]
