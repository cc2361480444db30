"""Does the device wait for Python? The engine's decode steps on a fake device that takes D per step, with the
next step dispatched before the last one's tokens are read (overlap) and without (one step at a time), and with
multi-step decodes of up to K steps (bursts, dispatched ahead too).

    .venv/bin/python tools/bench/host.py [--rows=1,16] [--tokens=64] [--delay_ms=5] [--num_scheduler_steps=8] \
        [--out=bench_out/host.json]

A tiny random model (`random:tiny`) computes the tokens, so the engine's own work is what the host does. The fake
device (FakeDevice) wraps the runner: like a GPU's stream it runs steps in order, each D seconds from when it is
dispatched or the step before it ends, whichever is later; its tokens are ready then. With overlap a step should
take max(host, D), not their sum. `--delay_ms=auto` sets D to the host's own time per step (measured first, one
step at a time), where the two are closest.

Per steady decode step (medians, microseconds; a burst's figures divided by its steps, so each column is per
token of each row):
- wall: between the engine's steps; host: wall less the time blocked on tokens;
- critical_path: from step N's tokens being ready to step N+1 dispatched (the device idles meanwhile; 0 when
  N+1 was dispatched first);
- schedule, pack, dispatch, wait, detokenize+stop (per step, summed over its tokens) and apply: each phase of
  `Engine.step`, timed by wrapping the function that does it.
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
flags.DEFINE_string("delay_ms", "5", "The fake device's time per step, in ms; auto: the host's own time.")
flags.DEFINE_integer("num_scheduler_steps", 8, "The most decode steps of a burst (1: no burst run).")
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


class _Delayed:
    """A step's tokens, ready when the fake device finishes the step."""

    def __init__(self, pending: runner_module.Pending, ready_at: float):
        self.pending, self.ready_at = pending, ready_at

    def value(self) -> np.ndarray:
        time.sleep(max(self.ready_at - time.perf_counter(), 0.0))
        return self.pending.value()

    def logprobs_value(self):
        return self.pending.logprobs_value()


class FakeDevice:
    """An in-order device taking `delay` seconds a decode step (a burst: one per step), in front of the runner's
    real one (which computes the tokens, far faster). `idle[k]`: how long it waited for dispatch k after dispatch
    k - 1 ended."""

    def __init__(self, runner: runner_module.ModelRunner, delay: float):
        self.delay, self.start_real = delay, runner.start
        self.free_at = time.perf_counter()
        self.idle: list[float] = []
        runner.start = self.start

    def start(self, rows, steps=1, guided=False):
        pending = self.start_real(rows, steps, guided)
        now = time.perf_counter()
        self.idle.append(max(now - self.free_at, 0.0))
        self.free_at = max(now, self.free_at) + self.delay * steps
        return _Delayed(pending, self.free_at)


def instrument(llm: jaxserve.LLM) -> Timer:
    """Time the engine's phases from now on."""
    engine, timer = llm.engine, Timer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.scheduler, "apply", "apply")
    timer.wrap(runner_module.batch, "pack", "pack")
    timer.wrap(engine, "_append", "detokenize+stop")
    timer.wrap(_Delayed, "value", "wait")
    timer.wrap(engine.runner, "dispatch", "dispatch")
    timer.wrap(engine.runner, "dispatch_burst", "dispatch")
    return timer


def measure(
    llm: jaxserve.LLM, timer: Timer, device: FakeDevice, rows: int, tokens: int, overlap: bool, burst: int = 1
) -> dict[str, float]:
    engine = llm.engine
    engine.overlap, engine.scheduler.num_scheduler_steps = overlap, burst
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for _ in range(rows):
        engine.add_request(rng.integers(10, 500, size=32).tolist(), params)
    steps, device.idle = [], []
    while engine.has_work:
        timer.step = {}
        start = time.perf_counter()
        outputs = engine.step()
        wall = time.perf_counter() - start
        per_row = max((len(o.new_token_ids) for o in outputs), default=1)  # a burst's steps
        steps.append(
            {**{p: timer.step.get(p, 0.0) / per_row for p in PHASES}, "wall": wall / per_row, "per_row": per_row}
        )
    decode = slice(3, -3)  # steady decode steps: after the prefill, before the last ones
    out = {p: statistics.median(s[p] for s in steps[decode]) * 1e6 for p in PHASES}
    out["wall"] = statistics.median(s["wall"] for s in steps[decode]) * 1e6
    out["host"] = statistics.median(s["wall"] - s["wait"] for s in steps[decode]) * 1e6
    per_row = statistics.median(s["per_row"] for s in steps[decode])
    out["critical_path"] = statistics.median(device.idle[decode]) / per_row * 1e6
    out["delay"] = device.delay * 1e6
    out["steps"] = len(steps[decode])
    return out


def main(argv: list[str]) -> None:
    del argv
    rows = [int(r) for r in FLAGS.rows]
    results = {}
    for r in rows:
        burst = FLAGS.num_scheduler_steps
        llm = jaxserve.LLM(
            "random:tiny",
            max_model_len=512,
            kv_cache_tokens=4096,
            max_num_seqs=max(rows),
            max_num_batched_tokens=max(64, max(rows)),
            enable_prefix_caching=False,
            progress=False,
            num_scheduler_steps=burst,
        )
        device = FakeDevice(llm.engine.runner, 0.0)
        timer = instrument(llm)
        measure(llm, timer, device, r, 12, overlap=True)  # compile what the measured runs use
        measure(llm, timer, device, r, FLAGS.tokens, overlap=True, burst=burst)
        if FLAGS.delay_ms == "auto":
            device.delay = measure(llm, timer, device, r, FLAGS.tokens, overlap=False)["host"] / 1e6
        else:
            device.delay = float(FLAGS.delay_ms) / 1e3
        for overlap in (False, True):
            results[f"batch{r}" + ("_overlap" if overlap else "")] = measure(
                llm, timer, device, r, FLAGS.tokens, overlap
            )
        if burst > 1:
            results[f"batch{r}_burst{burst}"] = measure(llm, timer, device, r, FLAGS.tokens, True, burst)
    keys = ("wall", "host", "delay", "critical_path", *PHASES)
    print(f"{'us per decode step':<22}" + "".join(f"{k:>16}" for k in results))
    for key in keys:
        print(f"{key:<22}" + "".join(f"{v[key]:16.0f}" for v in results.values()))
    if FLAGS.out:
        pathlib.Path(FLAGS.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    app.run(main)
