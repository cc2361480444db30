"""TetriInfer's cluster live (--cluster_policy=tetriinfer): prefill instances of fixed-size chunks with SJF
scheduling batches, whole-KV transfer to a decode instance chosen by power of two, against the single-device
engine's greedy tokens."""

from __future__ import annotations

import json

import numpy as np

import jaxserve
from conftest import MAX_MODEL_LEN, engine_maker, prompt, run, serve
from jaxserve.cluster.build import build, warmup
from jaxserve.cluster.length_predictor import KeptClassifier
from jaxserve.cluster.tetriinfer import TetriInferCluster
from jaxserve.config import ParallelConfig
from jaxserve.engine.interface import ServingEngine
from jaxserve.sampling_params import SamplingParams
from jaxserve.sched.cost_models import TetrisPrefill

GREEDY = SamplingParams(max_tokens=12)


def test_prefill_instances_with_sjf_batches_and_whole_kv_transfer_equal_one_device(llm, devices):
    """Six prompts at once on 2 prefill instances (chunks of 512 tokens) and 2 decode instances: the 1,300-token
    prompt fills instance 0 (3 chunks), the five short ones queue on instance 1, which runs them shortest first
    within its scheduling batch, merging several into one chunk; each prompt's KV moves in one transfer once its
    prompt is done; every prompt gets the single-device engine's greedy tokens."""
    layout = ParallelConfig(
        prefill_instances=2,
        decode_instances=2,
        cluster_policy="tetriinfer",
        prefill_chunk=512,
        prefill_batch=8,
        prefill_order="sjf",
    )
    cluster = build(
        llm.config,
        llm.builder.params,
        layout,
        engine_maker(llm),
        None,
        capacity=MAX_MODEL_LEN,
        min_local=64,
        devices=devices[:4],
        progress=False,
    )
    assert isinstance(cluster, TetriInferCluster) and isinstance(cluster, ServingEngine)
    lengths = [1300, 300, 40, 700, 120, 90]
    ids = [prompt(llm, n, 20 + k) for k, n in enumerate(lengths)]
    want = [c.token_ids for c in llm.generate(ids, GREEDY)]
    assert run(cluster, [(x, GREEDY) for x in ids]) == want

    rids = list(dict.fromkeys(r.request_id for r in cluster.records))  # in order of their first piece
    by_rid = {rid: [r for r in cluster.records if r.request_id == rid] for rid in rids}
    long_rid = next(rid for rid, rs in by_rid.items() if sum(r.tokens for r in rs) == 1300)
    assert [r.tokens for r in by_rid[long_rid]] == [512, 512, 276] and {r.group for r in by_rid[long_rid]} == {(0,)}
    short = [rid for rid in rids if rid != long_rid]
    assert [sum(r.tokens for r in by_rid[rid]) for rid in short] == sorted(lengths[1:])  # shortest first
    assert all(r.group == (1,) for rid in short for r in by_rid[rid])
    merged = {r.start for rid in short for r in by_rid[rid]}
    assert len(merged) < len(short)  # short prompts shared chunks
    assert sorted(t.request_id for _, t in cluster.transfers) == sorted(rids)  # one whole-KV transfer each
    assert all(t.chunk == 0 and t.last for _, t in cluster.transfers)
    assert cluster.events["chunks"] == len(cluster.records) and cluster.events["transfers"] == len(rids)
    assert not cluster.has_unfinished() and cluster.num_running == 0


