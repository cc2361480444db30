"""The disaggregated cluster: CDSP prefill pool (or TetriInfer's prefill instances), KV transfer through scarce
receive backends, decode instances dispatched by freeness with virtual usage (or power of two), decoding on the
live decode instances' ReplicaScheduler (its admission policies: tests/sched/test_decode_admission.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.sched import cost_models as cm
from jaxserve.sched.cdsp import CDSPPlanner, Pool
from jaxserve.sched.profiles import tetris_table1_samples
from jaxserve.sched.flip import FlipPolicy, LoadWindow
from jaxserve.sim.disagg import ADMISSIONS, DisaggConfig, DisaggSimulator
from jaxserve.sim.workload import Workload, long_context


MODEL = cm.TetrisPrefill.fit(tetris_table1_samples())
POOL = Pool(nodes=2, per_node=8)


best = MODEL.fastest


def run(config=DisaggConfig(), n=120, rate=1.0):
    return DisaggSimulator(CDSPPlanner(MODEL, POOL, 0.2), best, config).run(
        long_context("medium", n, rate, seed=0), progress=False
    )


def test_every_request_prefills_transfers_and_decodes():
    res = run()
    assert len(res.requests) == 120 and not res.rejected
    for r in res.requests:
        assert r.finished and r.generated == r.output_len
        # the first decode token comes after the prefill's first token plus at least one KV transfer
        assert r.token_gaps[0] > 0
    s = res.summary()["all"]
    assert s["tbt_p50"] < 0.05  # TP-4 decode of an 8B model: milliseconds per token


def test_dispatch_spreads_requests_over_decode_instances():
    sim = DisaggSimulator(CDSPPlanner(MODEL, POOL, 0.2), best, DisaggConfig(decode_instances=4))
    res = sim.run(long_context("short", 200, 2.0, seed=1), progress=False)
    served = [d.finished for d in sim.decoders]
    assert sum(served) == sum(r.output_len > 1 for r in res.requests)
    assert min(served) > 0.15 * sum(served)  # freeness keeps every instance in use


def test_virtual_usage_spreads_a_burst_whose_kv_has_not_landed():
    # 8 equal requests at once: nothing has reached a decode instance when each is dispatched, so only the
    # virtual usage (the promised prompt KV) tells the instances apart; without it all 8 go to the first one
    burst = Workload(np.zeros(8), np.full(8, 4096), np.full(8, 64), "burst")
    sim = DisaggSimulator(CDSPPlanner(MODEL, POOL, 0.2), best, DisaggConfig(decode_instances=4))
    sim.run(burst, progress=False)
    assert [d.finished for d in sim.decoders] == [2, 2, 2, 2]


def test_scarce_receive_backends_delay_decoding_but_lose_nothing():
    plenty = run(DisaggConfig(recv_backends=8), n=80, rate=3.0)
    scarce = run(DisaggConfig(recv_backends=1), n=80, rate=3.0)
    assert all(r.finished for r in scarce.requests)
    first_gap = lambda res: sum(r.token_gaps[0] for r in res.requests)  # noqa: E731
    assert first_gap(scarce) > first_gap(plenty)


@pytest.mark.parametrize("admission", ADMISSIONS)
def test_the_cluster_runs_every_admission_policy_with_a_predictor(admission):
    from jaxserve.sched.decode_dispatch import BucketPredictor
    from jaxserve.sim.workload import load_trace, synthetic_mix

    w = load_trace("azure_conv")
    pred = BucketPredictor.fit(w.prompt_lens, w.output_lens)
    sim = DisaggSimulator(
        CDSPPlanner(MODEL, POOL, 0.2),
        best,
        DisaggConfig(decode_instances=2, admission=admission, dispatch="power_of_two"),
        pred,
    )
    res = sim.run(synthetic_mix(150, 3.0, long_fraction=0.0, seed=2), progress=False)
    assert all(r.finished for r in res.requests)
    if admission == "oracle":
        assert sum(d.preemptions for d in sim.decoders) == 0


@pytest.mark.parametrize("prefill", ["cdsp", "tetriinfer"])
def test_a_learning_predictor_sees_every_finished_decode_as_live(prefill):
    """As the live cluster does, the simulator tells the policy each request's end: the running mean learns the
    served lengths."""
    from jaxserve.sched.decode_dispatch import ObservedLengths
    from jaxserve.sim.workload import synthetic_mix

    pred = ObservedLengths()
    cfg = DisaggConfig(decode_instances=2, dispatch="power_of_two")
    if prefill == "tetriinfer":
        cfg = dataclasses.replace(cfg, prefill="tetriinfer", prefill_instances=2)
    sim = DisaggSimulator(CDSPPlanner(MODEL, POOL, 0.2) if prefill == "cdsp" else None, best, cfg, pred)
    res = sim.run(synthetic_mix(60, 3.0, long_fraction=0.0, seed=4), progress=False)
    finished = [r for r in res.requests if r.finished]
    assert pred.count == len(finished) > 0 and pred.total == sum(r.generated for r in finished)


def test_load_window_needs_a_whole_window_and_forgets_old_samples():
    w = LoadWindow(window=10.0)
    for t in range(0, 10):
        w.add(float(t), 1.0)
    assert w.mean(9.0) is None
    for t in range(10, 30):
        w.add(float(t), 0.0)
    assert w.mean(29.0) == 0.0


def test_instances_flip_toward_the_busy_role():
    """A prefill-heavy phase (64K prompts, 2 output tokens) leaves decode idle: a decode instance turns into 4
    prefill GPUs. A decode-heavy phase after it (short prompts, long outputs) fills decode: prefill GPUs flip
    back. Nothing is lost on the way."""
    import numpy as np

    from jaxserve.sim.workload import Workload

    a = np.arange(0, 40, 1.0)
    b = 60 + np.arange(0, 30, 1 / 20)
    w = Workload(
        np.concatenate([a, b]),
        np.array([65536] * len(a) + [100] * len(b)),
        np.array([2] * len(a) + [800] * len(b)),
        "phases",
    )
    cfg = DisaggConfig(
        prefill_instances=8,
        decode_instances=2,
        decode_tp=4,
        memory_utilization=0.09,
        flip=FlipPolicy(window=20.0, check_every=2.0),
    )
    sim = DisaggSimulator(CDSPPlanner(MODEL, Pool(2, 8), 0.2), best, cfg)
    res = sim.run(w, progress=False)
    flips = [kind for _, kind in res.config["flips"]]
    assert "to_prefill" in flips and "to_decode" in flips
    assert flips.index("to_prefill") < flips.index("to_decode")
    assert len(res.requests) == len(w) and all(r.finished for r in res.requests)
    with pytest.raises(ValueError, match="GPU slots"):
        DisaggSimulator(CDSPPlanner(MODEL, Pool(1, 8), 0.2), best, cfg).run(w, progress=False)


# -- TetriInfer's prefill instances (prefill="tetriinfer") -------------------------------------------------------
def tetriinfer(workload, predictor=None, **config):
    cfg = DisaggConfig(prefill="tetriinfer", decode_tp=1, **({"prefill_instances": 1, "decode_instances": 2} | config))
    sim = DisaggSimulator(None, best, cfg, predictor)
    return sim, sim.run(workload, progress=False)


def test_tetriinfer_prefill_pads_its_chunk_then_sends_the_whole_prompt():
    sim, res = tetriinfer(Workload(np.zeros(1), np.array([100]), np.array([5]), "lone"))
    (r,) = res.requests
    # a 100-token prompt runs as a whole 512-token chunk: padding costs as much as tokens in the linear ops
    padded = sim.prefill_cost.overhead + sim.prefill_cost.linear_ops(512) + sim.prefill_cost.prefill_attention(100, 0)
    assert r.first_token_at == pytest.approx(padded)
    assert r.first_token_at > 1.2 * sim.prefill_cost.batch_time([(100, 0)])
    # the prompt's KV lands (request-level transfer), then the first decode step runs over it
    assert r.token_gaps[0] == pytest.approx(sim.transfer_seconds(100, 1) + sim.cost.batch_time([], [100]))
    assert r.finished and r.generated == 5
    # resource usage (TetriInfer 5.1): each instance until its last work; the idle decode instance costs nothing
    assert res.config["gpu_seconds"] == pytest.approx(r.first_token_at + r.finished_at)


def test_tetriinfer_prefill_runs_sjf_within_a_scheduling_batch():
    burst = Workload(np.zeros(3), np.array([900, 100, 500]), np.array([2, 2, 2]), "burst")
    ttft = {}
    for order in ("fcfs", "sjf"):
        _, res = tetriinfer(burst, prefill_order=order)
        ttft[order] = [r.first_token_at for r in res.requests]
    assert ttft["sjf"][1] < ttft["sjf"][2] < ttft["sjf"][0]  # 100, 500, 900 tokens
    assert ttft["fcfs"][0] == ttft["fcfs"][1] < ttft["fcfs"][2]  # 900's tail and 100 merged into one chunk
    assert sum(ttft["sjf"]) < sum(ttft["fcfs"])


def test_tetriinfer_global_scheduler_sends_arrivals_to_the_least_loaded_prefill_instance():
    burst = Workload(np.zeros(2), np.array([4096, 4096]), np.array([2, 2]), "burst")
    _, res = tetriinfer(burst, prefill_instances=2)
    a, b = (r.first_token_at for r in res.requests)
    assert a == pytest.approx(b)  # each on its own instance, not one after the other


def test_a_whole_tetriinfer_cluster_serves_azure_conv():
    """Prefill instances, request-level KV transfer, power of two with the length predictor, reserve-dynamic."""
    from jaxserve.sched.decode_dispatch import BucketPredictor
    from jaxserve.sim.workload import load_trace

    trace = load_trace("azure_conv")
    pred = BucketPredictor.fit(trace.prompt_lens, trace.output_lens)
    sim, res = tetriinfer(
        load_trace("azure_conv", rate=6.0, limit=200),
        pred,
        prefill_instances=2,
        decode_instances=2,
        dispatch="power_of_two",
        admission="reserve_dynamic",
    )
    assert len(res.requests) == 200 and all(r.finished and r.generated == r.output_len for r in res.requests)
    served = [d.finished for d in sim.decoders]
    assert min(served) > 0.3 * sum(served)
    assert res.summary()["all"]["tbt_p50"] < 0.05


def test_tetriinfer_prefill_takes_no_planner_and_flips_on_its_own_gpus():

    with pytest.raises(ValueError, match="needs a planner"):
        DisaggSimulator(None, best, DisaggConfig())
    with pytest.raises(ValueError, match="take none"):
        DisaggSimulator(CDSPPlanner(MODEL, POOL, 0.2), best, DisaggConfig(prefill="tetriinfer"))
    with pytest.raises(ValueError, match="decode_tp"):
        DisaggSimulator(None, best, DisaggConfig(prefill="tetriinfer", flip=FlipPolicy()))


def test_tetriinfer_instances_flip_toward_the_busy_role():
    """TetriInfer's flips (its policy's, as live): two prefill and two decode instances of one GPU each. Long
    decodes of short prompts fill the decode side while the prefill side idles: a prefill instance drains and
    decodes; every request finishes."""
    import numpy as np

    from jaxserve.sched.decode_dispatch import ObservedLengths
    from jaxserve.sim.workload import Workload

    arrivals = np.arange(0, 60, 0.5)
    w = Workload(arrivals, np.full(len(arrivals), 100), np.full(len(arrivals), 2000), "decode heavy")
    cfg = DisaggConfig(
        prefill="tetriinfer",
        prefill_instances=2,
        decode_instances=2,
        decode_tp=1,
        dispatch="power_of_two",
        memory_utilization=0.225,
        flip=FlipPolicy(window=10.0, check_every=1.0),
    )
    res = DisaggSimulator(None, best, cfg, ObservedLengths()).run(w, progress=False)
    flips = [kind for _, kind in res.config["flips"]]
    assert flips[:1] == ["to_decode"] and len(set(res.decoders.values())) == 3  # a third instance decoded
    assert len(res.requests) + len(res.rejected) == len(w) and all(r.finished for r in res.requests)


def test_esp_instances_decode_as_served_on_their_keeper_or_spread_over_the_group():
    """prefill="esp" (cluster/esp.py as served): 4 elastic instances of 2,048 KV tokens. A 3,000-token prompt
    cannot stay on one instance: its KV stays on two, it decodes on the multi-master group (decode instance 4)
    over SpreadKV, its blocks in both instances' pools; a 500-token prompt stays on one instance, which decodes
    it. Without the group (spread off) the long prompt is refused."""
    from jaxserve.sched.cost_models import LoongServePrefill
    from jaxserve.sched.esp import ESPScheduler, aligned_groups
    from jaxserve.sched.profiles import ProfileBatchCost
    from jaxserve.sim.disagg import Costs

    model = LoongServePrefill({(sp, 1): np.array([0.01 * sp, 1e-4 / sp, 1e-9 / sp]) for sp in (1, 2, 4)})
    costs = Costs(
        decode=ProfileBatchCost("a100_llama3_8b", 1),
        prefill=None,
        transfer=lambda tokens, senders: 1e-3,
        decode_kv_capacity=2048,
        batch=lambda lengths, sp: model.predict(sp, 1, lengths),
    )
    w = Workload(np.array([0.0, 0.0]), np.array([3000, 500]), np.array([40, 40]), "two")

    def simulate(spread: bool):
        elastic = ESPScheduler(model, 1, model.predict(1, 1, [2048]), None, 0.0, groups=aligned_groups(4))
        cfg = DisaggConfig(prefill="esp", prefill_instances=4, decode_tp=1, admission="greedy", spread=spread)
        sim = DisaggSimulator(elastic, lambda n: model.predict(1, 1, [n]), cfg, costs=costs)
        return sim, sim.run(w, progress=False)

    sim, res = simulate(spread=True)
    assert all(r.finished and r.generated == 40 for r in res.requests) and not res.rejected
    assert res.decoders["0"] == 4 and res.decoders["1"] < 4
    group = sim.decoders[4]
    assert group.finished == 1 and sim.decoders[res.decoders["1"]].finished == 1
    assert not any(m.num_blocks_held("0") for m in group.scheduler.kv.instances)  # freed at the end
    assert min(len(g) for ids, g, _, _ in res.prefills if "0" in ids) >= 2  # a prefill over several instances
    (_, decoded) = simulate(spread=False)
    assert [r.id for r in decoded.rejected] == ["0"] and decoded.requests[0].finished
    with pytest.raises(ValueError, match="batch cost"):
        DisaggSimulator(ESPScheduler(model, 1, 1.0, None, 0.0), best, DisaggConfig(prefill="esp"))
