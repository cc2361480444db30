"""LoongServe's elastic SP live (--cluster_policy=esp): every instance prefills and decodes; prompts are batched
onto elastic groups (ring attention over several instances), then each decodes on one instance of its group,
against the single-device engine's greedy tokens."""

from __future__ import annotations

import functools
import json
import time

import jax
import numpy as np

import jaxserve
from conftest import MAX_MODEL_LEN, engine_maker, prompt, run, serve
from jaxserve.cluster.build import Compiling, build, spread_engine
from jaxserve.cluster.esp import ESPCluster
from jaxserve.config import ParallelConfig
from jaxserve.engine.interface import ServingEngine
from jaxserve.sampling_params import SamplingParams
from jaxserve.sched.cost_models import LoongServePrefill
from jaxserve.sched.esp import aligned_groups

GREEDY = SamplingParams(max_tokens=12)


def batch_model() -> LoongServePrefill:
    """A stand-in batch model (these tests set up the scheduler's decisions, not its accuracy): more instances
    are faster per token, and attention's square term makes long prompts gain the most."""
    return LoongServePrefill({(s, 1): np.array([0.01, 4e-4 / s, 2e-7 / s]) for s in (1, 2, 4)})


def test_aligned_groups():
    assert aligned_groups(4) == [(0,), (1,), (2,), (3,), (0, 1), (2, 3), (0, 1, 2, 3)]
    assert aligned_groups(3) == [(0,), (1,), (2,), (0, 1)]


def test_elastic_batches_scale_up_and_down_and_equal_one_device(llm, devices):
    """Five prompts at once on 4 elastic instances (programs compiled when first used): the DP batches them onto
    aligned groups, the 3,000-token one over several instances (a scale-up); each decodes on one instance of its
    group (a scale-down: the other
    instances' KV moves to it). A second wave arrives while the first decodes: the instances it prefills on pause
    their decodes. Every prompt gets the single-device engine's greedy tokens."""
    layout = ParallelConfig(prefill_instances=4, cluster_policy="esp")
    cluster = build(
        llm.config,
        llm.builder.params,
        layout,
        engine_maker(llm),
        batch_model(),
        capacity=MAX_MODEL_LEN,
        min_local=64,
        devices=devices[:4],
        progress=False,
    )
    assert isinstance(cluster, ESPCluster) and isinstance(cluster, ServingEngine)
    lengths = [3000, 300, 40, 700, 90]
    ids = [prompt(llm, n, 40 + k) for k, n in enumerate(lengths)]
    want = [c.token_ids for c in llm.generate(ids, GREEDY)]
    assert run(cluster, [(x, GREEDY) for x in ids]) == want

    group = {r.request_id: r.group for r in cluster.records}
    assert len(group) == len(lengths) and all(r.index == 0 and r.history == 0 for r in cluster.records)
    longest = next(r for r in cluster.records if r.tokens == 3000)
    assert len(longest.group) > 1  # scaled up
    assert all(g in [tuple(cluster.pool_ids[i] for i in a) for a in aligned_groups(4)] for g in group.values())
    # each prompt's KV went, in one transfer, to an instance of its prefill group
    assert sorted(t.request_id for _, t in cluster.transfers) == sorted(group)
    assert all(cluster.pool_ids[i] in group[t.request_id] for i, t in cluster.transfers)
    spread = sum(len(g) > 1 for g in group.values())
    assert cluster.events["scale_downs"] == spread
    assert cluster.events["scale_ups"] >= 1 and cluster.events["chunks"] == len(lengths)
    assert cluster.events["transfers"] == len(lengths)

    # a second wave while two long decodes run: its prefills pause the decodes of the instances they use
    long_decode = SamplingParams(max_tokens=32)
    first = [prompt(llm, n, 60 + k) for k, n in enumerate([300, 200])]
    second = [prompt(llm, n, 70 + k) for k, n in enumerate([800, 60])]
    want = [c.token_ids for c in llm.generate(first, long_decode)] + [c.token_ids for c in llm.generate(second, GREEDY)]
    rids = [cluster.add_request(x, long_decode) for x in first]
    tokens = {rid: [] for rid in rids}
    while sum(len(t) for t in tokens.values()) < 8:  # both decoding
        for out in cluster.step():
            tokens[out.request_id] += out.new_token_ids
    later = [cluster.add_request(x, GREEDY) for x in second]
    tokens |= {rid: [] for rid in later}
    while cluster.has_unfinished():
        for out in cluster.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
    assert [tokens[r] for r in rids + later] == want
    assert not cluster.has_unfinished() and cluster.num_running == 0