def test_llm_serves_through_tetriinfer_by_its_flag(model, llm):
    """LLM(cluster_policy="tetriinfer", ...) (what --cluster_policy builds) generates the single-device text, and
    serves it (the openai client over HTTP) with its events in /metrics. The
    1,000-token prompt follows a short one on the same instance: its pieces (206, 256, 256, 256, 26 tokens) take
    more rows of the history store than max_model_len, padded to power-of-two buckets. The prefill instances
    are one device each, the decode instance three tensor-parallel devices (--decode_tp, Tetris's TP 1 prefill
    and TP 8 decode): each whole-KV transfer lands split over its heads."""
    clustered = jaxserve.LLM(
        model,
        max_model_len=1024,
        kv_cache_tokens=2048,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        prefill_instances=2,
        decode_instances=1,
        decode_tp=3,
        cluster_policy="tetriinfer",
        prefill_chunk=256,
        length_predictor="prompt",
        progress=False,
    )
    assert isinstance(clustered.engine, TetriInferCluster)
    decode = clustered.engine.decoders[0].engine.runner
    assert decode.tp == 3 and len(decode.devices) == 3
    assert [len(i) for i in clustered.engine.prefill.instances.values()] == [1, 1]
    ids = [prompt(llm, 600, 31), prompt(llm, 50, 32), prompt(llm, 1000, 33)]
    want = llm.generate(ids, GREEDY)
    assert [c.token_ids for c in clustered.generate(ids, GREEDY)] == [c.token_ids for c in want]
    pieces = [r.tokens for r in clustered.engine.records if r.group == (1,)]
    assert pieces == [50, 206, 256, 256, 256, 26]
    texts, events = serve(clustered, ids, GREEDY.max_tokens)  # `serve` over the same cluster
    assert texts == [c.text for c in want]
    assert events == {k: float(v) for k, v in clustered.engine.events.items()} and events["transfers"] == 6, events
    # the prompt classifier read each prompt's features and learned from each decode (kept in the test's cache)
    kept = clustered.engine.scheduler.predictor
    assert kept.classifier.seen == 6 and kept.classifier.dim == llm.config.hidden_size
    kept.save()
    assert KeptClassifier(kept.path, kept.classifier.dim).classifier.seen == 6


def step_until(cluster, tokens: dict[str, list[int]], done) -> None:
    """Step, collecting each request's tokens, until done() or nothing is left."""
    while cluster.has_unfinished() and not done():
        for out in cluster.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids


def test_instances_flip_to_decode_and_back_to_prefill_as_the_load_shifts(llm, devices):
    """2 prefill + 2 decode instances, flips on a 0.2 s window. Eight long decodes fill the decode side while the
    prefill side idles: a prefill instance drains and turns decode instance. Then eight long prompts queue on the
    one prefill instance left while the decode side idles: a decode instance turns prefill instance, and the next
    prompt prefills there (the emptiest queue). Every prompt gets the single-device engine's greedy tokens."""
    layout = ParallelConfig(
        prefill_instances=2, decode_instances=2, cluster_policy="tetriinfer", prefill_chunk=256, flip_window=0.2
    )
    cluster = build(
        llm.config,
        llm.builder.params,
        layout,
        engine_maker(llm),
        None,
        capacity=MAX_MODEL_LEN,
        min_local=64,
        devices=devices[:4],
        progress=False,
    )
    warmup(cluster, 1024, progress=False)
    assert cluster.scheduler.prefilling == {0, 1} and cluster.scheduler.decoding == {2, 3}
    decode_heavy = SamplingParams(max_tokens=120)
    first = [prompt(llm, 40 + 20 * k, 80 + k) for k in range(8)]
    tokens: dict[str, list[int]] = {}
    rids = [cluster.add_request(x, decode_heavy) for x in first]
    tokens |= {r: [] for r in rids}
    step_until(cluster, tokens, lambda: cluster.events["flips_to_decode"] == 1)
    assert len(cluster.scheduler.prefilling) == 1 and len(cluster.scheduler.decoding) == 3
    step_until(cluster, tokens, lambda: False)

    one_token = SamplingParams(max_tokens=1)  # finished by its first token: the decode side stays idle
    second = [prompt(llm, 1000, 90 + k) for k in range(8)]
    later = [cluster.add_request(x, one_token) for x in second]
    tokens |= {r: [] for r in later}
    (old,) = cluster.scheduler.prefilling
    step_until(cluster, tokens, lambda: cluster.events["flips_to_prefill"] == 1)
    assert cluster.scheduler.instances[old].queued_tokens() > 0  # still busy with the long prompts
    (new,) = cluster.scheduler.prefilling - {old}
    third = prompt(llm, 100, 99)
    last = cluster.add_request(third, GREEDY)
    tokens[last] = []
    step_until(cluster, tokens, lambda: False)
    assert [r.group for r in cluster.records if r.request_id == last] == [(cluster.pool_ids[new],)]

    want = (
        [c.token_ids for c in llm.generate(first, decode_heavy)]
        + [c.token_ids for c in llm.generate(second, one_token)]
        + [llm.generate([third], GREEDY)[0].token_ids]
    )
    assert [tokens[r] for r in rids + later + [last]] == want
    assert not cluster.has_unfinished()


