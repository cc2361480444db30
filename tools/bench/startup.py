"""Start-up as a new user meets it: `generate` and `serve` timed from launch, first with the caches as
tools/install.sh leaves them (the fetched model alone: no compiled programs, no cost profile, no converted
weights), then again with what the first runs left.

    .venv/bin/python tools/bench/startup.py [--runs=2] [--out=DIR]

Each run is its own process with JAXSERVE_CACHE pointing at a temporary folder that links the user's fetched
models (the user's cache is not otherwise touched). `generate`: launch to exit, 16 greedy tokens after a short
plain prompt. `serve`: launch to both interfaces listening (with its default quick start: the first requests'
programs compiled, the cost model loaded if cached), then a first 16-token completion over HTTP. The table
goes to stdout and, with --out, to DIR/startup.json.
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

from jaxserve.models import registry

flags.DEFINE_integer("runs", 2, "generate runs after the first (each with the caches the earlier ones left)")
flags.DEFINE_string("out", None, "write startup.json here")
flags.DEFINE_string("model", None, "the model (default: jaxserve's)")
FLAGS = flags.FLAGS

PROMPT = "Write one sentence about the sea."


def model_flags() -> list[str]:
    return [f"--model={FLAGS.model}"] if FLAGS.model else []


def timed_generate() -> tuple[float, None]:
    """Seconds from launch to exit (no first reply to time apart)."""
    args = [sys.executable, "-m", "jaxserve", "generate", f"--prompt={PROMPT}", "--max_tokens=16", "--nochat"]
    start = time.perf_counter()
    proc = subprocess.run(args + model_flags(), capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"generate failed:\n{proc.stderr[-3000:]}")
    return seconds, None


def timed_serve() -> tuple[float, float]:
    """Seconds from launch to listening, and then to a first completion's whole reply (16 tokens)."""
    import openai

    from jaxserve.server.spawn import ServerProcess

    start = time.perf_counter()
    server = ServerProcess(*model_flags())
    ready = time.perf_counter()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none")
    client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=16, temperature=0)
    replied = time.perf_counter()
    server.stop()
    return ready - start, replied - ready


def as_installed(cache: str, models: pathlib.Path) -> None:
    """`cache` as install.sh leaves one: the fetched `models` (linked from the user's cache), nothing else."""
    if models.is_dir():
        (pathlib.Path(cache) / "models").symlink_to(models)


def main(argv: list[str]) -> None:
    del argv
    rows = []
    models = registry.cache_dir() / "models"  # the user's, before JAXSERVE_CACHE points elsewhere
    for command, timed, runs in (("generate", timed_generate, 1 + FLAGS.runs), ("serve", timed_serve, 2)):
        with tempfile.TemporaryDirectory() as cache:  # each command starts from its own fresh cache
            as_installed(cache, models)
            os.environ["JAXSERVE_CACHE"] = cache
            for i in range(runs):
                rows.append((command, "as installed" if i == 0 else f"run {i + 1}", *timed()))
                reply = f"   first reply {rows[-1][3]:5.1f} s later" if rows[-1][3] is not None else ""
                print(f"{command:9s} {rows[-1][1]:13s} {rows[-1][2]:6.1f} s{reply}", flush=True)
    if FLAGS.out:
        out = pathlib.Path(FLAGS.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "startup.json").write_text(
            json.dumps(
                [
                    dict(command=c, caches=k, seconds=round(s, 3), first_reply_seconds=r and round(r, 3))
                    for c, k, s, r in rows
                ],
                indent=1,
            )
        )


if __name__ == "__main__":
    app.run(main)
