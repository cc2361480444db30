"""Ragged paged attention (the engine's flat batch: decodes and prefill chunks of many requests in one token
axis) against plain causal attention per request, on random data packed by the engine's own batch.pack: the
jnp reference and the Pallas kernel (interpret mode; compiled through Triton on a GPU:
tests/pallas_kernels/kernel_check.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine import batch
from jaxserve.sampling_params import SamplingParams
from jaxserve.pallas_kernels.paged_attention import held_pages
from jaxserve.pallas_kernels.ragged_paged_attention import ragged_paged_attention
from jaxserve.pallas_kernels import dispatch, reference
from jaxserve.pallas_kernels import tiled_paged_attention as tiled_kernel
from jaxserve.pallas_kernels.reference import merge_attention
from kernel_check import IMPL, TOL
from test_paged_attention import dense_reference

# float32 softmax over at most a few hundred keys of O(1) scores: the online (blockwise) and the float64 dense
# reference differ by rounding of ~sqrt(keys) * eps_f32 * |v| ~ 1e-6 on outputs of magnitude ~1 (TOL); on a GPU
# the dots round to tf32 (kernel_check).


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (9, 3)])
# the reference at every tiling; the kernel (slow in interpret mode) at the GPU-like one: pages of 16, two per key
# block, chunks in tiles of 8
@pytest.mark.parametrize(
    "block_size, key_block, tile, implementation",
    [(4, 8, 4, "reference"), (16, 32, 8, "reference"), (8, 64, 32, "reference"), (16, 32, 8, IMPL)],
)
@pytest.mark.parametrize(
    "rows",
    [
        [(0, 1)],  # one decode at position 0
        [(5, 1), (37, 1), (0, 9)],  # two decodes and a prompt
        [(3, 20), (0, 1), (48, 13), (100, 1), (0, 33)],  # chunks with histories, decodes, uneven lengths
    ],
)
def test_ragged_paged_attention_matches_dense(
    heads, kv_heads, block_size, key_block, tile, rows, implementation, window=None
):
    rng = np.random.default_rng(heads * 1000 + block_size * 10 + len(rows))
    d = 16
    kv_lens = [h + n for h, n in rows]
    max_len = max(kv_lens)
    buckets = batch.Buckets.make(
        max_num_batched_tokens=128,
        max_num_seqs=8,
        max_model_len=max_len,
        block_size=block_size,
        key_block=key_block,
        tile=tile,
        min_tokens=8,
    )
    nblk = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(nblk) + 5
    perm = rng.permutation(np.arange(1, num_blocks))  # blocks scattered over the pool
    tables, at = [], 0
    for k in nblk:
        tables.append(perm[at : at + k].tolist())
        at += k
    k_cache = rng.standard_normal((num_blocks * block_size, kv_heads, d)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks * block_size, kv_heads, d)).astype(np.float32)
    step = [batch.Row([0] * n, h, table, SamplingParams(), 0, 0) for (h, n), table in zip(rows, tables)]
    a = batch.pack(step, buckets, block_size)
    q = rng.standard_normal((len(a.token_ids), heads, d)).astype(np.float32)

    # one program per view (the tables change, not their shapes)
    attend = jax.jit(
        lambda tables, page_pos=None: ragged_paged_attention(
            jnp.asarray(q),
            jnp.asarray(a.positions),
            jnp.asarray(k_cache),
            jnp.asarray(v_cache),
            tables,
            jnp.asarray(a.decode_token),
            jnp.asarray(a.tile_tokens),
            jnp.asarray(a.tile_row),
            block_size=block_size,
            key_block=key_block,
            window=window,
            page_pos=page_pos,
            implementation=implementation,
        )
    )
    got, lse = (np.asarray(x) for x in attend(a.tables))
    # a KV-parallel group's view: each of 3 devices sees the blocks b % 3 == i, either as they lie (the others -1)
    # or its own first with their positions (held_pages: what the engine passes); the partials merged by their
    # log-sum-exp are the whole attention again
    held = [(a.tables >= 0) & (a.tables % 3 == i) for i in range(3)]
    for view in (
        lambda i: attend(np.where(held[i], a.tables, -1)),
        lambda i: attend(*held_pages(jnp.asarray(a.tables), jnp.asarray(held[i]), block_size, reference.NO_POSITION)),
    ):
        parts = [view(i) for i in range(3)]
        merged, merged_lse = merge_attention(jnp.stack([o for o, _ in parts]), jnp.stack([s for _, s in parts]))
        np.testing.assert_allclose(merged, got, **TOL)
        np.testing.assert_allclose(merged_lse, lse, **TOL)
    start = 0
    for (h, n), table, kv_len in zip(rows, tables, kv_lens):
        slots = (np.asarray(table)[:, None] * block_size + np.arange(block_size)).reshape(-1)
        ref = dense_reference(
            q[start : start + n].astype(np.float64),
            k_cache[slots].astype(np.float64),
            v_cache[slots].astype(np.float64),
            np.arange(h, h + n),
            kv_len,
            window,
        )
        np.testing.assert_allclose(got[start : start + n], ref, **TOL)
        start += n
    assert not got[start:].any() and np.isneginf(lse[start:]).all()  # batch padding attends nothing


# windows shorter than a page, than a key block, and spanning several; GQA; histories that start past them
@pytest.mark.parametrize("window", [3, 11, 40])
@pytest.mark.parametrize("implementation", ["reference", IMPL])
def test_a_sliding_window_matches_dense(window, implementation):
    test_ragged_paged_attention_matches_dense(
        6, 2, 16, 32, 8, [(3, 20), (0, 1), (48, 13), (100, 1), (0, 33)], implementation, window=window
    )


# a lone decode row reads reference.ONE_ROW_KEYS keys a loop step, more rows DECODE_KEYS: positions at, before and
# past a step's edge, with and without a window, GQA
@pytest.mark.parametrize("position", [0, 127, 128, 300])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("rows", [1, 3])
def test_decode_rows_match_dense_across_the_loop_steps(position, window, rows):
    rng = np.random.default_rng(position + rows)
    bs, kvh, h, d, width = 16, 3, 9, 16, 32  # a 512-token table
    assert width * bs > 2 * reference.ONE_ROW_KEYS  # several loop steps of either size
    num_blocks = rows * width + 1
    tables = 1 + rng.permutation(rows * width).reshape(rows, width)
    k_cache, v_cache = (rng.standard_normal((num_blocks * bs, kvh, d)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((rows, 1, h, d)).astype(np.float32)
    pos = np.array([[position - 5 * i] for i in range(rows)]).clip(0)
    got, _ = reference.tiled_paged_attention(
        jnp.asarray(q),
        jnp.asarray(pos),
        jnp.asarray(k_cache),
        jnp.asarray(v_cache),
        jnp.asarray(tables),
        block_size=bs,
        key_block=256,
        window=window,
    )
    for i in range(rows):
        slots = (tables[i][:, None] * bs + np.arange(bs)).reshape(-1)
        want = dense_reference(
            q[i].astype(np.float64),
            k_cache[slots].astype(np.float64),
            v_cache[slots].astype(np.float64),
            pos[i],
            pos[i, 0] + 1,
            window,
        )
        np.testing.assert_allclose(np.asarray(got[i]), want, **TOL)


# keys every query of a loop's rows sees are read reference.HISTORY_KEYS a step, TILE_GROUP tiles together, then the
# causal edge in small steps: tiles of a long chunk, a fresh prompt's and a padding tile grouped, decode rows far
# apart, with and without a window, at the real step and at one small enough that short tables take many
CASES = {  # (tile tokens, each tile's first position, its request): the first request's tiles are one chunk's
    "a chunk": (8, [2500, 2508, 2516, 2524], [0, 0, 0, 0]),
    "a chunk beside others": (8, [2500, 2508, 2516, 0, 1037, 1700], [0, 0, 0, 1, 2, 3]),
    "decodes": (1, [2790, 2100, 1501], [0, 1, 2]),
    "decodes far apart": (1, [2790, 5, 1100], [0, 1, 2]),
    "one decode": (1, [2790], [0]),
}


# sets: a KV-parallel group's view too, each of 3 devices walking the blocks it holds alone (held_pages), merged
@pytest.mark.parametrize("history_keys, sets", [(64, 1), (reference.HISTORY_KEYS, 1), (64, 3)])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("case", list(CASES))
def test_long_histories_match_dense_across_both_loops(history_keys, sets, window, case, monkeypatch):
    monkeypatch.setattr(reference, "HISTORY_KEYS", history_keys)
    tq, starts, requests = CASES[case]
    rng = np.random.default_rng(history_keys + len(starts) + (window or 0))
    bs, kvh, h, d, width = 16, 3, 9, 16, 192  # 3,072-token tables: many history steps of either size
    n = len(starts) + (tq > 1)  # a padding tile last
    tables = 1 + rng.permutation(4 * width).reshape(4, width)
    k_cache, v_cache = (rng.standard_normal(((4 * width + 1) * bs, kvh, d)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((n, tq, h, d)).astype(np.float32)
    pos = np.full((n, tq), -1)
    for i, s in enumerate(starts):
        pos[i] = s + np.arange(tq)
    tile_tables = tables[requests + [0] * (n - len(starts))]
    attend = jax.jit(
        lambda tables, page_pos: reference.tiled_paged_attention(
            jnp.asarray(q),
            jnp.asarray(pos),
            jnp.asarray(k_cache),
            jnp.asarray(v_cache),
            tables,
            block_size=bs,
            key_block=256,
            window=window,
            page_pos=page_pos,
        )
    )
    parts = [
        attend(*held_pages(jnp.asarray(tile_tables), jnp.asarray(tile_tables % sets == i), bs, reference.NO_POSITION))
        for i in range(sets)
    ]
    got = merge_attention(jnp.stack([o for o, _ in parts]), jnp.stack([s for _, s in parts]))[0]
    for i in range(len(starts)):
        slots = (tile_tables[i][:, None] * bs + np.arange(bs)).reshape(-1)
        want = dense_reference(
            q[i].astype(np.float64),
            k_cache[slots].astype(np.float64),
            v_cache[slots].astype(np.float64),
            pos[i],
            pos[i, -1] + 1,
            window,
        )
        np.testing.assert_allclose(np.asarray(got[i]), want, **TOL)
    assert not np.asarray(got[len(starts) :]).any()  # the padding tile attends nothing


@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_kernel_reads_a_narrower_cache_as_the_reference(cache_dtype):
    """--kv_cache_dtype: float32 queries over a bfloat16 or fp8 cache; both sides read the cache's exact values."""
    rng = np.random.default_rng(5)
    n, heads, kv_heads, d, block_size, key_block = 3, 6, 2, 16, 8, 16
    q = jnp.asarray(rng.standard_normal((n, 4, heads, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((40 * block_size, kv_heads, d)), cache_dtype) for _ in range(2))
    tables = jnp.asarray(rng.permutation(40)[: n * 8].reshape(n, 8), jnp.int32)
    q_pos = jnp.asarray([[0, 1, 2, 3], [30, 31, 32, 33], [60, 61, -1, -1]], jnp.int32)
    args = (q, q_pos, k, v, tables)
    want, want_lse = reference.tiled_paged_attention(*args, block_size=block_size, key_block=key_block)
    got, got_lse = dispatch.tiled_paged_attention(
        *args, block_size=block_size, key_block=key_block, implementation=IMPL
    )
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_allclose(got_lse, want_lse, **TOL)


def test_kernel_in_bfloat16_matches_the_reference():
    """bfloat16 cache and queries (the GPU's dtype): the kernel's float32 softmax against the reference's, both
    rounding the output to bfloat16 (a relative step of 2^-8 on outputs of magnitude ~1: atol 2e-2 covers two
    roundings), log-sum-exp in float32 from the same bfloat16 scores."""
    rng = np.random.default_rng(7)
    n, tq, heads, kv_heads, d, block_size, key_block = 5, 8, 8, 2, 64, 16, 64
    slots = 40 * block_size
    q = jnp.asarray(rng.standard_normal((n, tq, heads, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((slots, kv_heads, d)), jnp.bfloat16) for _ in range(2))
    tables = jnp.asarray(rng.permutation(40)[: n * 8].reshape(n, 8), jnp.int32).at[2, 1].set(-1)
    starts = np.array([0, 17, 60, 100, 3])  # tiles at different depths; the last one mostly padding
    q_pos = np.where(np.arange(tq) < np.array([8, 8, 5, 8, 1])[:, None], starts[:, None] + np.arange(tq), -1)
    args = (q, jnp.asarray(q_pos, jnp.int32), k, v, tables)
    want, want_lse = reference.tiled_paged_attention(*args, block_size=block_size, key_block=key_block)
    got, got_lse = dispatch.tiled_paged_attention(
        *args, block_size=block_size, key_block=key_block, implementation=IMPL
    )
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0, atol=2e-2)
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-5, atol=1e-4)
    assert np.isneginf(np.asarray(got_lse)[q_pos < 0]).all() and not np.asarray(got, np.float32)[q_pos < 0].any()


