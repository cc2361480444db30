"""The live cluster against the single-device engine: a ~3K-token prompt chunked over prefill groups of 2 -> 4 ->
8 devices, its KV streamed chunk by chunk to a decode instance on other devices, gives the same greedy tokens;
the same with the decode on a KV-parallel group; nothing compiles after warm-up; the receive-buffer handshake
orders transfers and decode starts; and LLM's layout arguments build, profile and serve such a cluster."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxserve
from conftest import MAX_MODEL_LEN, busy, make_cluster, run
from jaxserve.cluster.decode import DecodeInstance
from jaxserve.cluster.engine import ClusterEngine
from jaxserve.engine.sampling import SamplingParams
from jaxserve.sched.cost_models import TetrisPrefill

GREEDY = SamplingParams(max_tokens=24)


def prompt(llm, n: int, seed: int) -> list[int]:
    """n tokens of real text (the tokenizer's encoding of varied English), so greedy decoding is not degenerate."""
    words = "the of and to in is was for on that with as by at from his her it an were are which this be".split()
    rng = np.random.default_rng(seed)
    ids = llm.tokenizer.encode(" ".join(rng.choice(words, 2 * n)))
    return ids[:n]


@pytest.fixture(scope="module")
def cluster(llm, devices):
    return make_cluster(llm, devices, decode_instances=2)


@pytest.fixture(scope="module")
def long_prompt(llm):
    """A 3,000-token prompt and the single-device engine's greedy tokens for it."""
    ids = prompt(llm, 3000, 0)
    (want,) = [c.token_ids for c in llm.generate([ids], GREEDY)]
    return ids, want


def prefill_over_2_4_8(cluster, ids) -> list[int]:
    """Run the prompt with queues set so the planner chunks it over groups of 2 -> 4 -> 8 devices."""
    busy(cluster, {2: 0.2, 3: 0.2} | {i: 0.3 for i in range(4, 8)})
    (got,) = run(cluster, [(ids, GREEDY)])
    rid = next(reversed(cluster.plans))
    assert [len(r.group) for r in cluster.records if r.request_id == rid] == [2, 4, 8]
    # the history was rebalanced before each larger group; the transfers came chunk by chunk
    assert len([t for _, t in cluster.transfers if t.request_id == rid]) == 3
    return got


def test_prefill_over_growing_groups_then_decode_elsewhere_equals_one_device(cluster, long_prompt):
    ids, want = long_prompt
    assert prefill_over_2_4_8(cluster, ids) == want


@pytest.mark.parametrize("kvp", [2, 4])
def test_kv_parallel_decode_group_equals_one_device(llm, devices, cluster, long_prompt, kvp):
    """The same prompt decoded on a KV-parallel group whose devices each hold less KV than its context: the
    landed rows spread over every device of the group, each decode step merges their partials."""
    ids, want = long_prompt
    per_device = MAX_MODEL_LEN // kvp
    assert per_device < len(ids)
    engine = llm.make_engine(devices[8:8 + kvp], progress=False, kv_cache_tokens=per_device)
    group = ClusterEngine(cluster.prefill, cluster.planner, [DecodeInstance(0, engine, receive_buffers=4)])
    assert prefill_over_2_4_8(group, ids) == want
    held = [np.count_nonzero(np.asarray(s.data).any(axis=(0, 2, 3))) for s in engine.runner.caches[0].addressable_shards]
    assert len(held) == kvp and min(held) >= len(ids) // kvp - 16  # about a 1/kvp share each


def test_one_receive_buffer_sends_transfers_one_after_the_other(llm, cluster):
    """Tetris's handshake: two prefills finish in the same step; with one receive buffer the second transfer waits
    until the first has landed, and no decode starts before its request's KV has landed. A clock that ticks at
    every reading makes each event's time distinct, so 'after' is strict."""
    ticks = iter(range(1, 1 << 30))
    decoder = DecodeInstance(0, cluster.decoders[0].engine, receive_buffers=1)
    one = ClusterEngine(cluster.prefill, cluster.planner, [decoder], clock=lambda: next(ticks) * 1e-3)
    requests = [(prompt(llm, 300, seed), SamplingParams(max_tokens=4)) for seed in (1, 2)]
    (want_a, want_b) = [c.token_ids for c in llm.generate([ids for ids, _ in requests], requests[0][1])]
    # Eq. (1) stand-in: 300 tokens take 0.07 s on 2 devices, 0.04 s on 4. With devices 2, 3 busy 0.035 s and 4-7
    # long, the first prompt is best on {0, 1} now and the second on {2, 3} (waiting for {0..3} is slower)
    busy(one, {2: 0.035, 3: 0.035} | {i: 10.0 for i in range(4, 8)})
    assert run(one, requests) == [want_a, want_b]
    first, second = (set(r.group) for r in one.records)
    assert len(one.records) == 2 and not first & second  # one chunk each, side by side
    (_, a), (_, b) = sorted(one.transfers, key=lambda x: x[1].sent)
    assert b.ready < a.sent < a.landed < b.sent < b.landed  # b was waiting while a held the only buffer
    for t in (a, b):
        assert one.decode_started[t.request_id] > t.landed


def test_no_compilation_after_warmup_across_twenty_requests(llm, cluster):
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration"
        else None)
    rng = np.random.default_rng(1)
    requests = [(prompt(llm, int(n), i), SamplingParams(max_tokens=4))
                for i, n in enumerate(rng.integers(100, 3000, 20))]
    for k, (ids, params) in enumerate(requests):  # varied queues: every group size gets chunks
        busy(cluster, {i: float(rng.uniform(0, 0.4)) for i in range(8)})
        run(cluster, [(ids, params)])
    assert compiles == []
    assert {len(r.group) for r in cluster.records} == {2, 4, 8}


def test_llm_with_a_layout_serves_through_a_cluster_it_profiled(llm, tmp_path):
    """LLM(prefill_instances=...) (what serve/generate's layout flags build): the pool's Eq. (1) is measured and
    written where asked, and generation through the cluster (a prefill pool of 2 devices, one decode instance
    KV-parallel over 2) gives the single-device engine's greedy tokens."""
    path = tmp_path / "eq1.json"
    clustered = jaxserve.LLM(max_model_len=1024, kv_cache_tokens=1024, max_num_seqs=4, max_num_batched_tokens=256,
                             prefill_instances=2, decode_instances=1, decode_kvp=2, min_chunk=256,
                             prefill_profile=str(path), progress=False)
    assert isinstance(clustered.engine, ClusterEngine)
    fit = TetrisPrefill.from_json(path.read_text())
    assert set(fit.coefficients) == {2} and fit.predict(2, 512) > fit.predict(2, 64) > 0
    ids = [prompt(llm, 700, 3), prompt(llm, 90, 4)]
    want = [c.token_ids for c in llm.generate(ids, GREEDY)]
    assert [c.token_ids for c in clustered.generate(ids, GREEDY)] == want
