"""Runs the folders that need many devices, each in a child process with that many CPU devices: tests/cluster (12:
8 prefill devices plus decode instances) in the foreground, first, and tests/sharding (8), which conftest.py
starts in the background once the other child-process tests are done."""

from __future__ import annotations

from child_suites import SHARDING, ChildSuite

# one process: the cluster folder compiles in threads and keeps both cores busy
CLUSTER = ChildSuite("cluster", devices=12, workers=1, timeout_s=3000)


def check(suite: ChildSuite) -> None:
    code, output = suite.finish()
    print(output)
    assert code == 0, output[-5000:]


def test_cluster_suite():
    check(CLUSTER)


def test_sharding_suite():
    check(SHARDING)
