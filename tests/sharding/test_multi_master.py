"""Multi-master decode's data path (cluster/multi_master.py): a request's KV held on two decode instances at
once, each share in its own pool, decodes with one device's greedy tokens; the new tokens' K/V lands on the
instance their block is on, the other share never moves, and each instance goes on serving from its own pool."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.cluster.multi_master import MultiMaster
from jaxserve.engine import batch
from jaxserve.sampling_params import SamplingParams
from jaxserve.sched.spread_kv import group_block
from test_parallel_runner import BS, CFG, TOL, heads_held, kv_of, runner

PER_DEVICE = 40  # blocks in each instance's pool, its scratch block included
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def params():
    from conftest import random_params

    return random_params(CFG)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_request_spread_over_two_instances_decodes_as_on_one_device(devices, params, tp):
    one = runner(params, devices[:1], PER_DEVICE)
    a, b = (
        runner(params, devices[1 : 1 + tp], PER_DEVICE, tp),
        runner(params, devices[1 + tp : 1 + 2 * tp], PER_DEVICE, tp),
    )
    group = MultiMaster([a, b], params)
    rng = np.random.default_rng(tp)
    prompt = rng.integers(0, CFG.vocab_size, 70).tolist()
    decodes = 10
    # the reference: prefill and decode on one device, blocks 1..
    ref_table = list(range(1, 1 + -(-(len(prompt) + decodes) // BS)))
    tokens = list(prompt) + [int(one.execute([batch.Row(prompt, 0, ref_table, GREEDY, 0, 0)])[0])]
    # the prompt's KV lands as a prefill pool would send it: its first 40 tokens on a (blocks 1-10), the rest on
    # b (blocks 3-10); the decode goes on in b's last block, then in a's 11-13
    k, v = kv_of(one, ref_table, len(prompt))
    blocks = [(0, 1 + i) for i in range(10)] + [(1, 3 + i) for i in range(8)] + [(0, 11 + i) for i in range(3)]
    for instance, runner_ in enumerate((a, b)):
        held = [p for p in range(len(prompt)) if blocks[p // BS][0] == instance]
        slots = np.array([blocks[p // BS][1] * BS + p % BS for p in held])
        runner_.land(*(jax.device_put(x[:, held], runner_.device) for x in (k, v)), slots)
    table = [group_block(instance, block, 2) for instance, block in blocks]
    for _ in range(decodes - 1):
        row = [batch.Row(tokens[-1:], len(tokens) - 1, table, GREEDY, 0, 0)]
        want = one.execute([batch.Row(tokens[-1:], len(tokens) - 1, ref_table, GREEDY, 0, 0)])
        np.testing.assert_array_equal(group.execute(row), want)
        tokens.append(int(want[0]))
    # each instance's pool holds exactly its share of the request's K/V, the prompt's landed rows and the decode's
    # (the new tokens' K/V landed where their blocks are: b's last block, then a's) and nothing else but in its
    # scratch block 0 (where a device writes the rows it does not own)
    n = len(tokens) - 1
    want = kv_of(one, ref_table, n)
    for instance, runner_ in enumerate((a, b)):
        mine = [p for p in range(n) if blocks[p // BS][0] == instance]
        rows = [blocks[p // BS][1] * BS + p % BS for p in mine]
        for got, w in zip(runner_.caches, want):
            expected = np.zeros(got.shape, np.float32)
            expected[:, rows] = w[:, mine][:, :, heads_held(runner_)]
            np.testing.assert_allclose(np.asarray(got)[:, BS:], expected[:, BS:], **TOL)
    # each instance serves its own request from its own pool after the group's steps: one device's tokens
    other = rng.integers(0, CFG.vocab_size, 9).tolist()
    for r in (a, b):
        np.testing.assert_array_equal(
            r.execute([batch.Row(other, 0, [20, 21, 22], GREEDY, 0, 0)]),
            one.execute([batch.Row(other, 0, [30, 31, 32], GREEDY, 0, 0)]),
        )


def test_instances_that_cannot_join_are_refused(devices, params):
    a, b = runner(params, devices[:1], PER_DEVICE), runner(params, devices[1:2], PER_DEVICE + 2)
    with pytest.raises(ValueError, match="the same tensor-parallel size and pool"):
        MultiMaster([a, b], params)
    with pytest.raises(ValueError, match="at least two"):
        MultiMaster([a], params)
