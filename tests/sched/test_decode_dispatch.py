"""Decode-instance choice (freeness, TetriInfer's power of two) and the bucketed decode-length predictor."""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxserve.sched.decode_dispatch import BucketPredictor, DecodeLoad, PromptInfo, accuracy, by_freeness, power_of_two
from jaxserve.sim.workload import load_trace


def test_bucket_predictor_learns_trace_statistics():
    w = load_trace("azure_conv")
    half = len(w) // 2
    pred = BucketPredictor.fit(w.prompt_lens[:half], w.output_lens[:half], granularity=200)
    held_out = [PromptInfo(int(n)) for n in w.prompt_lens[half:]]
    acc = accuracy(pred, held_out, w.output_lens[half:])
    # always predicting the single most common bucket is the floor a fitted predictor must not fall below
    common = np.bincount(w.output_lens[:half] // 200).argmax()
    floor = np.mean(w.output_lens[half:] // 200 == common)
    assert acc >= floor and acc > 0.7
    lo, hi = pred.predict(PromptInfo(5000))
    assert hi - lo == 200 and lo % 200 == 0
    coarse = BucketPredictor.fit(w.prompt_lens[:half], w.output_lens[:half], granularity=400)
    assert accuracy(coarse, held_out, w.output_lens[half:]) >= acc  # wider buckets, easier hits


def test_bucket_predictor_rejects_bad_input():
    with pytest.raises(ValueError, match="granularity"):
        BucketPredictor.fit([1], [1], granularity=0)
    with pytest.raises(ValueError, match="as many"):
        BucketPredictor.fit([1, 2], [1])


def test_freeness_counts_slots_per_running_request():
    loads = [DecodeLoad(1000, 10), DecodeLoad(600, 2), DecodeLoad(5000, 100)]
    assert by_freeness(loads) == 1  # 300 per request beats 100 and 50


def test_power_of_two_only_picks_instances_with_room_and_spreads_heavy_decodes():
    rng = random.Random(0)
    loads = [DecodeLoad(100, 1), DecodeLoad(10_000, 4, heavy=3, light=1), DecodeLoad(10_000, 4, heavy=0, light=4)]
    for _ in range(20):
        pick = power_of_two(loads, need=2000, heavy=True, rng=rng)
        assert pick == 2  # instance 0 has no room; of the two left, the one with fewer heavy decodes
    assert power_of_two([DecodeLoad(10, 1), DecodeLoad(50, 1)], need=2000, heavy=False, rng=rng) == 1  # fallback


def test_power_of_two_sends_heavy_decodes_by_heavy_count_and_light_ones_by_total():
    # A holds fewer requests, B fewer heavy decodes: only the heavy rule tells them apart the other way
    rng = random.Random(1)
    loads = [DecodeLoad(10_000, 2, heavy=2, light=0), DecodeLoad(10_000, 5, heavy=0, light=5)]
    assert {power_of_two(loads, need=100, heavy=True, rng=rng) for _ in range(10)} == {1}
    assert {power_of_two(loads, need=100, heavy=False, rng=rng) for _ in range(10)} == {0}


def test_power_of_two_dispatch_in_the_disaggregated_cluster_balances_heavy_decodes():
    from jaxserve.sched import cost_models as cm
    from jaxserve.sched.cdsp import CDSPPlanner, Pool
    from jaxserve.sched.profiles import tetris_table1_samples
    from jaxserve.sim.disagg import DisaggConfig, DisaggSimulator
    from jaxserve.sim.workload import synthetic_mix

    model = cm.TetrisPrefill.fit(tetris_table1_samples())
    w = load_trace("azure_conv")
    pred = BucketPredictor.fit(w.prompt_lens, w.output_lens)
    sim = DisaggSimulator(
        CDSPPlanner(model, Pool(2, 8)),
        lambda n: model.predict(16, n),
        DisaggConfig(decode_instances=4, dispatch="power_of_two"),
        predictor=pred,
    )
    res = sim.run(synthetic_mix(300, 4.0, long_fraction=0.0, seed=0), progress=False)
    assert all(r.finished for r in res.requests)
    served = [d.finished for d in sim.decoders]
    assert min(served) > 0.1 * sum(served)
    with pytest.raises(ValueError, match="needs a decode-length predictor"):
        DisaggSimulator(CDSPPlanner(model, Pool(2, 8)), lambda n: 1.0, DisaggConfig(dispatch="power_of_two"))
