"""KV-parallel decode (engine/kv_cache.py): the engine's step on a group of 2/4/8 devices whose paged cache is
split block by block equals the step on one device (small random Llama with GQA): the same greedy tokens through
prefill chunks, mixed steps and decodes, and the same K/V in every layer at every position, found on the device
that owns its block. KV landed from elsewhere goes only to the devices that own its slots."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import CFG
from jaxserve.engine import batch
from jaxserve.engine.runner import ModelRunner
from jaxserve.engine.sampling import SamplingParams
from jaxserve.sched.kv_manager import KVCacheManager

# the same tolerance as the SP model test: attention matches to 1e-5, two random layers grow it to ~1e-5 absolute
TOL = dict(rtol=1e-4, atol=1e-4)
BS = 4
PER_DEVICE = 40  # blocks on each device, its scratch block included
BUCKETS = batch.Buckets.make(max_num_batched_tokens=128, max_num_seqs=4, max_model_len=128, block_size=BS,
                             key_block=8, tile=8, min_tokens=8, min_rows=4)


def runner(params, devices, num_blocks: int) -> ModelRunner:
    return ModelRunner(CFG, params, np.float32, num_blocks=num_blocks, block_size=BS, buckets=BUCKETS, key_block=8,
                       devices=devices)


def kv_of(r: ModelRunner, table: list[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    """A request's K/V [layers, n, kvh, d] read back from wherever its blocks live: block b is device b % kvp's
    local block b // kvp, and device i's share is rows [i * per, (i + 1) * per) of the global array."""
    kvp = len(r.devices)
    per = r.num_blocks // kvp * BS
    pos = np.arange(n)
    block = np.asarray(table)[pos // BS]
    rows = (block % kvp) * per + (block // kvp) * BS + pos % BS
    return tuple(np.asarray(c)[:, rows] for c in r.caches)


@pytest.mark.parametrize("kvp", [2, 4, 8])
def test_kv_parallel_steps_equal_one_device(devices, params, kvp):
    # the reference holds the group's whole pool on one device, so both read the same tables
    one, group = runner(params, devices[:1], PER_DEVICE * kvp), runner(params, devices[:kvp], PER_DEVICE * kvp)
    kv = KVCacheManager(PER_DEVICE * kvp, BS, enable_prefix_caching=False, scratch_blocks=kvp)
    rng = np.random.default_rng(kvp)
    prompts = {"a": rng.integers(0, CFG.vocab_size, 37), "b": rng.integers(0, CFG.vocab_size, 70),
               "c": rng.integers(0, CFG.vocab_size, 5)}
    tokens = {rid: list(p) for rid, p in prompts.items()}
    for rid, p in prompts.items():
        kv.allocate(rid, len(p) + 8)
    greedy = SamplingParams()

    def row(rid, lo, hi):
        return batch.Row(tokens[rid][lo:hi], lo, kv.block_table(rid), greedy, 0, 0)

    steps = [[row("a", 0, 32), row("b", 0, 20)],  # two prefill chunks
             [row("a", 32, 37), row("b", 20, 70), row("c", 0, 5)]]  # chunks with history and a short prompt
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
    for rid in "abc":
        table, n = kv.block_table(rid), len(tokens[rid]) - 1  # the last sampled token has no K/V yet
        for got, want in zip(kv_of(group, table, n), kv_of(one, table, n)):
            np.testing.assert_allclose(got, want, **TOL)
    # the request's blocks really are spread: every device of the group holds part of "b"'s context
    assert {b % kvp for b in kv.block_table("b")} == set(range(kvp))


def test_landed_rows_reach_only_their_owners(devices, params):
    group = runner(params, devices[:4], PER_DEVICE * 4)
    rng = np.random.default_rng(0)
    n = 23
    shape = (CFG.num_layers, n, CFG.num_kv_heads, CFG.head_dim)
    k, v = (jax.device_put(rng.standard_normal(shape).astype(np.float32), devices[0]) for _ in range(2))
    table = [5, 10, 7, 12, 9, 6]  # blocks on devices 1, 2, 3, 0, 1, 2
    slots = np.asarray(table)[np.arange(n) // BS] * BS + np.arange(n) % BS
    group.land(k, v, slots)
    got_k, got_v = kv_of(group, table, n)
    np.testing.assert_array_equal(got_k, np.asarray(k))
    np.testing.assert_array_equal(got_v, np.asarray(v))
    # nothing else was written: the cache holds exactly these rows
    assert np.count_nonzero(np.asarray(group.caches[0]).any(axis=(0, 2, 3))) == n
