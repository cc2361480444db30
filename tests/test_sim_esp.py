"""LoongServe's ESP cluster in simulation: prefill batches on elastic groups, scale-down, multi-master scale-up,
whole-KV migration and preemption when memory runs out; every request finishes and every KV token is returned."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.sim.esp_cluster import ESPConfig, ESPSimulator
from jaxserve.sim.workload import Workload, long_context


def workload(prompts, outputs, gap=0.0):
    n = len(prompts)
    return Workload(np.arange(n) * gap, np.array(prompts), np.array(outputs), "test")


def check_complete(res, w):
    assert res.config["kv_held_at_end"] == 0
    assert len(res.requests) + len(res.rejected) == len(w)
    for r in res.requests:
        assert r.finished and r.generated == r.output_len
        assert r.first_token_at >= r.arrival
        assert len(r.token_gaps) == r.output_len - 1 and min(r.token_gaps, default=1) > 0


def test_a_lone_request_prefills_on_every_instance_then_decodes():
    sim = ESPSimulator(ESPConfig(instances=4))
    res = sim.run(workload([65536], [8]), progress=False)
    r = res.requests[0]
    assert r.first_token_at == pytest.approx(sim.cost.prefill([65536], 4))
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


@pytest.mark.parametrize("cfg", [ESPConfig(), ESPConfig(multi_master=False), ESPConfig(proactive=False),
                                 ESPConfig(max_sp=1, scale_up=False), ESPConfig(**TIGHT)])
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


def test_reactive_migration_delays_decoding_after_scale_down():
    w = workload([65536, 65536], [4, 4])
    proactive = ESPSimulator(ESPConfig(instances=4)).run(w, progress=False)
    reactive = ESPSimulator(ESPConfig(instances=4, proactive=False)).run(w, progress=False)
    assert [r.first_token_at for r in proactive.requests] == [r.first_token_at for r in reactive.requests]
    assert max(r.finished_at for r in reactive.requests) > max(r.finished_at for r in proactive.requests)


def test_a_preemption_with_nothing_else_in_flight_is_planned_again():
    """Under tight memory at load, the last decoding request can be preempted while no prefill, step or arrival
    is pending: its recompute must still be planned (this run used to stop with requests waiting)."""
    w = long_context("short", 80, 1.0, output=(64, 2048))
    for cfg in (ESPConfig(**TIGHT), ESPConfig(scale_up=False, **TIGHT)):
        res = ESPSimulator(cfg).run(w, progress=False)
        assert res.config["preemptions"] > 0
        check_complete(res, w)
