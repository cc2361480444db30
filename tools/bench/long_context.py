"""Long contexts on CPU devices: prefill time, time to first token, decode speed and KV bytes per device at 8K-128K
tokens, for one device, one engine of --kvp=8 sets on 8 devices, and a CDSP pool of 4 instances feeding one decode
instance of --decode_kvp=4 (8 devices), with random:tiny-1m (2 layers, 4 heads of 16, positions to 1M). Beside it,
the simulator's decode time per token at 1M-10M tokens with Medha's KV-parallel layout against a 30 ms TBT SLO.

    .venv/bin/python tools/bench/long_context.py [--lengths=8192,32768,131072] [--layouts=one,kvp8,cdsp4]
                                                 [--longest=cdsp4:32768] [--out=bench_out/long_context]

Each (layout, length) runs in its own process (XLA_FLAGS gives it 1 or 8 CPU devices), so start-up, memory and
compiles do not carry over; the prompt is the same random ids for every layout at a length, and each layout's
greedy tokens are checked against one device's. Prefill times are fitted as a host cost per chunk plus the
attention's quadratic term plus a linear one (least squares over the lengths), to show where time goes. Writes
results.json, a table (table.md) and a plot of prefill time against length (prefill.png) to --out.
docs/BENCHMARKS.md "Long contexts" has today's figures.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("lengths", ["8192", "32768", "131072"], "Prompt lengths, tokens.")
flags.DEFINE_list(
    "layouts",
    ["one", "kvp8", "cdsp4"],
    "one: one device; kvp8: --kvp=8 on 8 devices; cdsp4: a "
    "CDSP pool of 4 instances and a decode instance of --decode_kvp=4.",
)
flags.DEFINE_list(
    "longest",
    ["cdsp4:32768"],
    "LAYOUT:TOKENS: the longest prompt a layout runs (one device at 128K "
    "takes over 10 minutes on 2 cores; the CDSP pool's 8 devices in one process share them).",
)
flags.DEFINE_integer("decode_tokens", 32, "Tokens generated after the prompt (decode speed over all but the first).")
flags.DEFINE_integer("chunk", 2048, "--max_num_batched_tokens: the tokens of a prefill chunk (one engine's step).")
flags.DEFINE_string("out", "bench_out/long_context", "Folder for results.json, table.md and prefill.png.")
flags.DEFINE_string("child", None, "Internal: run one LAYOUT:LENGTH case and print its JSON.")

MODEL = "random:tiny-1m"
DEVICES = {"one": 1, "kvp8": 8, "cdsp4": 8}
MARGIN = 1024  # tokens of KV room past the prompt and its decode


def _settings(layout: str, length: int) -> dict:
    context = length + FLAGS.decode_tokens + MARGIN
    # every program compiled first (and the engine's cost profile measured, once a machine): no compile is timed
    common = dict(
        max_model_len=context,
        max_num_batched_tokens=FLAGS.chunk,
        max_num_seqs=4,
        warmup=True,
        quick_start=False,
        progress=False,
    )
    if layout == "one":
        return dict(common, kv_cache_tokens=context)
    if layout == "kvp8":
        return dict(common, kvp=8, kv_cache_tokens=-(-context // 8))
    per_device = -(-context // 4)  # a pool store and a decode set each hold a quarter of the context
    # Eq. (1) measured once, on the first (shortest) case's pool, and reused for the longer ones
    return dict(
        common,
        prefill_instances=4,
        node_size=2,
        decode_instances=1,
        decode_kvp=4,
        kv_cache_tokens=per_device,
        min_chunk=1024,
        prefill_profile=str(pathlib.Path(FLAGS.out) / "eq1.json"),
    )


def _kv_bytes_per_device(llm) -> dict[str, int]:
    """KV bytes allocated on each device: the engines' paged caches and the prefill pool's history stores."""
    engines = getattr(llm.engine, "decoders", None)
    arrays = []
    for e in [d.engine for d in engines] if engines is not None else [llm.engine]:
        arrays += list(e.runner.caches)
    if hasattr(llm.engine, "prefill"):
        arrays += [x for s in llm.engine.prefill.stores.values() for x in (s.k, s.v)]
    out: dict[str, int] = {}
    for a in arrays:
        for shard in a.addressable_shards:
            out[str(shard.device.id)] = out.get(str(shard.device.id), 0) + shard.data.nbytes
    return out


def run_case(layout: str, length: int) -> dict:
    import jaxserve
    from jaxserve.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = jaxserve.LLM(MODEL, **_settings(layout, length))
    built = time.perf_counter() - start
    ids = np.random.default_rng(length).integers(10, 512, length).tolist()
    params = SamplingParams(max_tokens=FLAGS.decode_tokens, ignore_eos=True)
    times, tokens = [], []
    start = time.perf_counter()
    for out in llm.stream(ids, params):
        if out.new_token_ids:
            times += [time.perf_counter() - start] * len(out.new_token_ids)
            tokens += out.new_token_ids
    kv = _kv_bytes_per_device(llm)
    events = dict(getattr(llm.engine, "events", {}))
    return {
        "layout": layout,
        "length": length,
        "start_s": built,
        "ttft_s": times[0],
        "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None,
        "tokens": tokens,
        "kv_bytes_per_device": kv,
        "kv_bytes_total": sum(kv.values()),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "chunks": events.get("chunks", -(-length // FLAGS.chunk)),
        "events": events,
    }


def _spawn(layout: str, length: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES[layout]}")
    cmd = [
        sys.executable,
        __file__,
        f"--child={layout}:{length}",
        f"--decode_tokens={FLAGS.decode_tokens}",
        f"--chunk={FLAGS.chunk}",
        f"--out={FLAGS.out}",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{layout} at {length} tokens failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fit_prefill(rows: list[dict]) -> dict | None:
    """Prefill time (TTFT) = a * chunks + b * n^2, least squares over one layout's lengths (a host cost per chunk
    and the attention's quadratic term; the tiny model's linear work is small beside them), with the fit's worst
    relative miss."""
    if len(rows) < 3:
        return None
    x = np.array([[r["chunks"], r["length"] ** 2] for r in rows], float)
    y = np.array([r["ttft_s"] for r in rows])
    (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
    return {
        "per_chunk_s": a,
        "per_token_pair_s": b,
        "worst_miss": float(np.max(np.abs(x @ [a, b] - y) / y)),
        "quadratic_share_at_longest": b * rows[-1]["length"] ** 2 / rows[-1]["ttft_s"],
    }


def simulated() -> list[dict]:
    """Medha's decode-only time per token of one 1M or 10M-token context (Llama-3-8B, TP8 A100 profile) spread
    evenly over 1-16 KV-parallel workers, the simulator's cost model."""
    from jaxserve.sched.profiles import ProfileBatchCost

    rows = []
    for context in (1 << 20, 10 << 20):
        for kvp in (1, 2, 4, 8, 16):
            cost = ProfileBatchCost("a100_llama3_8b", tp=8, kvp=kvp, kvp_tokens=-(-context // kvp))
            tpot = cost.batch_time([], [context])
            rows.append({"kvp": kvp, "context": context, "tpot": tpot, "meets_30ms": tpot <= 0.030})
    return rows


def table(rows: list[dict], fits: dict, sim: list[dict]) -> str:
    lines = [
        "| layout | tokens | prefill (TTFT) s | decode tok/s | KV MiB per device (max) | KV MiB total | "
        "peak RSS GiB | greedy = one device |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    ref = {r["length"]: r["tokens"] for r in rows if r["layout"] == "one"}
    for r in rows:
        same = (
            "(itself)"
            if r["layout"] == "one"
            else "-"
            if r["length"] not in ref
            else "yes"
            if ref[r["length"]] == r["tokens"]
            else "NO"
        )
        lines.append(
            f"| {r['layout']} | {r['length']:,} | {r['ttft_s']:.1f} | {r['decode_tok_s'] or 0:.1f} | "
            f"{max(r['kv_bytes_per_device'].values()) / 2**20:.1f} | {r['kv_bytes_total'] / 2**20:.1f} | "
            f"{r['peak_rss_gib']:.2f} | {same} |"
        )
    lines += [
        "",
        "| layout | per chunk s | per token pair ns | worst miss | quadratic share at the longest |",
        "|---|---:|---:|---:|---:|",
    ]
    for layout, f in fits.items():
        if f:
            lines.append(
                f"| {layout} | {f['per_chunk_s']:.3f} | {f['per_token_pair_s'] * 1e9:.3f} | "
                f"{f['worst_miss']:.0%} | {f['quadratic_share_at_longest']:.0%} |"
            )
    lines += ["", "| simulated: KVP workers | context | decode s/token | within 30 ms |", "|---:|---:|---:|---|"]
    for r in sim:
        meets = "yes" if r["meets_30ms"] else "no"
        lines.append(f"| {r['kvp']} | {r['context']:,} | {r['tpot'] * 1e3:.1f} ms | {meets} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for layout in dict.fromkeys(r["layout"] for r in rows):
        mine = [r for r in rows if r["layout"] == layout]
        ax.loglog([r["length"] for r in mine], [r["ttft_s"] for r in mine], "o-", label=layout)
    longest = max(rows, key=lambda r: (r["length"], r["layout"] == "one"))
    n = np.array(sorted({r["length"] for r in rows}), float)
    ax.loglog(n, longest["ttft_s"] * (n / longest["length"]) ** 2, "k:", label="n^2 through the longest")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill (time to first token), s")
    ax.set_title(f"{MODEL} on CPU devices")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv):
    del argv
    if FLAGS.child:
        layout, length = FLAGS.child.split(":")
        print(json.dumps(run_case(layout, int(length))))
        return
    from tqdm import tqdm

    out = pathlib.Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    longest = {lay: int(n) for lay, n in (x.split(":") for x in FLAGS.longest)}
    cases = [(lay, int(n)) for n in FLAGS.lengths for lay in FLAGS.layouts if int(n) <= longest.get(lay, int(n))]
    rows = []
    for layout, length in tqdm(cases, desc="long-context cases", unit="case"):
        rows.append(_spawn(layout, length))
        (out / "results.json").write_text(json.dumps(rows, indent=1))
    rows.sort(key=lambda r: (FLAGS.layouts.index(r["layout"]), r["length"]))
    fits = {lay: fit_prefill([r for r in rows if r["layout"] == lay]) for lay in FLAGS.layouts}
    sim = simulated()
    (out / "results.json").write_text(json.dumps({"cases": rows, "fits": fits, "simulated": sim}, indent=1))
    text = table(rows, fits, sim)
    (out / "table.md").write_text(text + "\n")
    plot(rows, out / "prefill.png")
    print(text)


if __name__ == "__main__":
    app.run(main)