def test_kernel_at_the_engines_gpu_shape():
    """Llama-3-8B's attention as the engine runs it on a GPU (bf16, head_dim 128, 4 query heads per KV head, tiles
    of 32 tokens, key blocks of 256): a 128-row query group whose K and V tiles fill shared memory. At two pipeline
    stages Triton asked an H100 for 294976 bytes of its 232448 and the step failed to launch
    (common.pipeline_stages)."""
    rng = np.random.default_rng(13)
    n, tq, heads, kv_heads, d, block_size, key_block = 3, 32, 8, 2, 128, 16, 256
    pages = 100  # the pool; each request's table holds 32 of them
    q = jnp.asarray(rng.standard_normal((n, tq, heads, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((pages * block_size, kv_heads, d)), jnp.bfloat16) for _ in range(2))
    tables = jnp.asarray(rng.permutation(pages)[: n * 32].reshape(n, 32), jnp.int32)  # 512 tokens each, scattered
    starts = np.array([0, 200, 470])  # one, two and three key blocks deep
    q_pos = jnp.asarray(starts[:, None] + np.arange(tq), jnp.int32)
    args = (q, q_pos, k, v, tables)
    want, want_lse = reference.tiled_paged_attention(*args, block_size=block_size, key_block=key_block)
    got, got_lse = dispatch.tiled_paged_attention(
        *args, block_size=block_size, key_block=key_block, implementation=IMPL
    )
    # bf16 outputs of magnitude ~1, rounded once on each side (2^-8 relative): as the bfloat16 test above
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0, atol=2e-2)
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("window", [None, 20])
def test_kernel_split_along_the_context_matches_the_reference(splits, window):
    """Split-K: each tile's key blocks cut into `splits` ranges, one program each, partials merged. Decode tiles
    at contexts of one key block (most splits run nothing), several, and the table's whole width; a padding tile;
    blocks held elsewhere (-1); with a sliding window, the ranges start at its first block."""
    rng = np.random.default_rng(splits)
    n, heads, kv_heads, d, block_size, key_block = 5, 8, 2, 32, 8, 16
    width = 16  # pages per table: 8 key blocks
    pool = 100
    q = jnp.asarray(rng.standard_normal((n, 1, heads, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((pool * block_size, kv_heads, d)), jnp.float32) for _ in range(2))
    tables = jnp.asarray(rng.permutation(pool)[: n * width].reshape(n, width), jnp.int32).at[3, 2].set(-1)
    q_pos = jnp.asarray([[5], [40], [127], [70], [-1]], jnp.int32)
    args = (q, q_pos, k, v, tables)
    want, want_lse = reference.tiled_paged_attention(*args, block_size=block_size, key_block=key_block, window=window)
    got, got_lse = tiled_kernel.tiled_paged_attention(
        *args, block_size=block_size, key_block=key_block, window=window, splits=splits, interpret=IMPL == "interpret"
    )
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_allclose(got_lse, want_lse, **TOL)
    assert not np.asarray(got)[4].any() and np.isneginf(np.asarray(got_lse)[4]).all()


def test_context_splits_fill_the_sms_and_stop_at_the_table():
    assert tiled_kernel.context_splits(programs=8, key_blocks=32, cores=132) == 16  # one row of an 8B model
    assert tiled_kernel.context_splits(programs=32, key_blocks=32, cores=132) == 4
    assert tiled_kernel.context_splits(programs=128, key_blocks=32, cores=132) == 1  # 16 rows fill them
    assert tiled_kernel.context_splits(programs=8, key_blocks=2, cores=132) == 2  # a short max_model_len


def test_buckets_bound_the_programs_and_refuse_what_does_not_fit():
    # one row bucket by default (an accelerator's); a CPU asks for rows from 4
    b = batch.Buckets.make(
        max_num_batched_tokens=512, max_num_seqs=16, max_model_len=2048, block_size=16, key_block=256
    )
    assert b.rows == (16,) and b.decode_rows == (1, 2, 4, 8, 16) and len(b.programs()) == 5 + 6
    b = batch.Buckets.make(
        max_num_batched_tokens=512, max_num_seqs=16, max_model_len=2048, block_size=16, key_block=256, min_rows=4
    )
    assert b.tokens == (16, 32, 64, 128, 256, 512) and b.rows == (4, 8, 16) and b.width == 128
    assert len(b.shapes()) == 18
    assert b.fit(1, 1) == (16, 4) and b.fit(17, 5) == (32, 8) and b.fit(512, 16) == (512, 16)
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        b.fit(513, 1)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        batch.Buckets.make(8, 16, 2048, 16, 256)
    # a GPU runs one decode row as two (a one-row matmul would be strength-reduced into the KV write)
    b = batch.Buckets.make(512, 16, 2048, 16, 256, min_decode_rows=2)
    assert b.decode_rows == (2, 4, 8, 16) and b.fit_step(1, 1) == b.decode(2)
    assert batch.Buckets.make(512, 1, 2048, 16, 256, min_decode_rows=2).decode_rows == (2,)
    # the tile axis has room for whole tiles of the tokens plus one partial tile per prefill chunk
    b = batch.Buckets.make(512, 16, 2048, 16, 256, min_rows=4, max_prefills=2)
    assert b.tiles(512, 16) == 16 + 2 and b.tiles(16, 4) == 0 + 2
    row = lambda n: batch.Row([1] * n, 0, [1, 2], SamplingParams(), 0, 0)  # noqa: E731
    batch.pack([row(17), row(17), row(1)], b, 16)  # two chunks and a decode: the (64, 4) program, 2 + 2 tiles
    with pytest.raises(ValueError, match="3 prefill chunks exceeds the 2"):
        batch.pack([row(5), row(5), row(5)], b, 16)


def test_a_step_travels_as_one_blob_and_comes_back_bit_for_bit():
    """batch.to_blob puts every array of a packed step in one int32 array (one transfer); from_blob, in numpy
    or inside a compiled program, gives back each array, floats and the unsigned seeds bit for bit."""
    import jax

    b = batch.Buckets.make(512, 16, 2048, 16, 256, min_rows=4, max_prefills=2)
    rng = np.random.default_rng(0)
    params = [SamplingParams(temperature=0.7, top_p=0.93, top_k=5), SamplingParams(), SamplingParams(top_p=0.5)]
    rows = [
        batch.Row(rng.integers(0, 500, n).tolist(), start, list(range(1, 9)), p, int(seed), c, feed)
        for n, start, p, seed, c, feed in [
            (17, 3, params[0], 2**32 - 1, 4, -1),
            (1, 40, params[1], 7, 9, 2),
            (9, 0, params[2], 2**31 + 5, 0, -1),
        ]
    ]
    packed = batch.pack(rows, b, 16)
    blob = batch.to_blob(packed)
    assert blob.dtype == np.int32 and blob.ndim == 1
    shape = batch.shape_of(packed)
    on_device = jax.jit(lambda x: batch.from_blob(x, shape, b))(blob)
    for back in (batch.from_blob(blob, shape, b), on_device):
        for name, want, got in zip(batch.StepArrays._fields, packed, back):
            assert got.dtype == want.dtype and got.shape == want.shape, name
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)
