"""Sequence-parallel attention on 8 CPU devices against a dense float64 reference: ring (every layout), Ulysses,
SP-TP, KV-parallel decode and KV rebalancing; SP sizes 1/2/4/8, GQA 1 and 3, with and without history,
uneven valid lengths. Random inputs throughout."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import dense_attention, scatter_history
from jaxserve.pallas_kernels.reference import NO_POSITION
from jaxserve.sharding import comm, layouts, rebalance as rb
from jaxserve.sharding.attention import chunk_attention_sp
from jaxserve.sharding.kvp_decode import kv_parallel_decode
from jaxserve.sharding.mesh import SP, group_mesh, make_mesh
from jaxserve.sharding.sp_tp import sp_tp_attention

SIZES = [1, 2, 4, 8]
HEADS = [(8, 8), (24, 8)]  # GQA ratios 1 and 3
D = 16
EPS32 = float(np.finfo(np.float32).eps)  # 2**-23, about 1.2e-7


def close(got, want, terms):
    """float32 `got` against the float64 reference `want`, to what float32 arithmetic allows.

    Each output ends a few chained float32 reductions (projections, q.k over D, the softmax sums, the weighted sum
    of values over the keys, the output projection), accumulated in another order than the reference's (shards,
    blocks, ring steps). A sum of n float32 terms in arbitrary order errs like a random walk, eps_f32 * sqrt(n)
    times the terms' magnitude, not the result's: an element near zero because large terms cancel keeps their
    error. So the tolerance is absolute, scaled by max |want| (the terms' magnitude): 4 * eps_f32 * sqrt(terms) *
    max |want|, with `terms` the longest reduction behind an output and 4 for up to four chained stages whose
    errors add. (Measured worst here: 0.9 * eps_f32 * sqrt(terms) * max |want|.) No rtol: |want| <= max |want|."""
    want = np.asarray(want, np.float64)
    atol = 4 * EPS32 * np.sqrt(terms) * np.abs(want).max()
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=atol)


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("strategy, layout", [("ring", l) for l in layouts.LAYOUTS] + [("ulysses", "zigzag")])
@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("h, kvh", HEADS)
@pytest.mark.parametrize("history", [0, 21])
def test_chunk_attention_sp_matches_dense(devices, strategy, layout, p, h, kvh, history):
    rng = np.random.default_rng([p, h, history, len(layout)])
    n, valid = 32, 27  # the chunk is padded from 27 to 32 tokens: uneven valid length
    q, k, v = rand(rng, n, h, D), rand(rng, n, kvh, D), rand(rng, n, kvh, D)
    pos = history + np.arange(n)
    q_pos = np.where(np.arange(n) < valid, pos, -1).astype(np.int32)
    k_pos = np.where(np.arange(n) < valid, pos, NO_POSITION).astype(np.int32)
    hk, hv = rand(rng, history, kvh, D), rand(rng, history, kvh, D)
    cap = max(history, 1)
    HK, HV, HP, _ = scatter_history(rng, hk, hv, p, cap)
    got = chunk_attention_sp(
        make_mesh(devices[:p]),
        *(jnp.asarray(x) for x in (q, k, v, q_pos, k_pos, HK, HV, HP)),
        strategy=strategy,
        layout=layout,
    )
    want = dense_attention(
        q[:valid],
        np.concatenate([hk, k[:valid]]),
        np.concatenate([hv, v[:valid]]),
        q_pos[:valid],
        np.concatenate([np.arange(history), k_pos[:valid]]),
    )
    close(np.asarray(got)[:valid], want, terms=history + valid)  # the last query's keys


@pytest.mark.parametrize("p", [2, 4])
def test_ring_with_pallas_kernels_inside_shard_map(devices, p):
    """The Pallas kernels (interpret mode on CPU) under shard_map: what a GPU traces (needs check_vma=False)."""
    rng = np.random.default_rng([p, 11])
    n, h, kvh, history = 32, 6, 2, 13
    q, k, v = rand(rng, n, h, D), rand(rng, n, kvh, D), rand(rng, n, kvh, D)
    pos = (history + np.arange(n)).astype(np.int32)
    hk, hv = rand(rng, history, kvh, D), rand(rng, history, kvh, D)
    HK, HV, HP, _ = scatter_history(rng, hk, hv, p, history)
    got = chunk_attention_sp(
        make_mesh(devices[:p]), *(jnp.asarray(x) for x in (q, k, v, pos, pos, HK, HV, HP)), implementation="interpret"
    )
    want = dense_attention(
        q, np.concatenate([hk, k]), np.concatenate([hv, v]), pos, np.concatenate([np.arange(history), pos])
    )
    close(got, want, terms=history + n)


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("h, kvh", HEADS)
@pytest.mark.parametrize("history", [0, 12])
def test_sp_tp_attention_matches_dense(devices, p, h, kvh, history):
    rng = np.random.default_rng([p, h, history, 7])
    n, e = 16, 32
    x = rand(rng, n, e)
    wq, wk, wv, wo = rand(rng, e, h * D) / 4, rand(rng, e, kvh * D) / 4, rand(rng, e, kvh * D) / 4, rand(rng, h * D, e)
    hk, hv = rand(rng, history, kvh, D), rand(rng, history, kvh, D)
    pos = (history + np.arange(n)).astype(np.int32)
    q = (x @ wq).reshape(n, h, D)
    k = (x @ wk).reshape(n, kvh, D)
    attn = dense_attention(
        q,
        np.concatenate([hk, k]),
        np.concatenate([hv, (x @ wv).reshape(n, kvh, D)]),
        pos,
        np.concatenate([np.arange(history), pos]),
    )
    want = attn.reshape(n, h * D) @ wo.astype(np.float64)
    # Tensor-parallel weights: device i holds heads [i*h/p, (i+1)*h/p) and the KV heads they use.
    rep = max(1, p // kvh)  # KV heads replicated when there are fewer than devices
    split_q = wq.reshape(e, p, h // p * D).transpose(1, 0, 2)
    kv_cols = lambda w: np.repeat(w.reshape(e, kvh, D), rep, axis=1).reshape(e, p, -1).transpose(1, 0, 2)
    split_o = wo.reshape(p, h // p * D, e)
    hist_heads = lambda a: np.repeat(a, rep, axis=1).reshape(history, p, kvh * rep // p, D).transpose(1, 0, 2, 3)
    mesh = make_mesh(devices[:p])
    fn = jax.shard_map(
        lambda x_, wq_, wk_, wv_, wo_, pos_, hk_, hv_, hp_: sp_tp_attention(
            x_, wq_[0], wk_[0], wv_[0], wo_[0], pos_, hk_[0], hv_[0], hp_, head_dim=D
        )[0],
        mesh=mesh,
        in_specs=(P(SP),) * 6 + (P(SP), P(SP), P()),
        out_specs=P(SP),
    )
    got = fn(
        x,
        split_q,
        kv_cols(wk),
        kv_cols(wv),
        split_o,
        pos,
        hist_heads(hk),
        hist_heads(hv),
        np.arange(history, dtype=np.int32),
    )
    close(got, want, terms=h * D)  # the output projection; more terms than the keys (<= 28) or x @ wq (32)


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("h, kvh", HEADS)
@pytest.mark.parametrize("implementation", ["reference", "interpret"])
def test_kv_parallel_decode_matches_dense(devices, p, h, kvh, implementation):
    rng = np.random.default_rng([p, h, 3])
    b, bs, per_dev_blocks = 3, 4, 24
    total = [37, 5, 80]  # uneven lengths; the 5-token request leaves most devices empty
    q = rand(rng, b, h, D)
    full_k = [rand(rng, n, kvh, D) for n in total]
    full_v = [rand(rng, n, kvh, D) for n in total]
    slots = per_dev_blocks * b * bs
    K = np.zeros((p, slots, kvh, D), np.float32)
    V = np.zeros_like(K)
    tables = np.zeros((p, b, per_dev_blocks), np.int32)
    lens = np.zeros((p, b), np.int32)
    for r, n in enumerate(total):  # contiguous split of each request's tokens over the devices
        bounds = [n * i // p for i in range(p + 1)]
        for i in range(p):
            lo, hi = bounds[i], bounds[i + 1]
            blocks = r * per_dev_blocks + rng.permutation(per_dev_blocks)  # scattered within r's blocks
            tables[i, r] = blocks
            sl = (blocks[:, None] * bs + np.arange(bs)).ravel()[: hi - lo]
            K[i, sl], V[i, sl], lens[i, r] = full_k[r][lo:hi], full_v[r][lo:hi], hi - lo
    mesh = make_mesh(devices[:p])
    fn = jax.shard_map(
        lambda q_, k_, v_, t_, l_: kv_parallel_decode(
            q_, k_[0], v_[0], t_[0], l_[0], block_size=bs, implementation=implementation
        ),
        mesh=mesh,
        in_specs=(P(), P(SP), P(SP), P(SP), P(SP)),
        out_specs=P(),
        check_vma=False,
    )
    got = np.asarray(fn(q, K, V, tables, lens))
    for r, n in enumerate(total):
        want = dense_attention(q[r : r + 1], full_k[r], full_v[r], [n - 1], np.arange(n))
        close(got[r : r + 1], want, terms=n)  # the request's keys


@pytest.mark.parametrize("old, new", [(1, 2), (2, 4), (4, 8), (2, 8), (3, 5), (8, 4), (4, 4)])
def test_rebalance_spreads_history_evenly(devices, old, new):
    """G -> G' (G a prefix of G'), or shrinking onto a prefix: equal shares, every token once, fewest moves."""
    rng = np.random.default_rng([old, new])
    n, kvh = 45, 3
    p = max(old, new)
    cap = n
    hk, hv = rand(rng, n, kvh, D), rand(rng, n, kvh, D)
    K, V, Pos, counts = scatter_history(rng, hk, hv, old, cap)
    pad = p - old  # devices that join start empty
    K = np.concatenate([K, np.zeros((pad * cap, kvh, D), np.float32)])
    V = np.concatenate([V, np.zeros((pad * cap, kvh, D), np.float32)])
    Pos = np.concatenate([Pos, np.full(pad * cap, NO_POSITION, np.int32)])
    counts = counts + [0] * pad
    dest, at, share = rb.plan(Pos.reshape(p, cap), devices=new)
    mesh = group_mesh(devices, [d.id for d in devices[:p]])
    fn = jax.shard_map(
        lambda k_, v_, pos_, d_, a_: rb.rebalance(k_, v_, pos_, d_[0], a_[0], share=share, axis_size=p),
        mesh=mesh,
        in_specs=(P(SP),) * 5,
        out_specs=(P(SP),) * 3,
    )
    k2, v2, pos2 = (np.asarray(x) for x in fn(K, V, Pos, dest[:, None], at[:, None]))
    held = (pos2 != NO_POSITION).reshape(p, share).sum(axis=1)
    np.testing.assert_array_equal(held[:new], rb.targets(n, new))
    assert held[new:].sum() == 0
    assert sorted(pos2[pos2 != NO_POSITION].tolist()) == list(range(n))  # every token exactly once
    before = {int(Pos[i]): i // cap for i in np.flatnonzero(Pos != NO_POSITION)}
    after = {int(pos2[i]): i // share for i in np.flatnonzero(pos2 != NO_POSITION)}
    # Only the excess over each device's share moves: no more than the minimum.
    assert sum(before[t] != after[t] for t in range(n)) == rb.moved_tokens(counts, new)
    for slot in np.flatnonzero(pos2 != NO_POSITION):
        np.testing.assert_array_equal(k2[slot], hk[pos2[slot]])
        np.testing.assert_array_equal(v2[slot], hv[pos2[slot]])


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("p", SIZES)
def test_layouts_are_permutations_with_positions(layout, p):
    n = 48
    perm = layouts.permutation(n, p, layout)
    assert sorted(perm) == list(range(n))
    np.testing.assert_array_equal(perm[layouts.inverse(perm)], np.arange(n))
    pos = layouts.positions(n, p, layout, offset=100)
    assert pos.shape == (p, n // p) and sorted(pos.ravel()) == list(range(100, 100 + n))
    if layout == "zigzag":  # every device holds the same causal work: equal sums of positions
        assert len(set(pos.sum(axis=1))) == 1


def test_layout_rejects_indivisible_lengths():
    with pytest.raises(ValueError, match="multiple of 8"):
        layouts.permutation(12, 4, "zigzag")


def test_comm_bytes_orders_strategies_sensibly():
    model = dict(heads=32, kv_heads=8, head_dim=128, hidden=4096)
    prefill = comm.per_layer_bytes(comm.Shape(tokens=4096, devices=8, **model))
    assert prefill["ring"] == 7 * 4096 * 2 * 8 * 128 * 2  # no history: only the chunk's K/V circulates
    with_history = comm.per_layer_bytes(comm.Shape(tokens=4096, devices=8, history=100_000, **model))
    assert with_history["ring"] > prefill["ring"] and with_history["ulysses"] > prefill["ulysses"]
    decode = comm.per_layer_bytes(comm.Shape(tokens=1, devices=8, history=100_000, **model))
    assert decode["decode_query_moving"] < decode["decode_kv_moving"] / 100  # long history: move q, not KV
    assert comm.per_layer_bytes(comm.Shape(tokens=4096, devices=1, **model))["ring"] == 0
    # with history: the chunk's K/V, the all-gathered queries, every device's float32 [t, h, d + 1] partials for
    # the p - 1 others (a reduce-scatter of the whole group's), and the log-sum-exp maxima
    t, p, h, d = 4096, 8, 32, 128
    assert with_history["ring"] == (
        prefill["ring"] + (p - 1) * t * h * d * 2 + (p - 1) * t * h * (d + 1) * 4 + 2 * (p - 1) * t * h * 4
    )
    assert comm.rebalance_bytes([400, 400, 0, 0], 1) == 400  # 2 -> 4: half of the history moves