def test_llm_serves_through_esp_by_its_flag(model, llm, tmp_path):
    """LLM(cluster_policy="esp", ...) (what --cluster_policy builds), started as serve starts it (warmup with
    quick_start, the default): the instances compile their first decode programs, the pool nothing; the cluster
    plans with the prior; while idle it compiles its programs (the instances the rest in the background), measures
    LoongServe's batch model and the step profile and plans with them (the multi-master group too). Then it
    compiles nothing more, generates the single-device text, and serves it (the openai client over HTTP) with its
    events in /metrics. Its context is its two instances' pools together: the 900-token prompt decodes over
    both."""
    batches, steps = tmp_path / "esp.json", tmp_path / "step.json"
    clustered = jaxserve.LLM(
        model,
        max_model_len=1024,
        kv_cache_tokens=512,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        prefill_instances=2,
        cluster_policy="esp",
        warmup=True,
        prefill_profile=str(batches),
        cost_profile=str(steps),
        progress=False,
    )
    cluster = clustered.engine
    assert isinstance(cluster, ESPCluster) and clustered.max_model_len == 1024
    assert cluster.prefill.num_programs == 0 and isinstance(cluster._idle[0], Compiling)
    runner = cluster.decoders[0].engine.runner
    assert set(runner.first_programs(mixed=False)) <= set(runner.compiled_programs()) and clustered.builder.cost is None
    elastic = cluster.scheduler.elastic
    assert elastic.model.to_json() == LoongServePrefill.prior([(1, 1), (2, 1)]).to_json()
    while cluster.has_deferred:  # the instances measure once their background compiles are done
        cluster.run_deferred(stop=lambda: False)
        time.sleep(0.2)
    assert cluster.prefill.num_programs == len(cluster.chunk_shapes(1024))
    assert elastic.model.to_json() == LoongServePrefill.from_json(batches.read_text()).to_json()
    assert set(elastic._sp) == {1, 2}  # fitted per SP size
    cost = clustered.builder.cost
    assert cost is not None and all(d.engine.scheduler.cost is cost for d in cluster.decoders)
    ids = [prompt(llm, 900, 31), prompt(llm, 50, 32), prompt(llm, 400, 33)]
    want = llm.generate(ids, GREEDY)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: (
            compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
        )
    )
    assert [c.token_ids for c in clustered.generate(ids, GREEDY)] == [c.token_ids for c in want]
    assert compiles == []
    texts, events = serve(clustered, ids, GREEDY.max_tokens)  # `serve` over the same cluster
    assert texts == [c.text for c in want]
    assert events == {k: float(v) for k, v in clustered.engine.events.items()} and events["chunks"] == 6, events
    assert events["multi_master"] == 2, events  # the 900-token prompt, each time


