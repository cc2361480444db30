"""The live cluster against the single-device engine: a ~3K-token prompt chunked over prefill groups of 2 -> 4 ->
8 devices, its KV streamed chunk by chunk to a decode instance on other devices, gives the same greedy tokens;
the same with the decode on a KV-parallel group; nothing compiles after warm-up; the receive-buffer handshake
orders transfers and decode starts; and LLM's layout arguments build, profile and serve such a cluster, with
tensor-parallel instances, and serve one tensor-parallel instance alone."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxserve
from conftest import MAX_MODEL_LEN, busy, make_cluster, run
from jaxserve.cluster.decode import DecodeInstance
from jaxserve.cluster.engine import ClusterEngine
from jaxserve.cluster.transfer import KVMover
from jaxserve.sampling_params import SamplingParams
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


def one_decoder(cluster, engine, receive_buffers: int) -> ClusterEngine:
    """The cluster's prefill pool and planner with `engine` as its one decode instance."""
    mover = KVMover(cluster.prefill, [engine.runner])
    return ClusterEngine(cluster.prefill, cluster.planner, [DecodeInstance(0, engine, receive_buffers, mover)], mover)


@pytest.mark.parametrize("kvp", [2, 4])
def test_kv_parallel_decode_group_equals_one_device(llm, devices, cluster, long_prompt, kvp):
    """The same prompt decoded on a KV-parallel group whose devices each hold less KV than its context: the
    landed rows spread over every device of the group, each decode step merges their partials."""
    ids, want = long_prompt
    per_device = MAX_MODEL_LEN // kvp
    assert per_device < len(ids)
    engine = llm.make_engine(devices[8:8 + kvp], progress=False, kv_cache_tokens=per_device)
    group = one_decoder(cluster, engine, receive_buffers=4)
    assert prefill_over_2_4_8(group, ids) == want
    held = [np.count_nonzero(np.asarray(s.data).any(axis=(0, 2, 3))) for s in engine.runner.caches[0].addressable_shards]
    assert len(held) == kvp and min(held) >= len(ids) // kvp - 16  # about a 1/kvp share each


def test_one_receive_buffer_sends_transfers_one_after_the_other(llm, cluster):
    """Tetris's handshake with one receive buffer: while the decode instance has no blocks free, the first
    finished prefill's transfer holds the buffer (it cannot land) and the second's waits unsent; once blocks free,
    the first lands, then the second is sent and lands, and neither request decodes before its KV has landed."""
    one = one_decoder(cluster, cluster.decoders[0].engine, receive_buffers=1)
    decoder = one.decoders[0]
    engine = decoder.engine
    for i in range(2):  # 2 x 4,000 of the 8,192 KV slots: too few left for a 300-token prompt
        engine.expect(prompt(llm, 4000, 10 + i), SamplingParams(max_tokens=1), f"hold-{i}")
        assert engine.reserve(f"hold-{i}") is not None
    requests = [(prompt(llm, 300, seed), SamplingParams(max_tokens=4)) for seed in (1, 2)]
    want = [c.token_ids for c in llm.generate([ids for ids, _ in requests], requests[0][1])]
    a_id, b_id = (one.add_request(ids, params) for ids, params in requests)
    tokens = {a_id: [], b_id: []}
    for _ in range(100_000):
        if len(one.records) == 2 and decoder.buffers.waiting:
            break
        for out in one.step():
            tokens[out.request_id] += out.new_token_ids
    assert [t.request_id for t in decoder.buffers.held] == [a_id]  # sent, cannot land: no blocks
    assert [t.request_id for t in decoder.buffers.waiting] == [b_id]  # finished, waiting for the buffer
    assert not one.transfers and not one.decode_started
    for i in range(2):
        engine.abort(f"hold-{i}")
    while one.has_unfinished():
        for out in one.step():
            tokens[out.request_id] += out.new_token_ids
    assert [tokens[a_id], tokens[b_id]] == want
    (_, a), (_, b) = one.transfers
    assert (a.request_id, b.request_id) == (a_id, b_id)
    assert b.ready < a.landed <= b.sent <= b.landed  # b waited for a's buffer
    for t in (a, b):
        assert one.decode_started[t.request_id] >= t.landed


def test_no_compilation_after_warmup_across_varied_requests(llm, cluster):
    """Eight prompts of 100 to 3,000 tokens under varied queues: chunks on every group size, no compile."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration"
        else None)
    rng = np.random.default_rng(1)
    requests = [(prompt(llm, int(n), i), SamplingParams(max_tokens=4))
                for i, n in enumerate(rng.integers(100, 3000, 8))]
    for k, (ids, params) in enumerate(requests):  # varied queues: every group size gets chunks
        busy(cluster, {i: float(rng.uniform(0, 0.4)) for i in range(8)})
        run(cluster, [(ids, params)])
    assert compiles == []
    assert {len(r.group) for r in cluster.records} == {2, 4, 8}


def test_llm_with_a_layout_serves_through_a_cluster_it_profiled(llm, tmp_path):
    """LLM(tp=..., prefill_instances=...) (what serve/generate's layout flags build), in instances of 3
    tensor-parallel devices (SmolLM2's 9 heads over 3 KV heads: 3 and 1 per device): the pool's Eq. (1) is
    measured and written where asked, and generation through the cluster (a prefill pool of 2 instances, one
    decode instance KV-parallel over 2, 12 devices in all) gives the single-device engine's greedy tokens."""
    path = tmp_path / "eq1.json"
    clustered = jaxserve.LLM(max_model_len=1024, kv_cache_tokens=1024, max_num_seqs=4, max_num_batched_tokens=256,
                             tp=3, prefill_instances=2, decode_instances=1, decode_kvp=2, min_chunk=256,
                             prefill_profile=str(path), progress=False)
    assert isinstance(clustered.engine, ClusterEngine)
    assert [len(i) for i in clustered.engine.prefill.instances.values()] == [3, 3]
    assert len(clustered.engine.decoders[0].engine.runner.devices) == 6
    fit = TetrisPrefill.from_json(path.read_text())
    assert set(fit.coefficients) == {2} and fit.predict(2, 512) > fit.predict(2, 64) > 0
    ids = [prompt(llm, 700, 3), prompt(llm, 90, 4)]
    want = [c.token_ids for c in llm.generate(ids, GREEDY)]
    assert [c.token_ids for c in clustered.generate(ids, GREEDY)] == want


def test_llm_on_one_tensor_parallel_instance_equals_one_device(llm):
    """LLM(tp=3) without a cluster layout: one engine whose step runs on 3 devices, each with a third of every
    layer's heads and MLP and of the KV cache's heads, gives the single-device engine's greedy tokens."""
    tp = jaxserve.LLM(max_model_len=1024, kv_cache_tokens=2048, max_num_seqs=4, max_num_batched_tokens=256, tp=3,
                      progress=False)
    runner = tp.engine.runner
    assert len(runner.devices) == 3 and runner.caches[0].shape[2] == 3
    assert {s.data.shape[2] for s in runner.caches[0].addressable_shards} == {1}  # one KV head per device
    ids = [prompt(llm, 700, 5), prompt(llm, 90, 6), prompt(llm, 30, 7)]
    want = [c.token_ids for c in llm.generate(ids, GREEDY)]
    assert [c.token_ids for c in tp.generate(ids, GREEDY)] == want
