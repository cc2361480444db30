"""The step cost model measured on the engine itself (engine/profile.py): what the session's LLM measured at start,
and the on-disk cache it is loaded from."""

from __future__ import annotations

import dataclasses
import json

import pytest

from jaxserve.engine import profile
from jaxserve.sched.batch_cost import EngineStepCost


def test_the_measured_profile_prices_steps_and_round_trips(llm, tmp_path):
    cost = llm.cost
    b = llm.engine.runner.buckets
    assert (cost.shapes.tokens, cost.shapes.rows, cost.shapes.max_prefills) == (b.tokens, b.rows, b.max_prefills)
    assert all(t > 0 for row in cost.base for t in row)
    assert min(cost.tile_fixed, cost.tile_block, cost.decode_fixed, cost.decode_block, cost.decode_pad_block) >= 0
    # a batch is priced by the program that runs it: the smallest bucket that holds it
    t, r = b.fit(b.tokens[0] + 1, 1)
    assert cost.batch_time([(b.tokens[0] + 1, 0)]) == pytest.approx(
        cost.base[b.tokens.index(t)][b.rows.index(r)] + b.tiles(t, r) * (cost.tile_fixed + cost.tile_block))
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(cost.to_dict()))
    loaded = profile.load_or_measure(path, llm.engine.runner, llm.max_model_len, progress=False)
    assert isinstance(loaded, EngineStepCost) and loaded.to_dict() == cost.to_dict()
    # a profile of other step shapes would price programs this engine does not run
    other = dataclasses.replace(cost.shapes, max_prefills=cost.shapes.max_prefills + 1)
    path.write_text(json.dumps({**cost.to_dict(), "shapes": other.to_dict()}))
    with pytest.raises(ValueError, match="other step shapes"):
        profile.load_or_measure(path, llm.engine.runner, llm.max_model_len, progress=False)
