"""Multi-step decode on this machine: single decode steps against bursts, in one process taking turns (a CPU's
speed drifts from minute to minute, so only an A/B inside one run resolves a few percent).

    .venv/bin/python tools/bench/bursts.py [--weights=float32,gguf] [--rows=1,16] [--decode_tokens=64] \
        [--repeats=6] [--num_scheduler_steps=8] [--short_prompt=32] [--out=bench_out/bursts.json]

One `LLM` of the default model per --weights (float32, and its Q4_1 blocks kept: `--quantization=gguf`), built
with bursts of up to --num_scheduler_steps; its scheduler then plans single steps or bursts in turn between
generates. Decode tok/s = rows x (n - 1) / (t(n) - t(1)) over n = --decode_tokens, medians over --repeats (as
tools/bench/generate.py measures). The greedy tokens of both ways must be equal.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import time

from absl import app, flags
from tqdm import tqdm

import jaxserve
from jaxserve import SamplingParams, config
from generate import prompts

FLAGS = flags.FLAGS
flags.DEFINE_list("weights", ["float32", "gguf"], "float32, or a --quantization method (its blocks kept).")
flags.DEFINE_list("rows", ["1", "16"], "Requests decoding together.")
FLAGS.set_default("repeats", 6)  # and generate's --decode_tokens, --short_prompt, --num_scheduler_steps, --out


def main(argv: list[str]) -> None:
    del argv
    rows = [int(r) for r in FLAGS.rows]
    steps = {"single": 1, "bursts": FLAGS.num_scheduler_steps or config.CPU_BURST_STEPS}
    llms = {
        w: jaxserve.LLM(
            max_model_len=2048,
            max_num_seqs=max(rows),
            enable_prefix_caching=False,
            num_scheduler_steps=steps["bursts"],
            quantization=None if w == "float32" else w,
            progress=False,
        )
        for w in FLAGS.weights
    }
    batches = {r: prompts(r, FLAGS.short_prompt, r) for r in rows}

    def run(w: str, r: int, way: str, n: int) -> tuple[float, list[list[int]]]:
        llms[w].engine.scheduler.num_scheduler_steps = steps[way]
        start = time.perf_counter()
        outs = llms[w].generate(batches[r], SamplingParams(max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start, [o.token_ids for o in outs]

    cases = [(w, r, way) for w in llms for r in rows for way in steps]
    for w in llms:  # compile every program used below; check the tokens agree
        for r in rows:
            tokens = {way: run(w, r, way, FLAGS.decode_tokens)[1] for way in steps}
            if tokens["single"] != tokens["bursts"]:
                raise SystemExit(f"{w}, {r} rows: bursts sampled other greedy tokens than single steps")
            for way in steps:
                run(w, r, way, 1)
    times: dict[tuple[str, int, str, int], list[float]] = {}
    with tqdm(total=FLAGS.repeats * len(cases) * 2, desc="bursts") as bar:
        for _ in range(FLAGS.repeats):
            for case in cases:
                for n in (1, FLAGS.decode_tokens):
                    times.setdefault((*case, n), []).append(run(*case, n)[0])
                    bar.update()
    n = FLAGS.decode_tokens
    results = {
        f"{w} {r} rows {way}": r
        * (n - 1)
        / (statistics.median(times[w, r, way, n]) - statistics.median(times[w, r, way, 1]))
        for w, r, way in cases
    }
    print(f"| weights | rows | single steps, tok/s | bursts of up to {steps['bursts']}, tok/s |")
    print("|---|---:|---:|---:|")
    for w in llms:
        for r in rows:
            single, bursts = results[f"{w} {r} rows single"], results[f"{w} {r} rows bursts"]
            print(f"| {w} | {r} | {single:.1f} | {bursts:.1f} ({bursts / single - 1:+.0%}) |")
    if FLAGS.out:
        pathlib.Path(FLAGS.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(FLAGS.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    app.run(main)
