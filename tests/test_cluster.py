"""Runs tests/cluster in a child process with 12 CPU devices (XLA_FLAGS is set for that process only)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).parent


def test_cluster_suite():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=12")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "cluster")],
                          env=env, capture_output=True, text=True, timeout=1800)
    print(proc.stdout[-20000:], proc.stderr[-5000:])
    assert proc.returncode == 0, proc.stdout[-5000:]
