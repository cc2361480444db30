"""A live run replayed in the simulator with its measured costs: a lone request's TTFT is its prefill's measured
cost (plus the KV transfer where one comes before the first token) and its TPOT the measured decode step, under
each policy; a busy trace replays with every request finished; the run survives JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.sched.batch_cost import EngineStepCost, TetrisBatchCost
from jaxserve.sched.cost_models import LoongServePrefill, TetrisPrefill
from jaxserve.sched.prefill_batches import chunk_time
from jaxserve.sched.plan import Phase, WorkItem
from jaxserve.sched.step_shapes import StepShapes
from jaxserve.sim.replay import Line, LiveRun, replay

STEP = EngineStepCost(
    StepShapes((16, 512), (4,), 32, 4, (1, 2, 4)),
    256,
    [[0.05], [0.4]],
    [0.02, 0.025, 0.03],
    tile_fixed=1e-3,
    tile_block=5e-3,
    decode_fixed=1e-4,
    decode_block=2e-3,
    decode_pad_block=1e-3,
)
EQ1 = {sp: np.array([0.1 * sp, 1e-3 / sp, 2e-7 / sp, 1e-7 / sp]) for sp in (1, 2, 4)}
TRANSFER = Line(0.01, 1e-5)


def live(policy: str, trace, **fields) -> LiveRun:
    if policy == "esp":  # SP 1 is the fastest for any lone prompt here: its fixed cost grows with the group
        model = LoongServePrefill({(sp, 1): np.array([0.5 * sp, 1e-3 / sp, 1e-8]) for sp in (1, 2, 4)})
    else:
        model = TetrisPrefill({"tetriinfer": {1: EQ1[1]}, "csps": EQ1}.get(policy, {2: EQ1[2], 4: EQ1[4]}))
    if policy == "csps":
        fields = dict(planner=dict(partition_tokens=512, sizes=[1, 2, 4])) | fields
    base = dict(
        policy=policy,
        prefill_instances=4,
        decode_instances=0 if policy == "esp" else 2,
        node_size=2,
        trace=trace,
        prefill_model=json.loads(model.to_json()),
        step_cost=STEP.to_dict(),
        transfer=TRANSFER,
        kv_tokens=8192,
        max_num_seqs=4,
        max_model_len=4096,
        planner=dict(improvement_rate=0.1, sizes=[2, 4], min_chunk=256),
        prefill_chunk=256,
    )
    return LiveRun(**(base | fields))


def decode_steps(context: int, output: int) -> list[float]:
    return [STEP.batch_time([], [context + k]) for k in range(output - 1)]


@pytest.mark.parametrize("policy", ["tetriinfer", "esp"])
def test_a_lone_request_costs_what_the_live_run_measured(policy):
    prompt, output = 600, 5
    row = replay(live(policy, [(0.0, prompt, output)])).table()[0]
    if policy == "esp":  # one instance prefills it; its KV moves from the instance's store to its decode engine
        ttft = LoongServePrefill.from_json(json.dumps(live(policy, []).prefill_model)).predict(1, 1, [prompt])
        moved, context = TRANSFER(prompt), prompt
    else:  # fixed chunks of 256 tokens, the last one padded; the whole KV moves after the first token
        cost = TetrisBatchCost(TetrisPrefill({1: EQ1[1]}), 1)
        ttft = sum(
            chunk_time(
                cost, [WorkItem(request_id="0", start=h, end=h + n, phase=Phase.PREFILL, group=(0,), history=h)], 256
            )
            for n, h in ((256, 0), (256, 256), (88, 512))
        )
        moved, context = TRANSFER(prompt), prompt
    assert row["ttft"] == pytest.approx(ttft, rel=1e-9)
    assert row["tpot"] == pytest.approx((moved + sum(decode_steps(context, output))) / (output - 1), rel=1e-9)


def test_a_lone_request_under_cdsp_takes_its_planned_chunks_and_the_measured_steps():
    prompt, output = 600, 5
    row = replay(live("cdsp", [(0.0, prompt, output)])).table()[0]
    eq1 = TetrisPrefill({2: EQ1[2], 4: EQ1[4]})
    assert eq1.fastest(prompt) * (1 - 1e-9) <= row["ttft"] <= eq1.predict(2, prompt) * (1 + 1e-9)
    assert row["tpot"] >= sum(decode_steps(prompt, output)) / (output - 1)


def test_a_lone_request_under_csps_takes_the_fewest_instances_its_partitions_fill():
    """600 tokens in partitions of at most 512: two instances, one chunk, Eq. (1) at SP 2 with no history."""
    prompt, output = 600, 5
    res = replay(live("csps", [(0.0, prompt, output)]))
    (row,), ((_, group, _, _),) = res.table(), res.prefills
    assert len(group) == 2
    assert row["ttft"] == pytest.approx(TetrisPrefill(EQ1).predict(2, prompt), rel=1e-9)


@pytest.mark.parametrize("policy", ["cdsp", "csps", "tetriinfer", "esp"])
def test_a_busy_trace_replays_to_the_end_and_survives_json(policy):
    rng = np.random.default_rng(0)
    trace = [
        (float(t), int(p), int(o))
        for t, p, o in zip(
            np.cumsum(rng.exponential(0.5, 24)) - 0.5, rng.integers(64, 3000, 24), rng.integers(2, 20, 24)
        )
    ]
    text = json.dumps(live(policy, trace).to_dict())
    run = LiveRun.from_dict(json.loads(text))
    assert json.dumps(run.to_dict()) == text and run.transfer == TRANSFER and run.trace == trace
    res = replay(run)
    assert len(res.requests) == 24 and not res.rejected
    assert all(r.finished for r in res.requests)
    assert res.prefills and {rid for ids, *_ in res.prefills for rid in ids} == {str(k) for k in range(24)}


def test_a_cdsp_replay_prices_the_live_pools_measured_moves():
    """The live pool's measured cache balancing travels with the run: priced free, a busy trace's prompts grow
    onto larger groups chunk by chunk; priced at a second a row, no chain pays for its move."""
    rng = np.random.default_rng(0)
    trace = [(float(t), int(p), 2) for t, p in zip(np.cumsum(rng.exponential(0.3, 24)), rng.integers(64, 3000, 24))]
    model = TetrisPrefill({s: np.array([0.01, 1e-3 / s, 2e-7 / s, 1e-7 / s]) for s in (2, 4)})  # a small fixed cost
    chunks = {}
    for per_token in (0.0, 1.0):
        planner = dict(
            improvement_rate=0.1, sizes=[2, 4], min_chunk=64, balancing=dict(fixed=0.0, per_token=per_token, per_node=2)
        )
        run = live("cdsp", trace, planner=planner, prefill_model=json.loads(model.to_json()))
        res = replay(LiveRun.from_dict(json.loads(json.dumps(run.to_dict()))))
        chunks[per_token] = max(sum(rid in ids for ids, *_ in res.prefills) for rid in map(str, range(24)))
    assert chunks == {0.0: chunks[0.0], 1.0: 1} and chunks[0.0] > 1


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy must be one of"):
        live("vllm", [])
