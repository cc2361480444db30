"""LoongServe's elastic SP live (--cluster_policy=esp): every instance prefills and decodes; prompts are batched
onto elastic groups (ring attention over several instances), then each decodes on one instance of its group,
against the single-device engine's greedy tokens."""

from __future__ import annotations

import numpy as np

import jaxserve
from conftest import MAX_MODEL_LEN, engine_maker, prompt, run, serve
from jaxserve.cluster.build import build
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
    """Five prompts at once on 4 elastic instances (programs compiled when first used): the DP batches them onto aligned groups, the 3,000-token one
    over several instances (a scale-up); each decodes on one instance of its group (a scale-down: the other
    instances' KV moves to it). A second wave arrives while the first decodes: the instances it prefills on pause
    their decodes. Every prompt gets the single-device engine's greedy tokens."""
    layout = ParallelConfig(prefill_instances=4, cluster_policy="esp")
    cluster = build(llm.config, llm._params, layout, engine_maker(llm), batch_model(),
                    capacity=MAX_MODEL_LEN, min_local=64, devices=devices[:4], progress=False)
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


def test_llm_serves_through_esp_by_its_flag(model, llm):
    """LLM(cluster_policy="esp", ...) (what --cluster_policy builds) measures LoongServe's batch model on its
    instances, generates the single-device text, and serves it (the openai client over HTTP) with its events in
    /metrics."""
    clustered = jaxserve.LLM(model, max_model_len=1024, kv_cache_tokens=2048, max_num_seqs=4,
                             max_num_batched_tokens=256, prefill_instances=2, cluster_policy="esp", progress=False)
    assert isinstance(clustered.engine, ESPCluster)
    assert set(clustered.engine.scheduler.elastic._sp) == {1, 2}  # fitted per SP size
    ids = [prompt(llm, 900, 31), prompt(llm, 50, 32), prompt(llm, 400, 33)]
    want = llm.generate(ids, GREEDY)
    assert [c.token_ids for c in clustered.generate(ids, GREEDY)] == [c.token_ids for c in want]
    texts, events = serve(clustered, ids, GREEDY.max_tokens)  # `serve` over the same cluster
    assert texts == [c.text for c in want]
    assert events == {k: float(v) for k, v in clustered.engine.events.items()} and events["chunks"] == 6, events