def test_a_request_whose_kv_outgrows_one_instance_decodes_over_several(llm, devices):
    """Instances of 256 KV tokens: a 400-token prompt is prefilled over a group, keeps its KV on the fewest
    instances that hold it and its decode (a scale-down), decodes multi-master over them (the query moves, the KV
    stays) and grows onto a third instance when its last one fills (a scale-up for decode). A short prompt beside
    it decodes on one instance's own engine. Both get the single-device engine's greedy tokens."""
    small = 256
    layout = ParallelConfig(prefill_instances=4, cluster_policy="esp")
    make = lambda ds, tp: llm.builder.engine(
        ds,
        progress=False,
        tp=tp,
        kv_cache_tokens=small,
        max_model_len=small,
    )
    cluster = build(
        llm.config,
        llm.builder.params,
        layout,
        make,
        batch_model(),
        capacity=4 * small,
        store_tokens=small,
        min_local=64,
        devices=devices[:4],
        progress=False,
        make_group=functools.partial(spread_engine, llm.builder),
    )
    assert cluster.max_model_len == 4 * small and cluster.group is not None
    long, short = SamplingParams(max_tokens=100, ignore_eos=True), SamplingParams(max_tokens=12, ignore_eos=True)
    ids = [prompt(llm, 400, 80), prompt(llm, 50, 81)]
    want = [c.token_ids for c in llm.generate(ids, [long, short])]
    assert run(cluster, [(ids[0], long), (ids[1], short)]) == want

    spread = cluster.group.engine
    assert cluster.events["multi_master"] == 1 and cluster.events["scale_downs"] >= 1
    assert cluster.events["decode_scale_ups"] == 1, cluster.events  # 400 + 100 tokens: two instances, then a third
    assert [t.request_id for i, t in cluster.transfers if i == len(cluster.pool_ids)] == ["req-0"]
    assert spread.kv.num_free == sum(d.engine.kv.num_free for d in cluster.pools) == 4 * (small // 16)
    assert not cluster.has_unfinished()

    # aborted while it decodes over its instances: every block goes back to the instance it came from
    rid = cluster.add_request(ids[0], long)
    while not spread.num_running:
        cluster.step()
    cluster.step()
    assert spread.kv.held(rid) and len(spread.kv.held(rid)) > 1
    assert cluster.abort(rid) and not cluster.has_unfinished()
    assert [d.engine.kv.num_free for d in cluster.pools] == [small // 16] * 4


def test_the_simulator_makes_the_live_clusters_esp_plans(llm, devices):
    """Live against simulated under ESP: a burst of eight prompts on 4 elastic instances, replayed through
    sim/disagg.py's elastic instances (each decoding with the live ReplicaScheduler) with the live run's batch
    model, gets the same batches (each batch's prompts, in order) on the same groups, and every prompt decodes on
    the same instance (the keeper of its batch's group)."""
    from jaxserve.sim.replay import Line, LiveRun, replay

    layout = ParallelConfig(prefill_instances=4, cluster_policy="esp")
    model = batch_model()
    cluster = build(
        llm.config,
        llm.builder.params,
        layout,
        engine_maker(llm),
        model,
        capacity=MAX_MODEL_LEN,
        min_local=64,
        devices=devices[:4],
        progress=False,
    )
    lengths = [700, 90, 400, 150, 2600, 40, 520, 1300]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    rids = [cluster.add_request(prompt(llm, n, 90 + k), params) for k, n in enumerate(lengths)]
    while cluster.has_unfinished():
        for out in cluster.step():
            assert out.error is None, out.error
    slot = {d: k for k, d in enumerate(cluster.pool_ids)}
    batches: dict[tuple, list[str]] = {}
    for r in cluster.records:
        batches.setdefault((r.start, tuple(slot[d] for d in r.group)), []).append(str(rids.index(r.request_id)))

    step = cluster.decoders[0].engine.scheduler.cost.to_dict()  # never measured here (priced at zero): the
    step["base"] = [[1e-3] * len(row) for row in step["base"]]  # simulated steps a millisecond a program
    step["decode_base"] = [1e-3] * len(step["decode_base"])
    first = cluster.arrivals[0][1]
    live_run = LiveRun(
        "esp",
        4,
        0,
        1,
        [(t - first, n, params.max_tokens) for _, t, n in cluster.arrivals],
        json.loads(model.to_json()),
        step,
        Line(0.0, 0.0),
        cluster.decoders[0].kv_tokens,
        cluster.decoders[0].engine.max_num_seqs,
        MAX_MODEL_LEN,
    )
    sim = replay(live_run)
    assert [(tuple(ids), group) for (_, group), ids in batches.items()] == [
        (ids, group) for ids, group, _, _ in sim.prefills
    ]
    assert {str(rids.index(t.request_id)): i for i, t in cluster.transfers} == sim.decoders
    assert len(batches) > 1 and max(len(group) for _, group in batches) > 1  # batches side by side, one scaled up
