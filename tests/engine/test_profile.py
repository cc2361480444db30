"""The step cost model measured on the engine itself (engine/profile.py): what the session's LLM measured at start,
and the on-disk cache it is loaded from."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys
import time

import pytest

from jaxserve.engine import profile
from jaxserve.sched.batch_cost import EngineStepCost


@pytest.fixture(scope="module")
def warm():
    """An LLM started as serve starts it (every program compiled, the profile measured), with small buckets."""
    import jaxserve

    return jaxserve.LLM(
        max_model_len=512,
        kv_cache_tokens=2048,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        warmup=True,
        quick_start=False,
        progress=False,
    )


def test_the_measured_profile_prices_steps_and_round_trips(warm, tmp_path):
    llm = warm
    cost = llm.builder.cost
    b = llm.engine.runner.buckets
    assert (cost.shapes.tokens, cost.shapes.rows, cost.shapes.max_prefills) == (b.tokens, b.rows, b.max_prefills)
    assert cost.shapes.decode_rows == b.decode_rows == (1, 2, 4)
    assert all(t > 0 for row in cost.base for t in row) and all(t > 0 for t in cost.decode_base)
    # decodes alone run in the decode program of their rows
    assert cost.batch_time([], [10, 20]) == pytest.approx(
        cost.decode_base[1]
        + 2 * cost.decode_fixed
        + cost.decode_block * 30 / cost.key_block
        + cost.decode_pad_block * (2 - 30 / cost.key_block)
    )
    assert min(cost.tile_fixed, cost.tile_block, cost.decode_fixed, cost.decode_block, cost.decode_pad_block) >= 0
    # a batch is priced by the program that runs it: the smallest bucket that holds it
    t, r = b.fit(b.tokens[0] + 1, 1)
    assert cost.batch_time([(b.tokens[0] + 1, 0)]) == pytest.approx(
        cost.base[b.tokens.index(t)][b.rows.index(r)] + cost.tile_fixed + cost.tile_block
    )  # one tile, one block
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(cost.to_dict()))
    loaded = profile.load_or_measure(path, llm.engine.runner, llm.max_model_len, progress=False)
    assert isinstance(loaded, EngineStepCost) and loaded.to_dict() == cost.to_dict()
    # a profile of other step shapes would price programs this engine does not run
    other = dataclasses.replace(cost.shapes, max_prefills=cost.shapes.max_prefills + 1)
    path.write_text(json.dumps({**cost.to_dict(), "shapes": other.to_dict()}))
    with pytest.raises(ValueError, match="other step shapes"):
        profile.load_or_measure(path, llm.engine.runner, llm.max_model_len, progress=False)


def test_profile_step_tool_reports_a_decode_steps_kernels(tmp_path):
    """tools/profile/step.py (the GPU decode-step profile) runs on this CPU with a tiny random model: every row
    count gets a wall time, a busy time and its top kernels, which account for no more than the busy time."""
    tool = pathlib.Path(__file__).parents[2] / "tools" / "profile" / "step.py"
    done = subprocess.run(
        [
            sys.executable,
            str(tool),
            "--model=random:tiny",
            "--dtype=float32",
            "--rows=1,4",
            "--context=64",
            "--steps=3",
            f"--out={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["rows"] for s in summary["steps"]] == [1, 4]
    for s in summary["steps"]:
        assert s["wall_ms"] > 0 and s["busy_ms"] > 0 and s["top"]
        assert sum(k["ms_per_step"] for k in s["top"]) <= s["busy_ms"] * (1 + 1e-6)


def test_the_device_never_waits_for_the_host(tmp_path):
    """tools/bench/host.py: on a fake device taking D = 5 ms a step, 16 rows decode at max(host, D) a step with
    overlap (within 10%), and N + 1 is dispatched before N's tokens are ready; one step at a time is slower than
    that bound (the check can fail). Every phase of the step is accounted."""
    tool = pathlib.Path(__file__).parents[2] / "tools" / "bench" / "host.py"
    out = tmp_path / "host.json"
    done = subprocess.run(
        [sys.executable, str(tool), "--rows=16", "--tokens=40", "--delay_ms=5", f"--out={out}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(out.read_text())
    sync, overlap = results["batch16"], results["batch16_overlap"]
    for r in (sync, overlap):
        assert r["steps"] >= 20 and all(r[p] > 0 for p in ("schedule", "pack", "dispatch", "detokenize+stop"))
        assert r["host"] >= max(r["schedule"], r["pack"], r["dispatch"])  # each step: host >= a phase
    assert overlap["wall"] <= 1.1 * max(overlap["host"], overlap["delay"])
    assert overlap["critical_path"] < 100
    assert sync["wall"] > 1.1 * max(sync["host"], sync["delay"])


def test_bench_startup_tool_times_generate_and_serve_from_fresh_caches(tmp_path):
    """tools/bench/startup.py (start-up as a new user meets it) runs generate and serve from fresh caches and
    again, with a tiny random model."""
    tool = pathlib.Path(__file__).parents[2] / "tools" / "bench" / "startup.py"
    done = subprocess.run(
        [sys.executable, str(tool), "--model=random:tiny", "--runs=1", f"--out={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads((tmp_path / "startup.json").read_text())
    assert [(r["command"], r["caches"]) for r in rows] == [
        ("generate", "as installed"),
        ("generate", "run 2"),
        ("serve", "as installed"),
        ("serve", "run 2"),
    ]
    assert all(r["seconds"] > 0 for r in rows)
    assert all(r["first_reply_seconds"] > 0 for r in rows if r["command"] == "serve")


def test_a_quick_start_serves_at_once_then_measures_its_profile_when_idle(tmp_path):
    """serve's quick start: the first requests' programs compile before the LLM returns and the rest in the
    background; until the profile is measured, steps are bounded by tokens. The profile is measured when the
    engine is idle, stops when a request waits (and starts again later), and then prices every step."""
    import jaxserve
    from jaxserve import SamplingParams

    path = tmp_path / "profile.json"
    llm = jaxserve.LLM(
        "random:tiny",
        max_model_len=256,
        kv_cache_tokens=2048,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        warmup=True,
        quick_start=True,
        cost_profile=str(path),
        progress=False,
    )
    engine, runner = llm.engine, llm.engine.runner
    assert all(runner.is_compiled(p) for p in runner.first_programs())
    assert len(runner.first_programs()) < len(runner.programs())
    assert llm.builder.cost is None and engine.has_deferred and engine.scheduler.packer.iteration_budget == float("inf")
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], list(range(10, 210))]  # the second's chunk is not among the first programs
    before = [o.token_ids for o in llm.generate(prompts, greedy)]

    deadline, asked = time.monotonic() + 300, []
    while not asked:  # the measurement asks whether to stop once the background compile has ended
        assert time.monotonic() < deadline, "the background compile did not finish"
        engine.run_deferred(stop=lambda: asked.append(1) or True)
        time.sleep(0.2)
    assert all(runner.is_compiled(p) for p in runner.programs())
    asked.clear()
    engine.run_deferred(stop=lambda: asked.append(1) or len(asked) > 2)  # a request arrives after one run
    assert len(asked) == 3 and engine.has_deferred and not path.exists() and llm.builder.cost is None
    engine.run_deferred(stop=lambda: False)
    assert not engine.has_deferred and path.exists()
    assert engine.scheduler.cost is llm.builder.cost and all(t > 0 for t in llm.builder.cost.decode_base)
    assert 0 < engine.scheduler.packer.iteration_budget < float("inf")
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == before


def test_a_quick_started_server_measures_its_profile_while_idle_and_answers_meanwhile(tmp_path):
    """Behind the server, the deferred profile runs on the engine thread while no request is open; a request
    that arrives meanwhile is answered (the measurement yields to it), and the profile is then written."""
    import openai

    import jaxserve
    from jaxserve.server.launch import BackgroundServer

    path = tmp_path / "profile.json"
    llm = jaxserve.LLM(
        "random:tiny",
        max_model_len=256,
        kv_cache_tokens=2048,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        warmup=True,
        quick_start=True,
        cost_profile=str(path),
        progress=False,
    )
    with BackgroundServer(llm, grpc_port=0, http_port=0) as s:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{s.server.http_port}/v1", api_key="-", max_retries=0)
        engine = s.server.engine.engine
        deadline = time.monotonic() + 300
        while s.call(lambda: engine.has_deferred):
            reply = client.completions.create(model="random:tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0)
            assert reply.usage.completion_tokens == 4
            assert time.monotonic() < deadline, "the profile was not measured while the server was idle"
            time.sleep(0.5)
        assert path.exists() and s.call(lambda: engine.scheduler.cost) is llm.builder.cost is not None
