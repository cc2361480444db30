"""`python -m jaxserve simulate`, run as a user runs it, and the notebook front door (jaxserve.sim)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jaxserve import sim


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxserve", "simulate", *args], capture_output=True, text=True,
                          timeout=300)


def test_simulate_writes_summary_requests_and_plot(tmp_path):
    proc = run_cli("--trace=azure_code", "--requests=300", "--rate=5", "--policy=sjf", f"--out={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["summary"]["all"]["finished"] == 300
    assert summary["config"]["scheduler"]["policy"] == "sjf" and summary["config"]["workload"] == "azure_code"
    assert (tmp_path / "requests.csv").read_text().count("\n") == 301
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 10_000
    assert json.loads(proc.stdout[: proc.stdout.rindex("}") + 1])["all"]["requests"] == 300


def test_simulate_replays_a_users_trace_file(tmp_path):
    trace = tmp_path / "mine.csv"
    trace.write_text("arrival,prompt_tokens,output_tokens\n" + "".join(
        f"{i * 0.25},{100 + 37 * i % 900},{1 + 13 * i % 200}\n" for i in range(120)))
    proc = run_cli(f"--trace={trace}", f"--out={tmp_path / 'out'}")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["summary"]["all"]["finished"] == 120 and summary["config"]["workload"] == "mine"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival": 0, "prompt_tokens": 5}\n')
    proc = run_cli(f"--trace={bad}")
    assert proc.returncode == 2 and f"{bad}:1: no column of output_tokens" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--policy=srtf"], "unknown policy 'srtf'"),
    (["--trace=sharegpt"], "unknown trace 'sharegpt'"),
    (["--trace=mix", "--rate=1"], "needs --rate and --requests"),
    (["--tp=3", "--requests=10"], "no TP=3 measurements"),
    (["--rate=-2", "--requests=10"], "rate"),
])
def test_simulate_bad_input_exits_with_a_message(args, message):
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_notebook_api_gives_tables():
    res = sim.simulate(sim.make_workload("azure_conv", rate=8.0, requests=200), sim.config_for("edf"),
                       progress=False)
    rows = res.table()
    assert len(rows) == 200 and all(row["ttft"] > 0 for row in rows)
    assert res.summary()["all"]["slo_attainment"] > 0.9
