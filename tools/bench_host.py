"""The host's share of a serving step: what Python does between one step's tokens coming back and the next step
being dispatched (the device idles meanwhile, as long as steps are not overlapped).

    .venv/bin/python tools/bench_host.py [--rows=1,16] [--tokens=64] [--out=bench_out/host.json]

A tiny random model (`random:tiny`) makes the device's part small, so what is timed is the engine's own work.
Each phase of `Engine.step` is timed by wrapping the function that does it: schedule (the scheduler's Plan),
pack (rows into the step's arrays), dispatch (the compiled call, until it returns), wait (until its tokens are
on the host), detokenize+stop (per token, summed over the step) and apply (the Outcome). The host's critical path
is the step's wall time less the wait. Medians over the steady decode steps, in microseconds. On a CPU the
compiled call may run inline, so there dispatch holds the (tiny) model's compute too.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import time
from typing import Any, Callable

import numpy as np
from absl import app, flags

import jaxserve
from jaxserve import SamplingParams
from jaxserve.engine import runner as runner_module

FLAGS = flags.FLAGS
flags.DEFINE_list("rows", ["1", "16"], "Requests decoding together.")
flags.DEFINE_integer("tokens", 64, "Tokens generated per request.")
flags.DEFINE_string("out", None, "Optional JSON file for the results.")

PHASES = ("schedule", "pack", "dispatch", "wait", "detokenize+stop", "apply")


class Timer:
    """Seconds spent in each wrapped function during the current step."""

    def __init__(self):
        self.step: dict[str, float] = {}

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        inner: Callable = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.step[phase] = self.step.get(phase, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)


def instrument(llm: jaxserve.LLM) -> Timer:
    """Time the engine's phases from now on."""
    engine, timer = llm.engine, Timer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.scheduler, "apply", "apply")
    timer.wrap(runner_module.batch, "pack", "pack")
    timer.wrap(engine, "_append", "detokenize+stop")
    timer.wrap(runner_module.processes, "read", "wait")
    program = engine.runner._program

    def dispatching(which):
        compiled = program(which)

        def call(*args):
            start = time.perf_counter()
            try:
                return compiled(*args)
            finally:
                timer.step["dispatch"] = timer.step.get("dispatch", 0.0) + time.perf_counter() - start
        return call

    engine.runner._program = dispatching
    return timer


def measure(llm: jaxserve.LLM, timer: Timer, rows: int, tokens: int) -> dict[str, float]:
    engine = llm.engine
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for _ in range(rows):
        engine.add_request(rng.integers(10, 500, size=32).tolist(), params)
    steps = []
    while engine.has_unfinished():
        timer.step = {}
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        steps.append({**{p: timer.step.get(p, 0.0) for p in PHASES}, "wall": wall})
    decode = steps[2:-1]  # steady decode steps: after the prefill, before the last
    out = {p: statistics.median(s[p] for s in decode) * 1e6 for p in PHASES}
    out["critical_path"] = statistics.median((s["wall"] - s["wait"]) for s in decode) * 1e6
    out["steps"] = len(decode)
    return out


def main(argv: list[str]) -> None:
    del argv
    rows = [int(r) for r in FLAGS.rows]
    results = {}
    for r in rows:
        llm = jaxserve.LLM("random:tiny", max_model_len=512, kv_cache_tokens=4096, max_num_seqs=max(rows),
                           max_num_batched_tokens=max(64, max(rows)), prefix_caching=False, progress=False)
        timer = instrument(llm)
        measure(llm, timer, r, 4)  # compile what the measured run uses
        results[f"batch{r}"] = measure(llm, timer, r, FLAGS.tokens)
    print(f"{'us per decode step':<22}" + "".join(f"{k:>12}" for k in results))
    for phase in (*PHASES, "critical_path"):
        print(f"{phase:<22}" + "".join(f"{v[phase]:12.0f}" for v in results.values()))
    if FLAGS.out:
        pathlib.Path(FLAGS.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    app.run(main)
