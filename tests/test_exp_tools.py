"""The claims experiments (tools/exp_*.py) run end to end on tiny inputs and write their JSON and plots: the
figures in docs/BENCHMARKS.md stay reproducible by their commands."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

TOOLS = pathlib.Path(__file__).parent.parent / "tools"

CASES = {
    "exp_policies": (["--requests=30", "--seeds=1", "--rates=0.5", "--nocapacity"], "policies_medha.json"),
    "exp_cdsp": (["--requests=40", "--traces=short"], "cdsp.json"),
    "exp_cdsp --model=70b": (["--requests=40", "--traces=short", "--model=70b"], "cdsp_70b.json"),
    "exp_esp": (["--requests=20", "--memory_requests=15", "--memory_rates=0.1"], "esp.json"),
    "exp_tetriinfer": (["--workloads=mixed", "--rates=burst", "--burst_requests=16", "--layouts=1+1",
                        "--colocated=2"], "tetriinfer.json"),
    "exp_csps": (["--requests=12", "--rates=0.1", "--seeds=0", "--light=0.05"], "csps.json"),
    "exp_tetris_tbt": (["--requests=15", "--traces=short", "--rates=1"], "tetris_tbt.json"),
    "exp_kvp": (["--requests=20", "--rates=0.5", "--long_tokens=300000", "--kvp_tokens=200000"], "kvp.json"),
}


@pytest.mark.parametrize("tool", sorted(CASES))
def test_experiment_runs_and_writes_its_results(tool, tmp_path):
    args, result = CASES[tool]
    done = subprocess.run([sys.executable, str(TOOLS / f"{tool.split()[0]}.py"), *args, f"--out={tmp_path}"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    json.loads((tmp_path / result).read_text())
    assert list(tmp_path.glob("*.png")), sorted(p.name for p in tmp_path.iterdir())
