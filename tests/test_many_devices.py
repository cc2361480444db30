"""Runs the folders that need many devices, each in a child process with that many CPU devices (XLA_FLAGS is set
for that process only): tests/sharding (8) and tests/cluster (12: 8 prefill devices plus decode instances)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent


@pytest.mark.parametrize("folder, devices", [("sharding", 8), ("cluster", 12)])
def test_many_device_suite(folder, devices):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=10",
                           str(HERE / folder)],
                          env=env, capture_output=True, text=True, timeout=2400)
    print(proc.stdout[-20000:], proc.stderr[-5000:])
    assert proc.returncode == 0, proc.stdout[-5000:]
