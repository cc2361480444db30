"""The step cost model measured on the engine itself (engine/profile.py): what the session's LLM measured at start,
and the on-disk cache it is loaded from."""

from __future__ import annotations

import json

from jaxserve.engine import profile
from jaxserve.sched.batch_cost import BucketedBatchCost


def test_the_measured_profile_prices_steps_and_round_trips(llm, tmp_path):
    cost = llm.cost
    buckets = llm.engine.runner.buckets
    assert cost.token_buckets == list(buckets.tokens) and all(t > 0 for t in cost.step_times)
    assert cost.prefill_pair >= 0 and cost.decode_key >= 0
    # a batch is priced by the program that runs it: the smallest token bucket that holds it
    assert cost.time(buckets.tokens[0] + 1, 0.0) == cost.step_times[1]
    assert cost.time(40, cost.prefill_attention(40, 1000)) > cost.time(40, 0.0) or cost.prefill_pair == 0
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(cost.to_dict()))
    loaded = profile.load_or_measure(path, llm.engine.runner, llm.max_model_len, progress=False)
    assert isinstance(loaded, BucketedBatchCost) and loaded.to_dict() == cost.to_dict()
