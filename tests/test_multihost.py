"""The cluster across two processes (jax.distributed on CPU, gloo), each with 4 CPU devices: the leader's
device calls replayed by the follower in lockstep, a prompt prefilled on a group spanning both processes and
decoded on the other one, tokens identical to the single-device engine."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

HERE = pathlib.Path(__file__).parent / "multihost"
TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], process_id: int, log: pathlib.Path) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    # jax.distributed catches SIGTERM: `timeout -k` ends a stuck process for sure
    return subprocess.Popen(["timeout", "-k", "10", str(TIMEOUT_S), sys.executable, *args], env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


def test_prefill_spanning_two_processes_then_decode_on_the_other_equals_one_device(tmp_path):
    port, out = free_port(), tmp_path / "result.json"
    procs = [start([str(HERE / "cluster_worker.py"), str(i), str(port), str(out)], i, tmp_path / f"p{i}.log")
             for i in range(2)]
    codes = [p.wait(TIMEOUT_S + 30) for p in procs]
    logs = "\n".join(f"--- process {i}\n" + (tmp_path / f"p{i}.log").read_text()[-4000:] for i in range(2))
    assert codes == [0, 0], logs
    result = json.loads(out.read_text())
    assert result["got"] == result["want"], logs
    long_chunks = [c["processes"] for c in result["chunks"] if c["request"] == 0]
    assert [0, 1] in long_chunks, result["chunks"]  # a chunk ran on devices of both processes
    assert result["decode_processes"] == [[1], [1]]  # every decode instance is on process 1
