"""The live cluster against the single-device engine: a ~3K-token prompt chunked over prefill groups of 2 -> 4 ->
8 devices, its KV streamed chunk by chunk to a decode instance on other devices, gives the same greedy tokens;
the same with the decode on a KV-parallel group; nothing compiles after warm-up; the receive-buffer handshake
orders transfers and decode starts."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from conftest import MAX_MODEL_LEN, busy, engine_maker, make_cluster, prompt, run
from jaxserve.cluster.build import build, warmup
from jaxserve.cluster.decode import LiveDecoder
from jaxserve.cluster.engine import ClusterEngine
from jaxserve.cluster.transfer import KVMover
from jaxserve.config import ParallelConfig
from jaxserve.engine.interface import ServingEngine
from jaxserve.sampling_params import SamplingParams
from jaxserve.sched.cdsp import MeasuredBalancing
from jaxserve.sched.cluster import CDSPPolicy
from jaxserve.sched.cost_models import TetrisPrefill
from jaxserve.sched.decode_dispatch import ObservedLengths

GREEDY = SamplingParams(max_tokens=24)


@pytest.fixture(scope="module")
def cluster(llm, devices):
    return make_cluster(llm, devices, decode_instances=2)


@pytest.fixture(scope="module")
def long_prompt(llm):
    """A 3,000-token prompt and the single-device engine's greedy tokens for it."""
    ids = prompt(llm, 3000, 0)
    (want,) = [c.token_ids for c in llm.generate([ids], GREEDY)]
    return ids, want


# queues under which the planner chunks a ~3K-token prompt over groups of 2 -> 4 -> 8 devices
GROWING = {2: 0.2, 3: 0.2} | {i: 0.3 for i in range(4, 8)}


def prefill_over_2_4_8(cluster, ids) -> list[int]:
    """Run the prompt with queues set so the planner chunks it over groups of 2 -> 4 -> 8 devices."""
    busy(cluster, GROWING)
    rebalances = cluster.events["rebalances"]
    (got,) = run(cluster, [(ids, GREEDY)])
    assert cluster.events["rebalances"] == rebalances + 2  # before the group of 4, and before the group of 8
    assert (cluster.events["chunks"], cluster.events["transfers"]) == (len(cluster.records), len(cluster.transfers))
    rid = cluster.records[-1].request_id
    assert [len(r.group) for r in cluster.records if r.request_id == rid] == [2, 4, 8]
    # the history was rebalanced before each larger group; the transfers came chunk by chunk
    assert len([t for _, t in cluster.transfers if t.request_id == rid]) == 3
    return got


def test_the_simulator_makes_the_live_clusters_plans(llm, cluster):
    """Live against simulated, the cluster contract's check: a burst of prompts planned and dispatched live,
    replayed through sim/disagg.py with the same arrival times, planner and decode capacity, gets the same chunks
    on the same groups and the same decode instances. First in this module: neither length predictor has
    learned anything yet (after the other tests the live one has), and max_tokens is the prior's prediction, so
    the cap the simulator does not know changes no promise."""
    from jaxserve.sim.replay import Line, LiveRun, replay

    lengths = [3000, 1500, 700, 300, 1200]
    requests = [(prompt(llm, n, 40 + i), SamplingParams(max_tokens=320)) for i, n in enumerate(lengths)]
    before = len(cluster.records)
    outputs = run(cluster, requests)
    arrivals = list(cluster.arrivals)[-len(requests) :]
    first = arrivals[0][1]
    planner, decoder = cluster.planner, cluster.decoders[0]
    # the engine's steps were never measured here (priced at zero): the simulated ones a millisecond a program,
    # which decides nothing above (every plan and dispatch is made at arrival)
    step = decoder.engine.scheduler.cost.to_dict()
    step["base"] = [[1e-3] * len(row) for row in step["base"]]
    step["decode_base"] = [1e-3] * len(step["decode_base"])
    live_run = LiveRun(
        "cdsp",
        len(cluster.pool_ids),
        len(cluster.decoders),
        planner.pool.per_node,
        [(t - first, n, len(out)) for (_, t, n), out in zip(arrivals, outputs)],
        json.loads(planner.model.to_json()),
        step,
        Line(0.0, 0.0),
        decoder.kv_tokens,
        decoder.engine.max_num_seqs,
        MAX_MODEL_LEN,
        dict(improvement_rate=planner.improvement_rate, sizes=list(planner.sizes), min_chunk=planner.min_chunk),
    )
    sim = replay(live_run)
    slot = cluster.pool_ids.index
    for k, (rid, _, _) in enumerate(arrivals):
        live_chunks = [tuple(sorted(map(slot, r.group))) for r in list(cluster.records)[before:] if r.request_id == rid]
        sim_chunks = [tuple(sorted(group)) for ids, group, _, _ in sim.prefills if ids == (str(k),)]
        assert live_chunks == sim_chunks, (k, live_chunks, sim_chunks)
        (live_decoder,) = {d for d, t in cluster.transfers if t.request_id == rid}
        assert live_decoder == sim.decoders[str(k)], k
    assert {len(g) for ids, g, _, _ in sim.prefills} != {2}  # the burst's plans used more than one group size
    assert (cluster.free_at <= cluster.clock()).all()  # late chunks moved the bookings once: idle devices are free


