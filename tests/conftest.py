"""Shared fixtures. The real model is loaded once per test session (set-up fetches it into the cache)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

FIXTURES = pathlib.Path(__file__).parent / "fixtures"

# Need 8 and 12 devices: run by tests/test_many_devices.py, each in its own process.
collect_ignore = ["sharding", "cluster"]

# Tests that start child processes with their own devices, run first: the children (the 12-device cluster folder
# peaks near 16 GB) then share the machine with a parent that has not yet loaded models and compiled programs.
CHILD_PROCESS_MODULES = ("test_many_devices.py", "test_multihost.py")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name not in CHILD_PROCESS_MODULES)  # stable: the order within stays


@pytest.fixture(scope="session")
def llm():
    """The real model, with room for multi-step decodes of up to 8 steps, planned one step at a time until a
    test turns them on (tests/engine/test_engine.py: bursts)."""
    import jaxserve

    llm = jaxserve.LLM(max_model_len=2048, kv_cache_tokens=8192, num_scheduler_steps=8)
    llm.engine.scheduler.num_scheduler_steps = 1
    return llm


@pytest.fixture(scope="session")
def reference():
    """Hugging Face transformers outputs written by tools/make_reference_fixtures.py."""
    meta = json.loads((FIXTURES / "smollm2_reference.json").read_text())
    with np.load(FIXTURES / "smollm2_reference.npz") as z:
        meta["logits"] = [z[f"logits_{i}"] for i in range(len(meta["prefill"]))]
    return meta
