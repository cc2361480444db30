"""Runs the folders that need many devices, each in a child process with that many CPU devices (XLA_FLAGS is set
for that process only): tests/sharding (8) and tests/cluster (12: 8 prefill devices plus decode instances)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent


# workers: the sharding tests (small random models, 2.6 GB at most) keep one core busy in one process, so two
# pytest-xdist workers finish them sooner; the cluster folder's peak (18 GB) allows one process only
@pytest.mark.parametrize("folder, devices, workers", [("sharding", 8, 2), ("cluster", 12, 1)])
def test_many_device_suite(folder, devices, workers):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    parallel = ["-n", str(workers)] if workers > 1 else []
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=10",
                           *parallel, str(HERE / folder)],
                          env=env, capture_output=True, text=True, timeout=2400)
    print(proc.stdout[-20000:], proc.stderr[-5000:])
    assert proc.returncode == 0, proc.stdout[-5000:]
