"""CSPS's cluster live (--cluster_policy=csps): each prompt goes whole to the fewest pool instances whose sequence
partitions hold it, on the aligned group that frees up first, and runs SP-NTP there (heads over the group by
all-to-all); its KV moves to a decode instance chosen on arrival. Against the single-device engine's greedy
tokens, and against the simulator's plans for the same arrivals."""

from __future__ import annotations

import json

import numpy as np

import jaxserve
from conftest import MAX_MODEL_LEN, engine_maker, prompt, run
from jaxserve.cluster.build import build
from jaxserve.cluster.engine import ClusterEngine
from jaxserve.config import ParallelConfig
from jaxserve.sampling_params import SamplingParams
from jaxserve.sched.cost_models import TetrisPrefill
from jaxserve.sched.csps import CSPSPlanner
from jaxserve.sim.replay import Line, LiveRun, replay

PARTITION = 1024
CHECKED = 24  # greedy tokens compared with the single-device engine's


def test_whole_prompts_on_the_fewest_instances_equal_one_device_and_replay_to_the_same_plans(llm, devices):
    """A burst of five prompts on a pool of 4 instances (nodes of 2) with partitions of 1,024 tokens and 2
    decode instances: the 3,000-token prompt takes all four instances, the 1,500- and 1,200-token ones two, the
    short ones one each, each prompt one chunk (no history, no rebalance) and one KV transfer; every prompt gets
    the single-device engine's greedy tokens. Replayed through sim/disagg.py with the same arrivals, planner and
    decode capacity, the simulator makes the same plans: the same group for every prompt and the same decode
    instance. max_tokens is the length predictor's prior, so the cap the simulator does not know changes no
    promise."""
    layout = ParallelConfig(prefill_instances=4, decode_instances=2, cluster_policy="csps", partition_tokens=PARTITION)
    eq1 = TetrisPrefill({s: np.array([0.01 * s, 4e-4 / s, 2e-7 / s, 1e-7 / s]) for s in (1, 2, 4)})
    cluster = build(
        llm.config,
        llm.builder.params,
        layout,
        engine_maker(llm),
        eq1,
        capacity=MAX_MODEL_LEN,
        min_local=128,
        devices=devices[:6],
        progress=False,
    )
    assert isinstance(cluster.planner, CSPSPlanner)
    assert type(cluster.prefill.backend(2)).__name__ == "StoreUlyssesBackend"
    lengths = [3000, 1500, 700, 300, 1200]
    ids = [prompt(llm, n, 60 + k) for k, n in enumerate(lengths)]
    params = SamplingParams(max_tokens=320)
    outputs = run(cluster, [(x, params) for x in ids])
    want = [c.token_ids for c in llm.generate(ids, SamplingParams(max_tokens=CHECKED))]
    assert [out[:CHECKED] for out in outputs] == want

    arrivals = list(cluster.arrivals)
    rids = [rid for rid, _, _ in arrivals]
    slot = cluster.pool_ids.index
    groups = {r.request_id: tuple(sorted(map(slot, r.group))) for r in cluster.records}
    assert len(cluster.records) == len(rids) and cluster.events["rebalances"] == 0
    assert [len(groups[rid]) for rid in rids] == [4, 2, 1, 1, 2]
    assert sorted(t.request_id for _, t in cluster.transfers) == sorted(rids)

    first = arrivals[0][1]
    decoder = cluster.decoders[0]
    step = decoder.engine.scheduler.cost.to_dict()  # priced a millisecond a program: every plan is made at arrival
    step["base"] = [[1e-3] * len(row) for row in step["base"]]
    step["decode_base"] = [1e-3] * len(step["decode_base"])
    live_run = LiveRun(
        "csps",
        4,
        2,
        cluster.planner.pool.per_node,
        [(t - first, n, len(out)) for (_, t, n), out in zip(arrivals, outputs)],
        json.loads(eq1.to_json()),
        step,
        Line(0.0, 0.0),
        decoder.kv_tokens,
        decoder.engine.max_num_seqs,
        MAX_MODEL_LEN,
        dict(partition_tokens=PARTITION, sizes=list(cluster.planner.sizes)),
    )
    sim = replay(LiveRun.from_dict(json.loads(json.dumps(live_run.to_dict()))))
    assert {ids: tuple(sorted(g)) for ids, g, _, _ in sim.prefills} == {
        (str(k),): groups[rid] for k, rid in enumerate(rids)
    }
    for k, rid in enumerate(rids):
        (live_decoder,) = {d for d, t in cluster.transfers if t.request_id == rid}
        assert live_decoder == sim.decoders[str(k)], k


def test_llm_serves_through_csps_by_its_flag(model, llm, tmp_path):
    """LLM(cluster_policy="csps", ...) (what --cluster_policy builds): with no Eq. (1) on disk it starts on the
    prior, its pool's own to be measured on groups of 1, 2 and 4 instances while idle (test_live_cluster.py
    follows a pool through that), and generation through the cluster gives the single-device engine's greedy
    tokens, on the prior's plans and, once the cluster has measured its own while idle, on the measured one's."""
    path = tmp_path / "eq1.json"
    clustered = jaxserve.LLM(
        model,
        max_model_len=1024,
        kv_cache_tokens=1024,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        prefill_instances=4,
        decode_instances=1,
        cluster_policy="csps",
        partition_tokens=256,
        prefill_profile=str(path),
        progress=False,
    )
    cluster = clustered.engine
    assert isinstance(cluster, ClusterEngine) and isinstance(cluster.planner, CSPSPlanner)
    assert cluster.planner.model.model.to_json() == TetrisPrefill.prior([1, 2, 4]).to_json() and cluster.has_deferred
    ids = [prompt(llm, 700, 3), prompt(llm, 90, 4)]
    params = SamplingParams(max_tokens=12)
    want = [c.token_ids for c in llm.generate(ids, params)]
    assert [c.token_ids for c in clustered.generate(ids, params)] == want
    assert sorted(len(r.group) for r in cluster.records) == [1, 4]
    cluster.run_deferred(stop=lambda: False)
    measured = TetrisPrefill.from_json(path.read_text())
    assert not cluster.has_deferred and cluster.planner.model.model.to_json() == measured.to_json()
    assert [c.token_ids for c in clustered.generate(ids, params)] == want
