"""Pallas attention kernels against their pure-jnp references on random data (compiled on a GPU, interpret mode
elsewhere: tests/pallas_kernels/kernel_check.py).

Shapes are small because interpret mode is slow on CPU; sizes are chosen so t and s are not multiples of the
tiles, GQA ratios 1 and 3, head dims both powers of two and not.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxserve.engine import batch
from jaxserve.engine.runner import ModelRunner
from jaxserve.models.config import LlamaConfig
from jaxserve.models.llama import init_params

from jaxserve.pallas_kernels import (
    chunk_attention,
    common,
    decode_attention,
    dispatch,
    merge,
    reference,
    tiled_paged_attention,
)
from jaxserve.pallas_kernels.reference import NO_POSITION
from kernel_check import IMPL, TOL


def random_qkv(rng, t, s, h, kvh, d):
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((t, h, d), (s, kvh, d), (s, kvh, d)))
    return q, k, v


def check_chunk(q, k, v, q_pos, k_pos, window=None, **tiles):
    q_pos, k_pos = jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32)
    o, lse = dispatch.chunk_attention(q, k, v, q_pos, k_pos, window, implementation=IMPL, **tiles)
    ro, rlse = reference.chunk_attention(q, k, v, q_pos, k_pos, window)
    assert o.dtype == lse.dtype == jnp.float32
    np.testing.assert_allclose(o, ro, **TOL)
    np.testing.assert_allclose(lse, rlse, **TOL)
    return np.asarray(o), np.asarray(lse)


@pytest.mark.parametrize(
    "h, kvh, d, hist, t, block_q, block_k",
    [(6, 2, 16, 32, 40, 16, 32), (4, 4, 32, 19, 27, 16, 16), (6, 2, 24, 0, 33, 16, 16)],
    ids=["gqa3-history", "mha-history", "gqa3-d24-causal"],
)
def test_chunk_history_plus_causal(h, kvh, d, hist, t, block_q, block_k):
    rng = np.random.default_rng(hist * 100 + t)
    q, k, v = random_qkv(rng, t, hist + t, h, kvh, d)
    _, lse = check_chunk(q, k, v, hist + np.arange(t), np.arange(hist + t), block_q=block_q, block_k=block_k)
    assert np.isfinite(lse).all()


@pytest.mark.parametrize("window", [1, 9, 50])
def test_chunk_sliding_window(window):
    """A sliding window: the kernel equals the reference, and the reference equals attention over exactly the
    window's keys (each query alone, with numpy's softmax)."""
    rng = np.random.default_rng(window)
    h, kvh, d, hist, t = 6, 2, 16, 32, 40
    q, k, v = random_qkv(rng, t, hist + t, h, kvh, d)
    o, _ = check_chunk(q, k, v, hist + np.arange(t), np.arange(hist + t), window, block_q=16, block_k=16)
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    for i in range(t):
        p = hist + i
        keys = slice(max(0, p - window + 1), p + 1)
        for j in range(h):
            s = kn[keys, j // 3] @ qn[i, j] / np.sqrt(d)
            w = np.exp(s - s.max())
            np.testing.assert_allclose(o[i, j], (w / w.sum()) @ vn[keys, j // 3], **TOL)


def test_chunk_zigzag_positions():
    # One device's zigzag shard of a 64-token chunk over 2 devices (blocks 0 and 3 of 4) after 20 history tokens;
    # the keys are the shuffled history and the whole chunk in zigzag device-major order.
    rng = np.random.default_rng(7)
    hist, n, h, kvh, d = 20, 64, 6, 2, 16
    blocks = np.arange(n).reshape(4, n // 4)
    zigzag = np.concatenate([blocks[0], blocks[3], blocks[1], blocks[2]])
    q_pos = hist + zigzag[: n // 2]
    k_pos = np.concatenate([rng.permutation(hist), hist + zigzag])
    q, k, v = random_qkv(rng, len(q_pos), len(k_pos), h, kvh, d)
    check_chunk(q, k, v, q_pos, k_pos, block_q=16, block_k=32)


# a CPU's chunk attention: keys in steps (reference.KEY_STEP), merged; steps that divide the keys or not, a step of
# padding keys alone, a window, GQA, padded queries
@pytest.mark.parametrize("s, step, window", [(96, 32, None), (100, 32, None), (100, 24, 9), (70, 64, None)])
def test_chunk_attention_in_key_steps_equals_dense(s, step, window):
    rng = np.random.default_rng(s + step)
    t, h, kvh, d = 37, 6, 2, 16
    q, k, v = random_qkv(rng, t, s, h, kvh, d)
    q_pos = s - t + np.arange(t)
    q_pos[-3:] = -1
    k_pos = rng.permutation(s)
    k_pos[-5:] = NO_POSITION
    want = reference.chunk_attention(q, k, v, jnp.asarray(q_pos), jnp.asarray(k_pos), window)
    got = reference.chunk_attention(q, k, v, jnp.asarray(q_pos), jnp.asarray(k_pos), window, step)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **TOL)


def test_chunk_padding_sees_nothing():
    rng = np.random.default_rng(11)
    t, s, h, kvh, d = 29, 45, 4, 4, 16
    q_pos = 10 + np.arange(t)
    q_pos[-5:] = -1  # padded queries
    q_pos[0] = 0  # a real query before every real key
    k_pos = 3 + np.arange(s)
    k_pos[-9:] = NO_POSITION  # padded keys
    q, k, v = random_qkv(rng, t, s, h, kvh, d)
    o, lse = check_chunk(q, k, v, q_pos, k_pos, block_q=16, block_k=16)
    blind = np.r_[0, np.arange(t - 5, t)]
    assert (lse[blind] == -np.inf).all() and (o[blind] == 0).all()
    assert np.isfinite(np.delete(lse, blind, axis=0)).all()


def test_chunk_kernel_visits_exactly_the_key_blocks_a_query_block_can_see():
    rng = np.random.default_rng(5)
    q_pos = rng.permutation(96)  # any order: history stores and zigzag shards are not sorted
    k_pos = rng.permutation(np.r_[np.arange(100), np.full(28, NO_POSITION)])
    listed = np.asarray(chunk_attention.visible_blocks(jnp.asarray(q_pos), jnp.asarray(k_pos), 32, 16, 16))
    assert listed.shape == (3, 16)
    for qb, row in enumerate(listed):
        want = [kb for kb in range(8) if k_pos[kb * 16 : (kb + 1) * 16].min() <= q_pos[qb * 32 : (qb + 1) * 32].max()]
        assert list(row[: len(want)]) == want and (row[len(want) :] == -1).all()


def decode_case(rng, h, kvh, d, block_size, nblk, kv_lens):
    b = len(kv_lens)
    num_blocks = b * nblk + 3
    tables = rng.permutation(num_blocks)[: b * nblk].reshape(b, nblk)  # blocks scattered over the pool
    caches = (jnp.asarray(rng.standard_normal((num_blocks * block_size, kvh, d)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.float32)
    return (q, *caches, jnp.asarray(tables, jnp.int32), jnp.asarray(kv_lens, jnp.int32))


@pytest.mark.parametrize(
    "h, kvh, d, block_size, nblk, num_splits, kv_lens, key_block",
    [
        (6, 2, 16, 8, 8, 4, [1, 17, 64, 0, 37], 8),
        (6, 2, 16, 8, 8, 4, [1, 17, 64, 0, 37], 16),
        (4, 4, 32, 16, 4, 2, [50, 3], 128),
        (8, 2, 32, 16, 16, 2, [1, 70, 200, 256, 0, 129], 64),
    ],
    ids=["gqa3-4splits-1page", "gqa3-4splits-2pages", "mha-2splits", "gqa4-2splits-4pages"],
)
def test_paged_decode(h, kvh, d, block_size, nblk, num_splits, kv_lens, key_block):
    args = decode_case(np.random.default_rng(block_size + nblk), h, kvh, d, block_size, nblk, kv_lens)
    split = dict(block_size=block_size, num_splits=num_splits)
    o, lse = dispatch.paged_decode_attention(*args, implementation=IMPL, key_block=key_block, **split)
    ro, rlse = reference.paged_decode_attention(*args, **split)
    np.testing.assert_allclose(o, ro, **TOL)
    np.testing.assert_allclose(lse, rlse, **TOL)
    # A split starting at or past kv_len is empty: o=0, lse=-inf.
    per_split = nblk // num_splits * block_size
    empty = np.arange(num_splits)[None, :] * per_split >= np.asarray(kv_lens)[:, None]
    assert empty.any() and (np.asarray(lse)[empty] == -np.inf).all() and (np.asarray(o)[empty] == 0).all()
    assert np.isfinite(np.asarray(lse)[~empty]).all()


def test_decode_partials_merge_to_unsplit():
    args = decode_case(np.random.default_rng(3), 6, 2, 16, 8, 8, [1, 17, 64, 0, 37])
    o, lse = dispatch.paged_decode_attention(*args, block_size=8, num_splits=4, implementation=IMPL)
    mo, mlse = dispatch.merge_attention(jnp.moveaxis(o, 1, 0), jnp.moveaxis(lse, 1, 0), implementation=IMPL)
    ro, rlse = reference.paged_decode_attention(*args, block_size=8, num_splits=1)
    np.testing.assert_allclose(mo, ro[:, 0], **TOL)
    np.testing.assert_allclose(mlse, rlse[:, 0], **TOL)


@pytest.mark.parametrize("shape", [(3, 5, 4, 16), (2, 7, 24)], ids=["n3-rows20-d16", "n2-rows7-d24"])
def test_merge_with_empty_partials(shape):
    rng = np.random.default_rng(len(shape))
    o = rng.standard_normal(shape).astype(np.float32)
    lse = 3 * rng.standard_normal(shape[:-1]).astype(np.float32)
    lse[rng.random(lse.shape) < 0.4] = -np.inf  # some partials empty
    all_empty = (slice(None), 1) + (0,) * (lse.ndim - 2)
    lse[all_empty] = -np.inf  # one row where every partial is empty
    out, out_lse = dispatch.merge_attention(jnp.asarray(o), jnp.asarray(lse), implementation=IMPL)
    ro, rlse = reference.merge_attention(jnp.asarray(o), jnp.asarray(lse))
    np.testing.assert_allclose(out, ro, **TOL)
    np.testing.assert_allclose(out_lse, rlse, **TOL)
    assert np.asarray(out_lse)[all_empty[1:]] == -np.inf and (np.asarray(out)[all_empty[1:]] == 0).all()


def test_kernels_lower_to_triton_for_cuda():
    """Without a GPU, lowering for CUDA still runs the Pallas -> Triton lowering: tile sizes, supported ops."""
    f32, bf16, i32, fp8 = (
        functools.partial(jax.ShapeDtypeStruct, dtype=t)
        for t in (jnp.float32, jnp.bfloat16, jnp.int32, jnp.float8_e4m3fn)
    )
    cases = [
        (
            chunk_attention.chunk_attention,
            (bf16((100, 9, 64)), bf16((300, 3, 64)), bf16((300, 3, 64)), i32((100,)), i32((300,))),
        ),
        (
            functools.partial(decode_attention.paged_decode_attention, block_size=16, num_splits=4),
            (bf16((3, 32, 80)), bf16((4096, 8, 80)), bf16((4096, 8, 80)), i32((3, 16)), i32((3,))),
        ),
        (merge.merge_attention, (f32((3, 5, 32, 128)), f32((3, 5, 32)))),
        (
            functools.partial(tiled_paged_attention.tiled_paged_attention, block_size=16, key_block=128),
            (bf16((8, 16, 32, 128)), i32((8, 16)), bf16((4096, 8, 128)), bf16((4096, 8, 128)), i32((8, 32))),
        ),
        # with a sliding window (its mask and its first key block)
        (
            functools.partial(chunk_attention.chunk_attention, window=50),
            (bf16((100, 9, 64)), bf16((300, 3, 64)), bf16((300, 3, 64)), i32((100,)), i32((300,))),
        ),
        (
            functools.partial(tiled_paged_attention.tiled_paged_attention, block_size=16, key_block=128, window=300),
            (bf16((8, 16, 32, 128)), i32((8, 16)), bf16((4096, 8, 128)), bf16((4096, 8, 128)), i32((8, 32))),
        ),
        # an fp8 cache (--kv_cache_dtype=fp8) under bfloat16 queries
        (
            functools.partial(tiled_paged_attention.tiled_paged_attention, block_size=16, key_block=128),
            (bf16((8, 16, 32, 128)), i32((8, 16)), fp8((4096, 8, 128)), fp8((4096, 8, 128)), i32((8, 32))),
        ),
    ]
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    for fn, args in cases:
        with common.lowering_for(["cuda"]):
            module = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[triton])(*args).mlir_module()
        assert "xla.gpu.triton" in module


def test_serving_step_lowers_for_cuda_with_the_kernel():
    """The engine's whole step (a Llama-shaped model in bfloat16, GQA 4:1, head_dim 128) lowered for CUDA from this
    machine: its attention is the Triton kernel, for a decode-only bucket and a mixed one."""
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=512,
        intermediate_size=1024,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        head_dim=128,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    params = init_params(cfg, jax.random.key(0))
    buckets = batch.Buckets.make(
        max_num_batched_tokens=256, max_num_seqs=8, max_model_len=4096, block_size=16, key_block=256
    )
    runner = ModelRunner(
        cfg, params, jnp.bfloat16, num_blocks=64, block_size=16, buckets=buckets, key_block=256, attention="kernel"
    )
    for shape in (buckets.decode(8), buckets.mixed(*buckets.fit(256, 8))):
        hlo = runner.lower(shape, platforms=["cuda"]).as_text()
        assert "__gpu$xla.gpu.triton" in hlo and "tiled_paged_attention" in hlo


def test_pipelining_depth_fits_shared_memory():
    bf16 = 2
    # the engine's ragged kernel on GPU: K and V tiles of 256 x 128 per step beside a 128-row query group
    assert common.pipeline_stages(stage_bytes=2 * 256 * 128 * bf16, fixed_bytes=128 * 128 * bf16) == 1
    # the decode kernel's default: key blocks of 128 beside a 16-row group
    assert common.pipeline_stages(stage_bytes=2 * 128 * 128 * bf16, fixed_bytes=16 * 128 * bf16) == 2


def test_dispatch_defaults_and_rejects_unknown():
    assert dispatch.resolve(None) == ("kernel" if jax.default_backend() == "gpu" else "reference")
    with pytest.raises(ValueError, match="unknown implementation"):
        dispatch.resolve("triton")


def test_bench_attention_smoke_writes_every_part(tmp_path):
    """The GPU benchmark runs anywhere with --smoke, and its JSON holds every part (it is written after each)."""
    out = tmp_path / "attention.json"
    tool = pathlib.Path(__file__).parents[2] / "tools" / "bench" / "attention.py"
    # on a GPU this process holds most of its memory already (JAX preallocates): the child allocates as it goes
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    proc = subprocess.run(
        [sys.executable, str(tool), "--smoke", f"--out={out}"], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [r["seq"] for r in results["chunk"]] == [256]
    assert results["decode"]["kv_bytes"] > 0 and results["ring"]["devices"] == 1
    assert not results["gpu_figures"]
