"""Start-up as a new user meets it: `generate` and `serve` timed from launch, first with empty caches (no
compiled programs, no cost profile, no converted weights: a fresh machine), then again with what the first runs
left.

    .venv/bin/python tools/bench_startup.py [--runs=2] [--out=DIR]

Each run is its own process with JAXSERVE_CACHE pointing at one temporary folder (the user's cache is not
touched). `generate`: launch to exit, a 16-token greedy reply to a short prompt. `serve`: launch to both
interfaces listening (every step program compiled, the cost model measured or loaded). The table goes to stdout
and, with --out, to DIR/startup.json.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from absl import app, flags

flags.DEFINE_integer("runs", 2, "generate runs after the first (each with the caches the earlier ones left)")
flags.DEFINE_string("out", None, "write startup.json here")
flags.DEFINE_string("model", None, "the model (default: jaxserve's)")
FLAGS = flags.FLAGS

PROMPT = "Write one sentence about the sea."


def timed_generate() -> float:
    args = [sys.executable, "-m", "jaxserve", "generate", f"--prompt={PROMPT}", "--max_tokens=16"]
    start = time.perf_counter()
    proc = subprocess.run(args + ([f"--model={FLAGS.model}"] if FLAGS.model else []), capture_output=True,
                          text=True, timeout=1800)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"generate failed:\n{proc.stderr[-3000:]}")
    return seconds


def timed_serve() -> float:
    from jaxserve.server.spawn import ServerProcess

    start = time.perf_counter()
    server = ServerProcess(*([f"--model={FLAGS.model}"] if FLAGS.model else []))
    seconds = time.perf_counter() - start
    server.stop()
    return seconds


def main(argv: list[str]) -> None:
    del argv
    rows = []
    with tempfile.TemporaryDirectory() as generate_cache, tempfile.TemporaryDirectory() as serve_cache:
        os.environ["JAXSERVE_CACHE"] = generate_cache
        for i in range(1 + FLAGS.runs):
            rows.append(("generate", "empty caches" if i == 0 else f"run {i + 1}", timed_generate()))
            print(f"{rows[-1][0]:9s} {rows[-1][1]:13s} {rows[-1][2]:6.1f} s", flush=True)
        os.environ["JAXSERVE_CACHE"] = serve_cache
        for i in range(2):
            rows.append(("serve", "empty caches" if i == 0 else "run 2", timed_serve()))
            print(f"{rows[-1][0]:9s} {rows[-1][1]:13s} {rows[-1][2]:6.1f} s", flush=True)
    if FLAGS.out:
        out = pathlib.Path(FLAGS.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "startup.json").write_text(json.dumps([dict(command=c, caches=k, seconds=round(s, 1))
                                                      for c, k, s in rows], indent=1))


if __name__ == "__main__":
    app.run(main)