def test_the_simulator_makes_the_live_clusters_tetriinfer_plans(llm, devices):
    """Live against simulated under TetriInfer: a burst of seven prompts on one prefill instance (chunks of 256,
    SJF) and two decode instances, replayed through sim/disagg.py with the live run's chunk and decode step times,
    gets the same chunks (each chunk's pieces, in order) and the same decode instance for every prompt (power of
    two, one seed on both sides). The prompts decode on past the last dispatch (ignore_eos), so the predictor's
    prior is every promise on both sides; then they are aborted."""
    from jaxserve.sim.replay import Line, LiveRun, replay

    layout = ParallelConfig(
        prefill_instances=1,
        decode_instances=2,
        cluster_policy="tetriinfer",
        prefill_chunk=256,
        prefill_batch=8,
        prefill_order="sjf",
    )
    cluster = build(
        llm.config,
        llm.builder.params,
        layout,
        engine_maker(llm),
        None,
        capacity=MAX_MODEL_LEN,
        min_local=64,
        devices=devices[:3],
        progress=False,
    )
    warmup(cluster, 1024, progress=False)
    lengths = [700, 90, 400, 150, 260, 40, 520]
    params = SamplingParams(max_tokens=2000, ignore_eos=True)
    rids = [cluster.add_request(prompt(llm, n, 60 + k), params) for k, n in enumerate(lengths)]
    while len(cluster.transfers) < len(rids):  # every prompt prefilled and its KV landed
        for out in cluster.step():
            assert out.error is None and not out.finished, out
    for rid in rids:
        cluster.abort(rid)
    assert not cluster.has_unfinished()

    chunks: dict[float, list[str]] = {}
    for r in cluster.records:
        chunks.setdefault(r.start, []).append(str(rids.index(r.request_id)))
    seconds = np.mean([r.end - r.start for r in {r.start: r for r in cluster.records}.values()])
    step = cluster.decoders[0].engine.scheduler.cost.to_dict()
    step["base"] = [[cluster.decode_seconds] * len(row) for row in step["base"]]
    step["decode_base"] = [cluster.decode_seconds] * len(step["decode_base"])
    first = cluster.arrivals[0][1]
    live_run = LiveRun(
        "tetriinfer",
        1,
        2,
        1,
        [(t - first, n, params.max_tokens) for _, t, n in cluster.arrivals],
        json.loads(TetrisPrefill({1: np.array([0.0, seconds / 256, 0.0, 0.0])}).to_json()),
        step,
        Line(0.0, 0.0),
        cluster.decoders[0].kv_tokens,
        cluster.decoders[0].engine.max_num_seqs,
        MAX_MODEL_LEN,
        prefill_chunk=256,
        prefill_batch=8,
        prefill_order="sjf",
    )
    sim = replay(live_run)
    assert [tuple(ids) for ids in chunks.values()] == [ids for ids, _, _, _ in sim.prefills]
    assert {str(rids.index(t.request_id)): i for i, t in cluster.transfers} == sim.decoders
    assert len(set(sim.decoders.values())) == 2 and max(len(ids) for ids, _, _, _ in sim.prefills) > 1
