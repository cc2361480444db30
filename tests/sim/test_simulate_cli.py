"""`python -m jaxserve simulate`, run as a user runs it, and the notebook front door (jaxserve.sim)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jaxserve import sim


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxserve", "simulate", *args], capture_output=True, text=True, timeout=300
    )


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
    trace.write_text(
        "arrival,prompt_tokens,output_tokens\n"
        + "".join(f"{i * 0.25},{100 + 37 * i % 900},{1 + 13 * i % 200}\n" for i in range(120))
    )
    proc = run_cli(f"--trace={trace}", f"--out={tmp_path / 'out'}")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["summary"]["all"]["finished"] == 120 and summary["config"]["workload"] == "mine"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival": 0, "prompt_tokens": 5}\n')
    proc = run_cli(f"--trace={bad}")
    assert proc.returncode == 2 and f"{bad}:1: no column of output_tokens" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policy=srtf"], "unknown policy 'srtf'"),
        (["--trace=sharegpt"], "unknown trace 'sharegpt'"),
        (["--trace=mix", "--rate=1"], "needs --rate and --requests"),
        (["--tp=3", "--requests=10"], "no TP=3 measurements"),
        (["--rate=-2", "--requests=10"], "rate"),
    ],
)
def test_simulate_bad_input_exits_with_a_message(args, message):
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_notebook_api_gives_tables():
    res = sim.simulate(sim.make_workload("azure_conv", rate=8.0, requests=200), sim.config_for("edf"), progress=False)
    rows = res.table()
    assert len(rows) == 200 and all(row["ttft"] > 0 for row in rows)
    assert res.summary()["all"]["slo_attainment"] > 0.9


@pytest.mark.parametrize(
    "args, finished",
    [
        (["--prefill_instances=16", "--node_size=8", "--decode_instances=2", "--decode_tp=8"], 120),
        (
            [
                "--cluster_policy=tetriinfer",
                "--prefill_instances=8",
                "--decode_instances=2",
                "--decode_tp=4",
                "--prefill_chunk=512",
                "--decode_admission=reserve_dynamic",
            ],
            120,
        ),
        (["--cluster_policy=tetriinfer", "--prefill_instances=4", "--decode_instances=2", "--flip_window=30"], 120),
        (["--cluster_policy=esp", "--prefill_instances=8", "--tp=2", "--profile=h100_llama2_7b"], 120),
        (
            [
                "--cluster_policy=csps",
                "--prefill_instances=16",
                "--node_size=8",
                "--partition_tokens=8192",
                "--decode_instances=2",
                "--decode_tp=8",
            ],
            120,
        ),
    ],
)
def test_simulate_runs_a_cluster_from_the_flags_that_serve_it(tmp_path, args, finished):
    """`simulate --prefill_instances=...`: serve's layout flags, each policy's scheduler on the GPU profile."""
    proc = run_cli(*args, "--trace=azure_code", "--requests=120", "--rate=2", f"--out={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["summary"]["all"]["finished"] == finished
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prefill_instances=4", "--policy=sjf"], "--policy: not read when simulating a cluster"),
        (["--prefill_instances=4", "--length_predictor=prompt"], "--length_predictor=prompt: not simulated"),
        (["--prefill_instances=4", "--decode_kvp=2"], "--decode_kvp=2: not simulated"),
        (["--prefill_instances=4", "--cluster_policy=esp", "--decode_tp=2"], "--decode_tp=2: not read with"),
        (["--prefill_instances=6", "--node_size=4"], "6 prefill instances do not form nodes of 4"),
        (
            ["--prefill_instances=4", "--cluster_policy=csps", "--sparse_attention=0.3"],
            "--sparse_attention=0.3: not simulated",
        ),
    ],
)
def test_a_cluster_setting_the_simulator_cannot_honour_is_refused_by_name(args, message):
    proc = run_cli(*args, "--trace=azure_code", "--requests=10")
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_a_simulated_cdsp_pool_follows_the_load_through_an_improvement_rate_table(tmp_path):
    from jaxserve.config import ParallelConfig
    from jaxserve.sched.improvement_rate import RateTable
    from jaxserve.sim.cluster import simulate_cluster
    from jaxserve.sim.workload import long_context

    table = tmp_path / "rates.json"
    table.write_text(RateTable((0.1, 10.0), (0.05, 0.75)).to_json())
    w = long_context("medium", 60, 2.0, seed=0)
    runs = {
        rates: simulate_cluster(
            w,
            ParallelConfig(prefill_instances=16, node_size=8, decode_instances=2, decode_tp=8, improvement_rates=rates),
            "a100_llama3_8b",
            progress=False,
        )
        for rates in (None, str(table))
    }
    chunks = {k: sum(len(group) for _, group, _, _ in r.prefills) for k, r in runs.items()}
    # at 2 req/s the table's nearer entry is the light-load one (0.05): groups grow more eagerly than at 0.1
    assert all(r.summary()["all"]["finished"] == 60 for r in runs.values())
    assert chunks[str(table)] > chunks[None]
