"""Shared fixtures. The real model is loaded once per test session (set-up fetches it into the cache)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

FIXTURES = pathlib.Path(__file__).parent / "fixtures"

# Need 8 and 12 devices: run by tests/test_many_devices.py, each in its own process.
collect_ignore = ["sharding", "cluster"]

# Tests that start child processes with their own devices run first, alone: the children (the 12-device cluster
# folder, 4.3 GB at its peak, keeps both cores busy) then share the machine with a parent that has not yet loaded
# models and compiled programs. The sharding folder (two workers of 2.6 GB at most) instead runs in the background, niced, beside the
# single-device tests, which leave part of the CPU idle (mostly single-threaded compiles); its test comes last
# and waits for it.
CHILD_PROCESS_MODULES = ("test_many_devices.py", "test_multihost.py")
BACKGROUND_TEST = "test_sharding_suite"


class ChildSuite:
    """One test folder run by pytest in a child process with `devices` CPU devices (XLA_FLAGS set for that process
    only) on `workers` pytest-xdist workers, at CPU priority `nice`; its output goes to a file."""

    def __init__(self, folder: str, devices: int, workers: int, nice: int = 0, timeout_s: float = 3600):
        self.folder, self.devices, self.workers, self.nice, self.timeout_s = folder, devices, workers, nice, timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        if self.proc is not None:
            return
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={self.devices}")
        parallel = ["-n", str(self.workers)] if self.workers > 1 else []
        self.log = tempfile.TemporaryFile("w+")
        self.deadline = time.monotonic() + self.timeout_s
        self.proc = subprocess.Popen(
            ["nice", "-n", str(self.nice), sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "--durations=10", *parallel, str(pathlib.Path(__file__).parent / self.folder)],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)

    def finish(self) -> tuple[int, str]:
        """Wait for the run (starting it if need be): its exit status and the tail of its output."""
        self.start()
        try:
            code = self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log.seek(0)
        return code, self.log.read()[-20000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


SHARDING = ChildSuite("sharding", devices=8, workers=2, nice=10)


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
    """Hugging Face transformers outputs written by tools/make_reference_fixtures.py."""
    meta = json.loads((FIXTURES / "smollm2_reference.json").read_text())
    with np.load(FIXTURES / "smollm2_reference.npz") as z:
        meta["logits"] = [z[f"logits_{i}"] for i in range(len(meta["prefill"]))]
    return meta
