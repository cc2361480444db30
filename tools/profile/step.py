"""One decode step under jax.profiler: wall time, device-busy time, and the kernels that take it.

    .venv/bin/python tools/profile/step.py --model=random:llama3-8b --dtype=bfloat16 --out=bench_out/step_profile
    .venv/bin/python tools/profile/step.py --model=random:tiny --rows=1,4 --out=/tmp/step_profile   # CPU smoke

For each --rows, the engine's decode program of that many rows runs warm, then --steps steps under
`jax.profiler.trace`. The trace (a Perfetto JSON, kept in --out/b<rows>/) gives each kernel's time: on a GPU the
device's, on a CPU the host threads' XLA ops. Printed per row count: wall ms a step, device-busy ms a step (the
kernels' sum: the gap is the device waiting), and the top kernel kinds with their launches a step (a kind: the
name less its numeric suffix, the layers' copies together); summary.json holds the same. Absolute times
mean something on a GPU only.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import pathlib
import re
import statistics
import time

import jax
from absl import app, flags

import jaxserve
from jaxserve import xla_flags
from jaxserve.engine import batch
from jaxserve.engine.profile import synthetic_row

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "random:llama3-8b", "Model name or path.")
flags.DEFINE_string("dtype", "bfloat16", "float32 or bfloat16.")
flags.DEFINE_string("quantization", None, "Weights kept quantized (int8, int4, fp8), as LLM's quantization.")
flags.DEFINE_list("rows", ["1", "16"], "Decode rows of the profiled steps.")
flags.DEFINE_integer("context", 512, "Tokens of context each row attends to.")
flags.DEFINE_integer("steps", 5, "Profiled steps per row count.")
flags.DEFINE_integer("top", 15, "Kernels listed.")
flags.DEFINE_string("out", "bench_out/step_profile", "Folder for the traces and summary.json.")


def kernel_times(trace_dir: pathlib.Path) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """Microseconds and launches per kernel kind in the trace: the device's events where there is a device, else
    the host's XLA ops (not Python frames, not the runtime's own calls). A kind is a name less its numeric suffix,
    so an unrolled model's 32 per-layer copies of a fusion count as one."""
    path = next(trace_dir.rglob("perfetto_trace.json.gz"))
    events = json.loads(gzip.decompress(path.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid for pid, name in names.items() if name.startswith("/device:")}
    times: collections.Counter[str] = collections.Counter()
    launches: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.get("ph") != "X":
            continue
        name = e["name"]
        if devices:
            keep = e["pid"] in devices
        else:
            keep = not name.startswith("$") and "::" not in name and "(" not in name and " " not in name
        if keep:
            kind = re.sub(r"[._]\d+$", "", name)
            times[kind] += e.get("dur", 0.0)
            launches[kind] += 1
    return times, launches


def profile_rows(llm: jaxserve.LLM, rows: int, out: pathlib.Path) -> dict:
    runner = llm.engine.runner
    bs, nb = runner.block_size, runner.num_blocks
    per_row = -(-(FLAGS.context + 1) // bs)
    step = [synthetic_row(1, FLAGS.context, 1 + i * per_row, bs, nb) for i in range(rows)]
    arrays = batch.pack(step, runner.buckets, bs)
    for _ in range(3):  # compile and warm
        runner.execute_arrays(arrays)
    walls = []
    with jax.profiler.trace(str(out), create_perfetto_trace=True):
        for _ in range(FLAGS.steps):
            start = time.perf_counter()
            runner.execute_arrays(arrays)
            walls.append(time.perf_counter() - start)
    times, launches = kernel_times(out)
    busy = sum(times.values()) / FLAGS.steps / 1e3
    top = [
        {
            "kernel": k,
            "ms_per_step": v / FLAGS.steps / 1e3,
            "launches_per_step": launches[k] / FLAGS.steps,
            "share": v / max(sum(times.values()), 1e-9),
        }
        for k, v in times.most_common(FLAGS.top)
    ]
    return {
        "rows": rows,
        "wall_ms": statistics.median(walls) * 1e3,
        "busy_ms": busy,
        "launches": sum(launches.values()) / FLAGS.steps,
        "top": top,
    }


def main(argv: list[str]) -> None:
    del argv
    xla_flags.for_gpu(os.environ)  # the launcher's flags, before JAX starts its backend
    rows = [int(r) for r in FLAGS.rows]
    out = pathlib.Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = jaxserve.LLM(
        FLAGS.model,
        dtype=FLAGS.dtype,
        quantization=FLAGS.quantization,
        max_num_seqs=max(rows),
        max_model_len=4 * FLAGS.context,
        enable_prefix_caching=False,
        progress=False,
    )
    summary = {
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "model": FLAGS.model,
        "dtype": FLAGS.dtype,
        "context": FLAGS.context,
        "steps": [],
    }
    for r in rows:
        found = profile_rows(llm, r, out / f"b{r}")
        summary["steps"].append(found)
        print(
            f"batch {r}: wall {found['wall_ms']:.2f} ms a step, device busy {found['busy_ms']:.2f} ms, "
            f"{found['launches']:.0f} kernels"
        )
        for k in found["top"]:
            print(
                f"  {k['ms_per_step']:8.3f} ms  {100 * k['share']:5.1f}%  {k['launches_per_step']:6.1f}x  "
                f"{k['kernel'][:80]}"
            )
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    app.run(main)
