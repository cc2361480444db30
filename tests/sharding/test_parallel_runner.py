"""The engine's step on several devices equals the step on one (small random Llama with GQA, 8 heads over 2 KV
heads): KV-parallel groups of 2/4/8 (engine/kv_cache.py: the paged cache split block by block), tensor-parallel
sets of 2/4/8 (sharding/tp.py: heads and MLP features split, KV heads repeated past 2 devices), and both at once.
The same greedy tokens through prefill chunks, mixed steps, decodes and a multi-step decode (a burst), and the same
K/V in every layer at every position, found on the devices that own its block and hold its head; the same tokens
and logprobs through the extra sampler (penalties from per-request slots). KV landed from elsewhere goes only
there."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from conftest import random_params
from jaxserve.engine import batch
from jaxserve.engine.runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from jaxserve.models.config import LlamaConfig
from jaxserve.sched.kv_manager import KVCacheManager

CFG = LlamaConfig(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=96,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=512,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)

# the same tolerance as the SP model test: attention matches to 1e-5, two random layers grow it to ~1e-5 absolute
TOL = dict(rtol=1e-4, atol=1e-4)
BS = 4
PER_DEVICE = 40  # blocks on each device, its scratch block included
BUCKETS = batch.Buckets.make(
    max_num_batched_tokens=128,
    max_num_seqs=4,
    max_model_len=128,
    block_size=BS,
    key_block=8,
    tile=8,
    min_tokens=8,
    num_scheduler_steps=4,
)


@pytest.fixture(scope="module")
def params():
    return random_params(CFG)


def runner(
    params,
    devices,
    num_blocks: int,
    tp: int = 1,
    stages: int = 1,
    cfg: LlamaConfig = CFG,
    buckets: batch.Buckets = BUCKETS,
) -> ModelRunner:
    return ModelRunner(
        cfg,
        params,
        np.float32,
        num_blocks=num_blocks,
        block_size=BS,
        buckets=buckets,
        key_block=8,
        devices=devices,
        tp=tp,
        stages=stages,
    )


def kv_of(r: ModelRunner, table: list[int], n: int, stage: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A request's K/V [stage's layers, n, tp * kv heads per device, d] read back from wherever its blocks live:
    block b is KV-parallel rank b % kvp's local block b // kvp, rank i's share is rows [i * per, (i + 1) * per)
    of the global array, and its tensor-parallel devices' heads lie side by side."""
    kvp = len(r.devices) // (r.tp * r.stages)
    per = r.num_blocks // kvp * BS
    pos = np.arange(n)
    block = np.asarray(table)[pos // BS]
    rows = (block % kvp) * per + (block // kvp) * BS + pos % BS
    return tuple(np.asarray(c)[:, rows] for c in r.stage_caches[stage])


def heads_held(r: ModelRunner) -> np.ndarray:
    """The model's KV head behind each head of r's cache (repeated heads appear once per device holding them)."""
    s = r.share
    return np.array([s.kv_start(j) + h for j in range(r.tp) for h in range(s.kv_heads)])


@pytest.mark.parametrize("kvp,tp", [(2, 1), (4, 1), (8, 1), (1, 2), (1, 4), (1, 8), (2, 2), (2, 4)])
def test_parallel_steps_equal_one_device(devices, params, kvp, tp):
    # the reference holds the group's whole pool on one device, so both read the same tables
    one = runner(params, devices[:1], PER_DEVICE * kvp)
    group = runner(params, devices[: kvp * tp], PER_DEVICE * kvp, tp)
    kv = KVCacheManager(PER_DEVICE * kvp, BS, enable_prefix_caching=False, scratch_blocks=kvp)
    rng = np.random.default_rng(kvp)
    prompts = {
        "a": rng.integers(0, CFG.vocab_size, 37),
        "b": rng.integers(0, CFG.vocab_size, 70),
        "c": rng.integers(0, CFG.vocab_size, 5),
    }
    tokens = {rid: list(p) for rid, p in prompts.items()}
    for rid, p in prompts.items():
        kv.allocate(rid, len(p) + 12)
    greedy = SamplingParams()

    def row(rid, lo, hi):
        return batch.Row(tokens[rid][lo:hi], lo, kv.block_table(rid), greedy, 0, 0)

    steps = [
        [row("a", 0, 32), row("b", 0, 20)],  # two prefill chunks
        [row("a", 32, 37), row("b", 20, 70), row("c", 0, 5)],
    ]  # chunks with history and a short prompt
    for rows in steps:
        want, got = one.execute(rows), group.execute(rows)
        np.testing.assert_array_equal(got, want)
    for rid, t in zip("abc", want):
        tokens[rid].append(int(t))
    for _ in range(6):  # decodes: each device attends its share, one all-gather merges
        rows = [row(rid, len(tokens[rid]) - 1, len(tokens[rid])) for rid in "abc"]
        want, got = one.execute(rows), group.execute(rows)
        np.testing.assert_array_equal(got, want)
        for rid, t in zip("abc", want):
            tokens[rid].append(int(t))
    # a burst of 4 decode steps in one device loop, on the group, equals 4 steps one at a time on one device;
    # "c" stops after 2 (its share of the burst)
    share = {"a": 4, "b": 4, "c": 2}
    rows = [
        batch.Row(tokens[rid][-1:], len(tokens[rid]) - 1, kv.block_table(rid), greedy, 0, 0, steps=share[rid])
        for rid in "abc"
    ]
    burst = group.start(rows, steps=4).value()
    for j in range(4):
        live = [rid for rid in "abc" if j < share[rid]]
        want = one.execute([row(rid, len(tokens[rid]) - 1, len(tokens[rid])) for rid in live])
        np.testing.assert_array_equal(burst[j, : len(live)], want)
        for rid, t in zip(live, want):
            tokens[rid].append(int(t))
    for rid in "abc":
        table, n = kv.block_table(rid), len(tokens[rid]) - 1  # the last sampled token has no K/V yet
        for got, want in zip(kv_of(group, table, n), kv_of(one, table, n)):
            np.testing.assert_allclose(got, want[:, :, heads_held(group)], **TOL)
    # the request's blocks really are spread: every device of the group holds part of "b"'s context
    assert {b % kvp for b in kv.block_table("b")} == set(range(kvp))


@pytest.mark.parametrize("kvp,tp", [(2, 1), (1, 2), (2, 2)])
def test_the_extra_sampler_on_a_group_equals_one_device(devices, params, kvp, tp):
    """Penalties, logit_bias and min_tokens read per-request slots set on the group's devices, and logprobs come
    back: the same tokens and logprobs as on one device, step by step and in a burst that carries the slots."""
    one = runner(params, devices[:1], PER_DEVICE * kvp)
    group = runner(params, devices[: kvp * tp], PER_DEVICE * kvp, tp)
    kv = KVCacheManager(PER_DEVICE * kvp, BS, enable_prefix_caching=False, scratch_blocks=kvp)
    rng = np.random.default_rng(10 + kvp)
    prompts = {rid: rng.integers(0, CFG.vocab_size, n).tolist() for rid, n in (("a", 21), ("b", 9))}
    sp = SamplingParams(
        repetition_penalty=1.5,
        frequency_penalty=0.7,
        logit_bias={3: 4.0},
        min_tokens=3,
        logprobs=4,
        temperature=0.9,
        seed=5,
    )
    for slot, (rid, p) in enumerate(prompts.items()):
        kv.allocate(rid, len(p) + 12)
        for r in (one, group):
            r.set_slot(slot, p, [], sp.logit_bias, [7])
    tokens = {rid: list(p) for rid, p in prompts.items()}

    def rows(steps: int = 1) -> list[batch.Row]:
        return [
            batch.Row(
                tokens[rid][-1:],
                len(tokens[rid]) - 1,
                kv.block_table(rid),
                sp,
                9,
                len(tokens[rid]) - len(prompts[rid]),
                steps=steps,
                slot=slot,
            )
            for slot, rid in enumerate(prompts)
        ]

    first = [batch.Row(p, 0, kv.block_table(rid), sp, 9, 0, slot=slot) for slot, (rid, p) in enumerate(prompts.items())]
    for step in [first] + [None] * 4:
        step = step or rows()
        want, got = one.start(step), group.start(step)
        np.testing.assert_array_equal(got.value(), want.value())
        for w, g in zip(want.logprobs_value(), got.logprobs_value()):
            np.testing.assert_allclose(g[:2], w[:2], **TOL)
        for rid, t in zip(prompts, want.value()):
            tokens[rid].append(int(t))
    burst, steps = group.start(rows(3), steps=3), []
    for _ in range(3):
        want = one.start(rows())
        steps.append((want.value()[:2], want.logprobs_value()))
        for rid, t in zip(prompts, want.value()):
            tokens[rid].append(int(t))
    got_lp = burst.logprobs_value()
    for j, (want_tokens, want_lp) in enumerate(steps):
        np.testing.assert_array_equal(burst.value()[j, :2], want_tokens)
        np.testing.assert_allclose(got_lp.top[j, :2], want_lp.top[:2], **TOL)


@pytest.mark.parametrize("kvp,tp", [(4, 1), (2, 2)])
def test_landed_rows_reach_only_their_owners(devices, params, kvp, tp):
    group = runner(params, devices[: kvp * tp], PER_DEVICE * kvp, tp)
    rng = np.random.default_rng(0)
    n = 23
    shape = (CFG.num_layers, n, CFG.num_kv_heads, CFG.head_dim)
    k, v = (jax.device_put(rng.standard_normal(shape).astype(np.float32), devices[0]) for _ in range(2))
    table = [5, 10, 7, 12, 9, 6]  # blocks on ranks 1, 2, 3, 0, 1, 2 (of 4) or 1, 0, 1, 0, 1, 0 (of 2)
    slots = np.asarray(table)[np.arange(n) // BS] * BS + np.arange(n) % BS
    group.land(k, v, slots)
    got_k, got_v = kv_of(group, table, n)
    np.testing.assert_array_equal(got_k, np.asarray(k)[:, :, heads_held(group)])
    np.testing.assert_array_equal(got_v, np.asarray(v)[:, :, heads_held(group)])
    # nothing else was written: the cache holds exactly these rows
    assert np.count_nonzero(np.asarray(group.caches[0]).any(axis=(0, 2, 3))) == n


CFG4 = dataclasses.replace(CFG, num_layers=4)
ONE_STEP = batch.Buckets.make(
    max_num_batched_tokens=128, max_num_seqs=4, max_model_len=128, block_size=BS, key_block=8, tile=8, min_tokens=8
)


@pytest.mark.parametrize("stages,kvp,tp", [(2, 1, 1), (4, 1, 1), (2, 2, 2), (4, 2, 1), (2, 1, 4)])
def test_pipeline_stages_equal_one_device(devices, stages, kvp, tp):
    """An instance split into pipeline stages (each a KV-parallel, tensor-parallel set of devices running an even
    share of the layers, its hidden states moved on to the next stage): the same greedy tokens as one device
    through a prompt three chunks long, a mixed step and decodes, and each stage's cache holding exactly its
    layers' K/V."""
    params = random_params(CFG4)
    one = runner(params, devices[:1], PER_DEVICE * kvp, cfg=CFG4, buckets=ONE_STEP)
    pipe = runner(params, devices[: stages * kvp * tp], PER_DEVICE * kvp, tp, stages, CFG4, ONE_STEP)
    assert pipe.stages == len(pipe.stage_caches) == stages
    kv = KVCacheManager(PER_DEVICE * kvp, BS, enable_prefix_caching=False, scratch_blocks=kvp)
    rng = np.random.default_rng(stages + kvp)
    tokens = {rid: list(rng.integers(0, CFG.vocab_size, n)) for rid, n in (("a", 61), ("b", 9))}
    for rid, t in tokens.items():
        kv.allocate(rid, len(t) + 8)
    greedy = SamplingParams()

    def row(rid, lo, hi):
        return batch.Row(tokens[rid][lo:hi], lo, kv.block_table(rid), greedy, 0, 0)

    def both(rows):
        want, got = one.execute(rows), pipe.execute(rows)
        np.testing.assert_array_equal(got, want)
        return want

    both([row("a", 0, 24)])
    first_b = both([row("a", 24, 48), row("b", 0, 9)])[1]
    first_a = both([row("a", 48, 61)])[0]
    tokens["a"].append(int(first_a))
    tokens["b"].append(int(first_b))
    for _ in range(5):  # decodes: the sampled tokens back to the first stage, hidden states stage to stage
        rows = [row(rid, len(tokens[rid]) - 1, len(tokens[rid])) for rid in "ab"]
        for rid, t in zip("ab", both(rows)):
            tokens[rid].append(int(t))
    for rid in "ab":
        table, n = kv.block_table(rid), len(tokens[rid]) - 1
        whole = kv_of(one, table, n)
        for s in range(stages):
            layers = slice(CFG4.num_layers * s // stages, CFG4.num_layers * (s + 1) // stages)
            for got, want in zip(kv_of(pipe, table, n, s), whole):
                np.testing.assert_allclose(got, want[layers][:, :, heads_held(pipe)], **TOL)


def test_a_step_that_feeds_on_nothing_does_not_wait_for_the_last(devices, params):
    """SPP's precondition: a prefill step, no row of which takes a token sampled by the step before, does not
    read that step's tokens, so its first stage need not wait for the last stage of the step before. Checked by
    deleting those tokens: the prefill runs, a decode that feeds on them cannot."""
    pipe = runner(params, devices[:2], PER_DEVICE, stages=2, buckets=ONE_STEP)
    kv = KVCacheManager(PER_DEVICE, BS, enable_prefix_caching=False)
    kv.allocate("a", 40)
    tokens = list(np.random.default_rng(3).integers(0, CFG.vocab_size, 20))
    greedy = SamplingParams()
    pipe.dispatch(batch.pack([batch.Row(tokens[:12], 0, kv.block_table("a"), greedy, 0, 0)], pipe.buckets, BS))
    pipe._previous.delete()  # the first chunk's sampled tokens
    second = pipe.dispatch(
        batch.pack([batch.Row(tokens[12:], 12, kv.block_table("a"), greedy, 0, 0)], pipe.buckets, BS)
    )
    assert second.value().shape == (pipe.max_rows,)
    pipe._previous.delete()
    decode = batch.Row([0], 20, kv.block_table("a"), greedy, 0, 1, feed=0)
    with pytest.raises(RuntimeError, match="deleted"):
        pipe.dispatch(batch.pack([decode], pipe.buckets, BS))


def test_pipeline_stages_refuse_what_they_do_not_run(devices, params):
    with pytest.raises(ValueError, match="multi-step decode runs on one pipeline stage"):
        runner(params, devices[:2], PER_DEVICE, stages=2)
    pipe = runner(params, devices[:2], PER_DEVICE, stages=2, buckets=ONE_STEP)
    with pytest.raises(ValueError, match="pipeline stages takes no KV"):
        pipe.land(*pipe.stage_caches[0], np.arange(3))
    with pytest.raises(ValueError, match="do not split into 3 pipeline stages"):
        runner(params, devices[:3], PER_DEVICE, stages=3, buckets=ONE_STEP)


QWEN2 = dataclasses.replace(CFG, qkv_bias=True)  # Qwen2's q/k/v biases: split with their projections' columns


@pytest.mark.parametrize("tp", [2, 4])  # 4 > the 2 KV heads: k/v biases repeat with their heads
def test_qkv_biases_split_over_tensor_parallel_devices(devices, tp):
    params = random_params(QWEN2)
    one, group = (
        runner(params, devices[:1], PER_DEVICE, cfg=QWEN2),
        runner(params, devices[:tp], PER_DEVICE, tp, cfg=QWEN2),
    )
    kv = KVCacheManager(PER_DEVICE, BS, enable_prefix_caching=False, scratch_blocks=1)
    tokens = list(np.random.default_rng(tp).integers(0, CFG.vocab_size, 21))
    kv.allocate("a", len(tokens) + 6)
    greedy = SamplingParams()
    rows = [batch.Row(tokens, 0, kv.block_table("a"), greedy, 0, 0)]
    for _ in range(6):  # the prompt, then decodes
        want, got = one.execute(rows), group.execute(rows)
        np.testing.assert_array_equal(got, want)
        tokens.append(int(want[0]))
        rows = [batch.Row(tokens[-1:], len(tokens) - 1, kv.block_table("a"), greedy, 0, 0)]
    table = kv.block_table("a")
    for got, want in zip(kv_of(group, table, len(tokens) - 1), kv_of(one, table, len(tokens) - 1)):
        np.testing.assert_allclose(got, want[:, :, heads_held(group)], **TOL)
