"""What share of a decode step is the attention: the engine's decode tokens/s as it is, and again with the paged
attention replaced by a stand-in of the same shapes that reads no key (its outputs are wrong; only time counts).

    .venv/bin/python tools/profile/attention_share.py [--rows=1,16] [--repeats=3]

Each mode runs in its own process (the stand-in is patched in before anything compiles), timed as
tools/bench/generate.py times decode: rows x (N - 1) / (t(N tokens) - t(1 token)), 32-token random prompts,
medians of --repeats. On a CPU the attention is the jnp reference (reference.tiled_paged_attention).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("rows", ["1", "16"], "Decode batch sizes.")
flags.DEFINE_integer("repeats", 3, "Timed repetitions; the median is reported.")
flags.DEFINE_integer("decode_tokens", 64, "Tokens generated per request.")
flags.DEFINE_string("model", "smollm2-135m-instruct", "Model name or path.")
flags.DEFINE_enum("child", None, ["plain", "stand_in"], "(internal) measure one mode in this process.")


def _stand_in(q, q_pos, k_cache, v_cache, tables, *, block_size, key_block, window=None):
    """The reference attention's shapes and dtypes, no key read."""
    return q * 0.5, jnp.zeros(q.shape[:3], jnp.float32)


def decode_rates() -> dict[int, float]:
    """Decode tokens/s at each of --rows, in this process."""
    import jaxserve
    from jaxserve import SamplingParams

    llm = jaxserve.LLM(FLAGS.model, max_model_len=2048, progress=False)
    rng = np.random.default_rng(0)
    rates = {}
    for rows in map(int, FLAGS.rows):
        prompts = [rng.integers(100, 20000, 32).tolist() for _ in range(rows)]

        def run(n: int) -> float:
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
            return time.perf_counter() - start

        run(FLAGS.decode_tokens), run(1)  # compiles
        full = statistics.median(run(FLAGS.decode_tokens) for _ in range(FLAGS.repeats))
        first = statistics.median(run(1) for _ in range(FLAGS.repeats))
        rates[rows] = rows * (FLAGS.decode_tokens - 1) / (full - first)
    return rates


def main(argv):
    if FLAGS.child:
        if FLAGS.child == "stand_in":
            from jaxserve.pallas_kernels import reference

            reference.tiled_paged_attention = _stand_in
        print(json.dumps(decode_rates()))
        return
    results = {}
    for child in ("plain", "stand_in"):
        settings = [
            f"--{k}={','.join(v) if isinstance(v, list) else v}"
            for k, v in (
                ("rows", FLAGS.rows),
                ("repeats", FLAGS.repeats),
                ("decode_tokens", FLAGS.decode_tokens),
                ("model", FLAGS.model),
            )
        ]
        out = subprocess.run(
            [sys.executable, __file__, *settings, f"--child={child}"], check=True, capture_output=True, text=True
        ).stdout
        results[child] = json.loads(out.strip().splitlines()[-1])  # the child's last line: {rows: tok/s}
    print(f"{'rows':>5} {'tok/s':>9} {'no attention':>13} {'ms a step':>10} {'attention ms':>13} {'share':>6}")
    for key, rate in results["plain"].items():
        rows, bare = int(key), results["stand_in"][key]
        step, saved = rows / rate * 1e3, rows / rate * 1e3 - rows / bare * 1e3
        print(f"{rows:>5} {rate:>9.1f} {bare:>13.1f} {step:>10.2f} {saved:>13.2f} {saved / step:>6.0%}")


if __name__ == "__main__":
    app.run(main)
