"""How well the engine's measured cost model (sched.batch_cost.EngineStepCost, from engine/profile.py) predicts
the time of mixed steps it was not measured on: prefill chunks of several prompts, decodes, long and short
contexts together, in every row bucket. Each case is timed as the profile times a step (one call of the
compiled step, median of --repeats after a warm call) and set beside the model's prediction; the ratio is what
the scheduler's packer and the simulator's replay get wrong. Writes docs/figures/cost_model.json.

    .venv/bin/python tools/bench/cost_model.py [--max_num_seqs=32] [--max_model_len=2048] [--cost_profile=FILE]
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
from absl import app, flags
from tqdm import tqdm

from jaxserve.api import LLM
from jaxserve.engine.profile import median_time, synthetic_row

FLAGS = flags.FLAGS
flags.DEFINE_integer("max_num_seqs", 32, "Engine's running batch.")
flags.DEFINE_integer("max_model_len", 2048, "Engine's context.")
flags.DEFINE_float("kv_cache_gib", 0.5, "Engine's KV pool.")
flags.DEFINE_string("cost_profile", None, "Cost profile to load (default: the cached one, measured if missing).")
flags.DEFINE_integer("repeats", 3, "Timed calls per case.")
flags.DEFINE_string("out", "docs/figures", "Where cost_model.json goes.")

# (name, prefill chunks as (tokens, history), decode contexts)
CASES = [
    ("prefill 64", [(64, 0)], []),
    ("prefill 480", [(480, 0)], []),
    ("3 prompts of 158", [(158, 0)] * 3, []),
    ("prefill 64 + 31 decodes at 64", [(64, 0)], [64] * 31),
    ("prefill 480 + 31 decodes at 64", [(480, 0)], [64] * 31),
    ("3 prompts of 158 + 20 decodes at 300", [(158, 0)] * 3, [300] * 20),
    ("32 decodes at 64", [], [64] * 32),
    ("32 decodes at 1024", [], [1024] * 32),
    ("32 decodes: one at 1900, 31 at 64", [], [1900] + [64] * 31),
    ("8 decodes at 500", [], [500] * 8),
    ("late chunk 32 after 1500", [(32, 1500)], []),
    ("late chunk 256 after 1024 + 8 decodes", [(256, 1024)], [64] * 8),
    ("late chunk 32 after 1500 + 3 prompts of 128", [(32, 1500)] + [(128, 0)] * 3, []),
    ("late chunk 128 after 1400 + 2 prompts + 16 decodes", [(128, 1400), (100, 0), (60, 0)], [200] * 16),
]


def main(argv: list[str]) -> None:
    del argv
    llm = LLM(
        max_num_seqs=FLAGS.max_num_seqs,
        max_model_len=FLAGS.max_model_len,
        kv_cache_gib=FLAGS.kv_cache_gib,
        cost_profile=FLAGS.cost_profile,
        warmup=True,
    )
    runner, cost = llm.engine.runner, llm.builder.cost
    bs, nb = runner.block_size, runner.num_blocks
    rows_out = []
    for name, prefills, decodes in tqdm(CASES, desc="time mixed steps", unit="case"):
        rows, at = [], 1  # each row in blocks of its own
        for n, h in prefills + [(1, kv - 1) for kv in decodes]:
            rows.append(synthetic_row(n, h, at, bs, nb))
            at += -(-(h + n) // bs)
        live = median_time(lambda: runner.execute(rows), FLAGS.repeats)
        model = cost.batch_time(prefills, decodes)
        tokens = sum(n for n, _ in prefills) + len(decodes)
        rows_out.append(
            {
                "case": name,
                "bucket": list(runner.buckets.fit_step(tokens, len(rows))),
                "live_s": live,
                "model_s": model,
                "ratio": live / model,
            }
        )
    print(f"{'case':52s} {'bucket':>10s} {'live ms':>9s} {'model ms':>9s} {'live/model':>10s}")
    for r in rows_out:
        print(
            f"{r['case']:52s} {str(tuple(r['bucket'])):>10s} {r['live_s'] * 1e3:9.1f} {r['model_s'] * 1e3:9.1f} "
            f"{r['ratio']:10.2f}"
        )
    ratios = np.array([r["ratio"] for r in rows_out])
    print(f"live/model: median {np.median(ratios):.2f}, range {ratios.min():.2f}-{ratios.max():.2f}")
    out = pathlib.Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cost_model.json").write_text(json.dumps({"cost": cost.to_dict(), "cases": rows_out}, indent=1))
    print(f"wrote {out}/cost_model.json")


if __name__ == "__main__":
    app.run(main)
