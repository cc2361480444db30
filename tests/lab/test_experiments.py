"""The claims experiments (jaxserve/lab/experiments.py) run end to end on their tiny set-ups and write their JSON
and plots, so the figures in docs/BENCHMARKS.md stay reproducible by their commands; the command line
(`python -m jaxserve.lab NAME`) runs as a user runs it and gives the same results."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from jaxserve.lab import experiments

TOOLS = pathlib.Path(__file__).parents[2] / "tools"


def test_the_command_line_lists_the_experiments_and_refuses_an_unknown_one():
    listed = subprocess.run([sys.executable, "-m", "jaxserve.lab"], capture_output=True, text=True, check=True)
    assert all(f"  {name} " in listed.stdout for name in experiments.EXPERIMENTS)
    unknown = subprocess.run([sys.executable, "-m", "jaxserve.lab", "cdps"], capture_output=True, text=True)
    assert unknown.returncode == 1 and "no experiment named 'cdps'" in unknown.stderr
    bad = subprocess.run([sys.executable, "-m", "jaxserve.lab", "cdsp", "--model=7b"], capture_output=True, text=True)
    assert bad.returncode == 1 and "--model" in bad.stderr and "<8b|70b>" in bad.stderr


@pytest.mark.parametrize(
    "name, options", [(name, {}) for name in sorted(experiments.EXPERIMENTS)] + [("cdsp", {"model": "70b"})]
)
def test_experiment_runs_and_writes_its_results(name, options, tmp_path):
    results = experiments.run(name, tiny=True, out=str(tmp_path), **options)
    (written,) = tmp_path.glob("*.json")
    assert written.read_text() == json.dumps(results, indent=1)
    assert list(tmp_path.glob("*.png")), sorted(p.name for p in tmp_path.iterdir())


def test_a_command_line_runs_its_experiment_from_its_flags(tmp_path):
    cli, registry = tmp_path / "cli", tmp_path / "registry"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxserve.lab",
            "tetris_tbt",
            "--requests=15",
            "--traces=short",
            "--rates=1",
            f"--out={cli}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    experiments.run("tetris_tbt", tiny=True, out=str(registry))
    assert (cli / "tetris_tbt.json").read_text() == (registry / "tetris_tbt.json").read_text()


def test_the_improvement_rate_tool_writes_a_table_the_live_flag_reads(tmp_path):
    """tools/profile/improvement_rates.py on a pool's Eq. (1) file: what `--improvement_rates` reads."""
    from jaxserve.sched.cost_models import TetrisPrefill
    from jaxserve.sched.improvement_rate import read_rate_table
    from jaxserve.sched.profiles import tetris_table1_samples

    eq1, out = tmp_path / "eq1.json", tmp_path / "rates.json"
    eq1.write_text(TetrisPrefill.fit(tetris_table1_samples()).to_json())
    subprocess.run(
        [
            sys.executable,
            str(TOOLS / "profile" / "improvement_rates.py"),
            f"--prefill_profile={eq1}",
            "--prefill_instances=16",
            "--node_size=8",
            "--trace=azure_code",
            "--requests=60",
            "--rates=0.2,5",
            "--candidates=0.05,0.5",
            f"--out={out}",
        ],
        check=True,
        capture_output=True,
    )
    table = read_rate_table(out)
    assert table.arrival_rates == (0.2, 5.0) and set(table.improvement_rates) <= {0.05, 0.5}
