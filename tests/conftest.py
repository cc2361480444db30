"""Shared fixtures. The real model is loaded once per test session (set-up fetches it into the cache)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from child_suites import SHARDING

FIXTURES = pathlib.Path(__file__).parent / "fixtures"

# Need 8 and 12 devices: run by tests/test_many_devices.py, each in its own process.
collect_ignore = ["sharding", "cluster"]

# Tests that start child processes with their own devices run first, alone: the children (the 12-device cluster
# folder, 4.3 GB at its peak, keeps both cores busy) then share the machine with a parent that has not yet loaded
# models and compiled programs. The sharding folder (two workers of 2.6 GB at most) instead runs in the background,
# niced, beside the single-device tests, which leave part of the CPU idle (mostly single-threaded compiles); its test
# comes last and waits for it.
CHILD_PROCESS_MODULES = ("test_many_devices.py", "test_multihost.py")
BACKGROUND_TEST = "test_sharding_suite"


def _phase(item) -> int:
    """0: child-process tests, run first and alone; 1: the rest; 2: the test that waits for the background run."""
    if item.name.startswith(BACKGROUND_TEST):
        return 2
    return 0 if item.path.name in CHILD_PROCESS_MODULES else 1


def pytest_collection_modifyitems(items):
    items.sort(key=_phase)  # stable: the order within each phase stays


def pytest_runtest_setup(item):
    """Start the background run at the first test past the child-process ones, if its test was collected."""
    if _phase(item) and any(_phase(i) == 2 for i in item.session.items):
        SHARDING.start()


def pytest_sessionfinish(session):
    SHARDING.stop()  # only still running if its test never ran (an interrupted or failing -x session)


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
    """Hugging Face transformers outputs written by tools/fixtures/reference.py."""
    meta = json.loads((FIXTURES / "smollm2_reference.json").read_text())
    with np.load(FIXTURES / "smollm2_reference.npz") as z:
        meta["logits"] = [z[f"logits_{i}"] for i in range(len(meta["prefill"]))]
    return meta