def test_prefill_over_growing_groups_then_decode_elsewhere_equals_one_device(cluster, long_prompt):
    assert isinstance(cluster, ServingEngine)  # what LLM and the servers drive
    ids, want = long_prompt
    assert prefill_over_2_4_8(cluster, ids) == want


def one_decoder(cluster, engine, receive_buffers: int) -> ClusterEngine:
    """The cluster's prefill pool and planner with `engine` as its one decode instance."""
    mover = KVMover(cluster.prefill, [engine.runner])
    scheduler = CDSPPolicy(cluster.planner, cluster.pool_ids, predictor=ObservedLengths())
    return ClusterEngine(cluster.prefill, scheduler, [LiveDecoder(0, engine, receive_buffers, mover)], mover)


@pytest.mark.parametrize("kvp", [4])  # 2: test_llm_layouts.py's cluster; 1-8: tests/sharding's merge
def test_kv_parallel_decode_group_equals_one_device(llm, devices, cluster, long_prompt, kvp):
    """The same prompt decoded on a KV-parallel group whose devices each hold less KV than its context: the
    landed rows spread over every device of the group, each decode step merges their partials."""
    ids, want = long_prompt
    per_device = MAX_MODEL_LEN // kvp
    assert per_device < len(ids)
    engine = llm.builder.engine(devices[8 : 8 + kvp], progress=False, kv_cache_tokens=per_device)
    group = one_decoder(cluster, engine, receive_buffers=4)
    assert prefill_over_2_4_8(group, ids) == want
    held = [
        np.count_nonzero(np.asarray(s.data).any(axis=(0, 2, 3))) for s in engine.runner.caches[0].addressable_shards
    ]
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
        if len(one.records) == 2 and decoder.ledger.waiting:
            break
        for out in one.step():
            tokens[out.request_id] += out.new_token_ids
    assert [t.request_id for t in decoder.ledger.held] == [a_id]  # sent, cannot land: no blocks
    assert [t.request_id for t in decoder.ledger.waiting] == [b_id]  # finished, waiting for the buffer
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
    started = dict(one.decode_started)
    for t in (a, b):
        assert started[t.request_id] >= t.landed


def test_no_compilation_after_warmup_across_varied_requests(llm, cluster):
    """Six prompts, one of 3,000 tokens and five of 100 to 1,500, under varied queues: chunks on every group
    size, no compile."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: (
            compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
        )
    )
    rng = np.random.default_rng(1)
    requests = [
        (prompt(llm, int(n), i), SamplingParams(max_tokens=4))
        for i, n in enumerate([3000, *rng.integers(100, 1500, 5)])
    ]
    before = len(cluster.records)
    for k, (ids, params) in enumerate(requests):  # the long one grows over 2 -> 4 -> 8, the others vary
        busy(cluster, GROWING if k == 0 else {i: float(rng.uniform(0, 0.4)) for i in range(8)})
        run(cluster, [(ids, params)])
    assert compiles == []
    assert {len(r.group) for r in list(cluster.records)[before:]} == {2, 4, 8}


def test_a_cluster_plans_with_a_prior_until_it_measures_its_pool_while_idle(llm, devices, tmp_path):
    """A quick start (build's defer, what serve and generate do by default): with no Eq. (1) on disk the pool
    plans with the prior at once and serves; while idle it measures its own Eq. (1) and cache-balancing line one
    point at a time, never while a request is in and returning once one waits, writes them and plans with them
    from then on. After the warm-up, measuring and serving compile nothing."""
    path, context = tmp_path / "eq1.json", 1024
    layout = ParallelConfig(prefill_instances=4, decode_instances=1, node_size=2, min_chunk=256)
    cluster = build(
        llm.config,
        llm.builder.params,
        layout,
        engine_maker(llm),
        path,
        capacity=context,
        min_local=64,
        devices=devices[:5],
        progress=False,
        defer=True,
    )
    prior = TetrisPrefill.prior([2, 4])
    assert cluster.planner.model.to_json() == prior.to_json() and cluster.has_deferred and not path.exists()
    warmup(cluster, context, progress=False)
    ids = prompt(llm, 900, 7)
    (want,) = [c.token_ids for c in llm.generate([ids], GREEDY)]  # (the reference engine compiles its own)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: (
            compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
        )
    )
    assert run(cluster, [(ids, GREEDY)]) == [want]  # served on the prior's plan

    cluster.add_request(ids, GREEDY)
    cluster.run_deferred(stop=lambda: False)  # a request is in: nothing is measured
    measurement = cluster._idle[0].measurement
    assert not measurement.samples
    while cluster.has_unfinished():
        cluster.step()
    answers = iter([False, False, True])  # a request comes after two points
    cluster.run_deferred(stop=lambda: next(answers))
    assert len(measurement.samples) == 2 and not path.exists() and cluster.planner.model.to_json() == prior.to_json()
    cluster.run_deferred(stop=lambda: False)
    assert not cluster.has_deferred
    measured = TetrisPrefill.from_json(path.read_text())
    assert cluster.planner.model.to_json() == measured.to_json() != prior.to_json()
    moves = MeasuredBalancing(**json.loads((tmp_path / "eq1-moves.json").read_text()))
    assert cluster.planner.balancing == moves and moves.move(2, 4, 512, False) > 0
    assert run(cluster, [(ids, GREEDY)]) == [want]  # served on the measured plan
    assert compiles == []
