"""LoongServe's ESP cluster in simulation: prefill batches on elastic groups, scale-down, multi-master scale-up,
whole-KV migration and preemption when memory runs out, decode-slot preemption by gain and cost, and KV moves and
the prefill ring charged from the network profile; every request finishes and every KV token is returned."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.lab.esp_cluster import ESPConfig, ESPSimulator, _Decoding, _Run
from jaxserve.sim.esp_cost import ESPCost
from jaxserve.sched.decode_dispatch import PromptInfo
from jaxserve.sched.profiles import GPUS, network
from jaxserve.sched.request import Request
from jaxserve.sim.workload import Workload, long_context

# Llama-2-7B at TP=2: each GPU holds 16 of the 32 KV heads, 128 dims, K and V in bf16
LAYER_BYTES = 2 * 16 * 128 * 2  # one token's KV on one GPU, one layer
SHARD_BYTES = 32 * LAYER_BYTES  # all 32 layers
NVLINK = network("h100")


def workload(prompts, outputs, gap=0.0, arrivals=None):
    n = len(prompts)
    return Workload(
        np.arange(n) * gap if arrivals is None else np.array(arrivals, float),
        np.array(prompts),
        np.array(outputs),
        "test",
    )


def check_complete(res, w):
    assert res.config["kv_held_at_end"] == 0
    assert len(res.requests) + len(res.rejected) == len(w)
    for r in res.requests:
        assert r.finished and r.generated == r.output_len
        assert r.first_token_at >= r.arrival
        assert len(r.token_gaps) == r.output_len - 1 and min(r.token_gaps, default=1) > 0


def test_a_lone_request_prefills_on_every_instance_then_decodes_on_one():
    sim = ESPSimulator(ESPConfig(instances=4))
    res = sim.run(workload([65536], [8]), progress=False)
    r = res.requests[0]
    # proactive scale-down: the instance it decodes on stores the 3/4 of its KV that the ring passed by
    store = 3 * 65536 // 4 * SHARD_BYTES / (GPUS["h100"].hbm_bandwidth * GPUS["h100"].mbu)
    assert r.first_token_at == pytest.approx(sim.cost.prefill([65536], 4) + store)
    assert store < 0.02 * sim.cost.prefill([65536], 4)  # LoongServe: scale-down adds < 2% to the forward pass
    check_complete(res, workload([65536], [8]))


def test_replicas_keep_each_request_on_one_instance():
    sim = ESPSimulator(ESPConfig(instances=4, max_sp=1, scale_up=False))
    res = sim.run(workload([65536, 65536], [4, 4]), progress=False)
    assert [r.first_token_at for r in res.requests] == pytest.approx([sim.cost.prefill([65536], 1)] * 2)


def test_the_fitted_model_tracks_the_executor():
    sim = ESPSimulator(ESPConfig(instances=4))
    for lengths in ([4096], [131072], [8192, 2048, 512]):
        for sp in (1, 2, 4):
            assert sim.scheduler.latency(lengths, sp) == pytest.approx(sim.cost.prefill(lengths, sp), rel=0.15)


TIGHT = dict(memory_utilization=0.15, output_estimate=64)  # ~20K KV tokens per instance; long decodes overflow


def test_multi_master_scale_up_grows_groups_instead_of_moving_kv():
    w = workload([16000, 14000, 12000, 10000], [6000] * 4, gap=0.5)
    res = ESPSimulator(ESPConfig(instances=4, **TIGHT)).run(w, progress=False)
    assert res.config["kv_capacity_per_instance"] < 25000
    assert res.config["scale_ups"] > 0 and res.config["migrations"] == 0
    check_complete(res, w)


def test_without_scale_up_a_full_request_moves_or_is_preempted_and_still_finishes():
    w = workload([16000, 14000, 12000, 10000], [6000] * 4, gap=0.5)
    res = ESPSimulator(ESPConfig(instances=4, scale_up=False, **TIGHT)).run(w, progress=False)
    assert res.config["scale_ups"] == 0
    assert res.config["migrations"] + res.config["preemptions"] > 0
    check_complete(res, w)


def test_requests_that_can_never_fit_are_rejected_not_stuck():
    w = workload([200000, 1000], [10, 10])
    res = ESPSimulator(ESPConfig(instances=2, **TIGHT)).run(w, progress=False)
    assert [r.prompt_len for r in res.rejected] == [200000]
    check_complete(res, w)


@pytest.mark.parametrize(
    "cfg",
    [
        ESPConfig(),
        ESPConfig(multi_master=False),
        ESPConfig(proactive=False),
        ESPConfig(max_sp=1, scale_up=False),
        ESPConfig(**TIGHT),
        ESPConfig(decode_preemption=False, **TIGHT),
    ],
)
def test_traces_complete_under_load_for_every_variant(cfg):
    w = long_context("short", 60, 0.5, output=(64, 2048))
    res = ESPSimulator(cfg).run(w, progress=False)
    check_complete(res, w)
    again = ESPSimulator(cfg).run(w, progress=False)
    assert res.summary() | {"all": {}} == again.summary() | {"all": {}}  # deterministic (wall time aside)
    assert res.summary()["all"]["ttft_p50"] == again.summary()["all"]["ttft_p50"]


def test_elastic_sp_beats_replicas_on_long_prompts_at_light_load():
    w = long_context("medium", 120, 0.25)
    esp = ESPSimulator(ESPConfig()).run(w, progress=False).summary()["all"]
    replicas = ESPSimulator(ESPConfig(max_sp=1, scale_up=False)).run(w, progress=False).summary()["all"]
    assert esp["ttft_p50"] < 0.5 * replicas["ttft_p50"]


def test_reactive_migration_moves_the_leaving_shares_over_nvlink_after_the_prefill():
    w = workload([65536], [4])
    sim = ESPSimulator(ESPConfig(instances=4, proactive=False))
    reactive = sim.run(w, progress=False).requests[0]
    proactive = ESPSimulator(ESPConfig(instances=4)).run(w, progress=False).requests[0]
    assert reactive.first_token_at == pytest.approx(sim.cost.prefill([65536], 4))
    # the instance it decodes on receives 3/4 of the prompt, each GPU its 16 heads, before the first step
    transfer = NVLINK.predict("intra_node", 3 * 65536 // 4 * SHARD_BYTES)
    assert reactive.token_gaps[0] - proactive.token_gaps[0] == pytest.approx(transfer)
    assert reactive.finished_at > proactive.finished_at


def test_the_ring_exposes_the_kv_passing_one_step_of_attention_does_not_hide():
    cost = ESPCost("h100_llama2_7b", 2)

    def attention(lengths: list[int], sp: int) -> float:
        return sum(cost.batch.prefill_attention(l, 0) for l in lengths) / sp

    # 8 x 2K prompts on 4 instances: each holds 4096 tokens, whose K/V (one layer) goes round the ring 3 times
    # per layer, hidden only up to a quarter of its attention
    short = [2048] * 8
    send = NVLINK.predict("intra_node", 4096 * LAYER_BYTES)
    exposed = 32 * 3 * (send - attention(short, 4) / 32 / 4)
    assert exposed > 0
    assert cost.prefill(short, 4) == pytest.approx(cost.batch.linear_ops(4096) + attention(short, 4) + exposed)
    assert cost.prefill(short, 1) == pytest.approx(cost.batch.linear_ops(16384) + attention(short, 1))
    # a 128K prompt's attention hides the ring completely
    assert cost.prefill([131072], 4) == pytest.approx(cost.batch.linear_ops(32768) + attention([131072], 4))
    # across nodes the same ring is slower
    assert cost.prefill(short, 4, "inter_node") > cost.prefill(short, 4)
    assert cost.link_of([0, 1, 2, 3]) == "intra_node" and cost.link_of([3, 4]) == "inter_node"  # 4 instances a node


def test_the_scheduler_prices_kv_moves_as_the_executor_charges_them():
    sim = ESPSimulator(ESPConfig())
    tokens = 100_000
    charged = sim.cost.migrate(tokens)
    assert charged == pytest.approx(NVLINK.predict("intra_node", tokens * SHARD_BYTES))  # TP shards in parallel
    priced = tokens * sim.scheduler.kv_bytes / sim.scheduler.bandwidth  # allocation's V(e) / bandwidth
    assert priced == pytest.approx(charged, rel=1e-3)  # the link's latency aside


def staged(cfg: ESPConfig) -> _Run:
    """A simulation run with nothing arriving, to stage decoding and waiting requests by hand."""
    return _Run(ESPSimulator(cfg), workload([], []), progress=False)


def decoding(run: _Run, rid: str, shards: dict[int, int]) -> None:
    r = Request(rid, 0.0, sum(shards.values()), 10_000)
    r.add_tokens(1, 0.0)
    run.decoding[rid] = _Decoding(r, dict(shards))
    for i, tokens in shards.items():
        run.instances[i].kv_used += tokens


def test_a_prefill_starts_once_the_decode_kv_on_its_instances_has_moved_away():
    run = staged(ESPConfig(instances=3, max_sp=2))
    decoding(run, "a", {0: 8000})
    decoding(run, "c", {1: 100_000})
    b = Request("b", 0.0, 60_000, 10)
    run.scheduler.arrive(b, PromptInfo(b.prompt_len))
    run.origin["b"] = b
    run._plan_prefills(0.0)
    (batch,) = run.prefilling
    end = batch.end
    assert batch.group == (0, 2)  # the empty instance and the emptiest busy one
    move = NVLINK.predict("intra_node", 8000 * SHARD_BYTES)
    assert run.decoding["a"].shards == {1: 8000} and run.decoding["a"].ready_at == pytest.approx(move)
    assert end == pytest.approx(move + run.cost.prefill([60_000], 2))
    assert 1 not in run._idle()  # receiving until the move is done
    assert run.decode_pauses == 0


# 2 instances of ~20K KV tokens; A (12K prompt, 4000 tokens out) decodes on one of them when B (22K) arrives at
# 1 s: B needs A's instance's free slots, so its prefill pauses A
PAUSE = dict(instances=2, memory_utilization=0.15)
A_THEN_B = workload([12000, 22000], [4000, 16], arrivals=[0.0, 1.0])


def test_a_prefill_pauses_a_young_decode_only_when_the_ablation_takes_its_slots_unweighed():
    sim = ESPSimulator(ESPConfig(output_estimate=64, **PAUSE))
    res = sim.run(A_THEN_B, progress=False)
    a, b = res.requests
    b_prefill = sim.cost.prefill([22000], 2)
    # the average output (64, the prior) is behind A: waiting saves no time, pausing costs the prefill per token
    assert b.first_token_at > a.finished_at
    assert res.config["decode_pauses"] == 0 and max(a.token_gaps) < b_prefill
    unweighed = ESPSimulator(ESPConfig(output_estimate=64, decode_preemption=False, **PAUSE)).run(
        A_THEN_B, progress=False
    )
    a, b = unweighed.requests
    assert b.first_token_at == pytest.approx(1.0 + b_prefill, rel=0.05)
    assert unweighed.config["decode_pauses"] == 1 and max(a.token_gaps) >= b_prefill
    check_complete(res, A_THEN_B)
    check_complete(unweighed, A_THEN_B)


def test_a_prefill_pauses_a_decode_once_waiting_for_it_costs_more():
    """With 2048 tokens expected per output, B's wait for A's end outweighs A's pause once A has produced enough
    tokens that the pause is small per token: B prefills while A still decodes, later than if A's slots were
    taken at once."""
    res = ESPSimulator(ESPConfig(output_estimate=2048, **PAUSE)).run(A_THEN_B, progress=False)
    a, b = res.requests
    at_once = (
        ESPSimulator(ESPConfig(output_estimate=2048, decode_preemption=False, **PAUSE))
        .run(A_THEN_B, progress=False)
        .requests[1]
    )
    assert at_once.first_token_at + 1.0 < b.first_token_at < a.finished_at
    assert res.config["decode_pauses"] == 1
    check_complete(res, A_THEN_B)


def test_a_preemption_with_nothing_else_in_flight_is_planned_again():
    """Under tight memory at load, the last decoding request can be preempted while no prefill, step or arrival
    is pending: its recompute must still be planned (this run used to stop with requests waiting)."""
    w = long_context("short", 80, 1.0, output=(64, 2048))
    for cfg in (ESPConfig(**TIGHT), ESPConfig(scale_up=False, **TIGHT)):
        res = ESPSimulator(cfg).run(w, progress=False)
        assert res.config["preemptions"] > 0
        check_complete(res, w)


def test_decode_lengths_are_predicted_as_live_from_the_finished_requests():
    """The running mean of finished lengths, from the configured prior (cluster/esp.py's predictor): every
    finished request teaches it once, a preempted one under its own id, and admission plans with it."""
    w = long_context("short", 40, 2.0, seed=3)
    run = _Run(ESPSimulator(ESPConfig(instances=4, output_estimate=100)), w, False)
    done = [r for r in run.requests if r.finished]
    predictor = run.scheduler.predictor
    assert predictor.count == len(done) == len(run.requests) and predictor.total == sum(r.generated for r in done)
    # admission's estimate is the predictor's upper end (64-token buckets), learned past the prior's (64, 128)
    assert run.esp.output_estimate % 64 == 0 and run.esp.output_estimate != 128
