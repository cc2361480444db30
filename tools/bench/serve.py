"""Load benchmark of the OpenAI-compatible HTTP API with aiperf (NVIDIA's LLM load generator, from PyPI).

Starts `python -m jaxserve serve`, then for each concurrency runs aiperf against /v1/chat/completions with
streaming: fixed-length synthetic prompts (--isl tokens) and exactly --osl generated tokens (ignore_eos),
`concurrency` warm-up requests first, then 3 x concurrency measured requests (at least 8). With --baseline=COMMIT
the server of that commit (a temporary git worktree) is measured the same way first, in the same run, and the
ratios are printed. Prints TTFT, inter-token latency and throughput; writes docs/figures/serve.json and
serve_load.png.

aiperf lives in its own environment (it pulls in transformers), and reads the tokenizer from a local folder
this script writes from jaxserve's model cache, so nothing needs the network:

    python3 -m venv .venv-bench && .venv-bench/bin/pip install aiperf==0.13.0
    .venv/bin/python tools/bench/serve.py [--aiperf=.venv-bench/bin/aiperf] [--concurrency=1,8,32] [--baseline=2b63ecb]
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from absl import app, flags  # noqa: E402
from tqdm import tqdm  # noqa: E402

from jaxserve.models import registry  # noqa: E402
from jaxserve.server.spawn import ServerProcess  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("aiperf", ".venv-bench/bin/aiperf", "The aiperf executable.")
flags.DEFINE_list("concurrency", ["1", "8", "32"], "Concurrent streams, one aiperf run each.")
flags.DEFINE_integer("isl", 128, "Synthetic prompt tokens (the chat template adds its own on the server).")
flags.DEFINE_integer("osl", 64, "Generated tokens per request.")
flags.DEFINE_integer("max_num_seqs", 32, "Server's running batch.")
flags.DEFINE_string("out", "docs/figures", "Folder for serve.json and serve_load.png.")
flags.DEFINE_string("baseline", "", "A commit whose server is measured first, beside the current one.")

API_KEY = "bench"
METRICS = {  # aiperf summary tag -> statistics kept
    "time_to_first_token": ("p50", "p99", "avg"),
    "inter_token_latency": ("p50", "p99", "avg"),
    "request_latency": ("p50", "p99"),
    "request_throughput": ("avg",),
    "output_token_throughput": ("avg",),
    "input_sequence_length": ("avg",),
    "output_sequence_length": ("avg",),
    "request_count": ("avg",),
}


def hf_tokenizer_dir(model: str, out: pathlib.Path) -> pathlib.Path:
    """A transformers AutoTokenizer folder (what aiperf loads) from the tokenizer jaxserve cached for `model`."""
    stem = registry.resolve(model).stem
    cached = sorted((registry.cache_dir() / "converted").glob(f"{stem}-float32-*/tokenizer.json"))
    if not cached:
        raise FileNotFoundError(f"no converted tokenizer for {model}: run `python -m jaxserve generate` once")
    meta = json.loads((cached[-1].parent / "jaxserve_tokenizer.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(cached[-1], out / "tokenizer.json")
    specials = meta["special_tokens"]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": meta["chat_template"],
        "add_bos_token": meta["add_bos"],
        "model_max_length": 1 << 20,
        **{k: specials[k] for k in ("bos_token", "eos_token") if k in specials},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def server_flags() -> list[str]:
    return [
        f"--max_num_seqs={FLAGS.max_num_seqs}",
        "--max_model_len=2048",
        "--kv_cache_gib=0.5",
        f"--api_key={API_KEY}",
    ]


def worktree(commit: str, where: pathlib.Path) -> pathlib.Path:
    """A checkout of `commit` with its gRPC stubs generated (they are build outputs, not in git)."""
    subprocess.run(["git", "worktree", "add", "--detach", str(where), commit], check=True, capture_output=True)
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import pathlib; from jaxserve.server import protogen; "
            "protogen.generate(pathlib.Path('.'), pathlib.Path('.'))",
        ],
        cwd=where,
        check=True,
        env={**os.environ, "PYTHONPATH": str(where)},
    )
    return where


def run_aiperf(port: int, tokenizer: pathlib.Path, concurrency: int, out: pathlib.Path) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    # (aiperf 0.13 sends a local tokenizer path to the hub downloader when offline mode is set)
    cmd = [
        FLAGS.aiperf,
        "profile",
        "--model",
        registry.DEFAULT_MODEL,
        "--tokenizer",
        str(tokenizer),
        "--url",
        f"http://127.0.0.1:{port}",
        "--endpoint-type",
        "chat",
        "--streaming",
        "--api-key",
        API_KEY,
        "--isl",
        str(FLAGS.isl),
        "--isl-stddev",
        "0",
        "--osl",
        str(FLAGS.osl),
        "--osl-stddev",
        "0",
        "--extra-inputs",
        "ignore_eos:true",
        "--concurrency",
        str(concurrency),
        "--warmup-request-count",
        str(concurrency),
        "--request-count",
        str(max(8, 3 * concurrency)),
        "--random-seed",
        "0",
        "--ui",
        "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--artifact-dir",
        str(out),
    ]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    return {f"{tag}_{stat}": summary[tag][stat] for tag, stats in METRICS.items() for stat in stats}


def plot(rows: list[dict], path: pathlib.Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for engine in dict.fromkeys(r["engine"] for r in rows):
        mine = [r for r in rows if r["engine"] == engine]
        c = [r["concurrency"] for r in mine]
        for ax, tag in ((axes[0], "time_to_first_token"), (axes[1], "inter_token_latency")):
            ax.plot(c, [r[f"{tag}_p50"] for r in mine], "o-", label=f"{engine} p50")
            ax.plot(c, [r[f"{tag}_p99"] for r in mine], "s--", label=f"{engine} p99")
        axes[2].plot(c, [r["output_token_throughput_avg"] for r in mine], "o-", label=engine)
    for ax, label in zip(axes, ("TTFT (ms)", "inter-token latency (ms)", "output tokens/s")):
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    fig.suptitle(f"jaxserve HTTP API under aiperf (CPU, {registry.DEFAULT_MODEL}, {FLAGS.isl} in / {FLAGS.osl} out)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def measure(engine: str, pythonpath: str | None, tokenizer: pathlib.Path, tmp: pathlib.Path) -> list[dict]:
    rows = []
    with ServerProcess(*server_flags(), pythonpath=pythonpath) as server:
        for c in tqdm([int(x) for x in FLAGS.concurrency], desc=f"{engine}: concurrency"):
            rows.append(
                {
                    "engine": engine,
                    "concurrency": c,
                    **run_aiperf(server.http_port, tokenizer, c, tmp / f"{engine}-c{c}"),
                }
            )
    return rows


def main(argv: list[str]) -> None:
    del argv
    if not shutil.which(FLAGS.aiperf):
        raise SystemExit(f"aiperf not found at {FLAGS.aiperf}; see this script's docstring to install it")
    out = pathlib.Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = pathlib.Path(tmp_name)
        tokenizer = hf_tokenizer_dir(registry.DEFAULT_MODEL, tmp / "tokenizer")
        if FLAGS.baseline:
            tree = worktree(FLAGS.baseline, tmp / "baseline")
            try:
                rows += measure(FLAGS.baseline, str(tree), tokenizer, tmp)
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], check=False)
        rows += measure("current", None, tokenizer, tmp)
    print(
        f"{'engine':>8} {'conc':>4} {'TTFT p50/p99 ms':>16} {'ITL p50/p99 ms':>15} {'e2e p50 s':>9} {'req/s':>6} "
        f"{'out tok/s':>9}"
    )
    for r in rows:
        print(
            f"{r['engine']:>8} {r['concurrency']:>4} {r['time_to_first_token_p50']:>7.0f}/"
            f"{r['time_to_first_token_p99']:<8.0f} {r['inter_token_latency_p50']:>7.1f}/"
            f"{r['inter_token_latency_p99']:<7.1f} {r['request_latency_p50'] / 1e3:>9.2f} "
            f"{r['request_throughput_avg']:>6.2f} {r['output_token_throughput_avg']:>9.1f}"
        )
    if FLAGS.baseline:
        base = {r["concurrency"]: r for r in rows if r["engine"] == FLAGS.baseline}
        for r in (r for r in rows if r["engine"] == "current"):
            b = base[r["concurrency"]]
            print(
                f"concurrency {r['concurrency']}: p99 TTFT current / {FLAGS.baseline} = "
                f"{r['time_to_first_token_p99'] / b['time_to_first_token_p99']:.3f}; output tok/s "
                f"{r['output_token_throughput_avg'] / b['output_token_throughput_avg']:.2f}x"
            )
    (out / "serve.json").write_text(
        json.dumps(
            {
                "isl": FLAGS.isl,
                "osl": FLAGS.osl,
                "max_num_seqs": FLAGS.max_num_seqs,
                "baseline": FLAGS.baseline,
                "rows": rows,
            },
            indent=1,
        )
    )
    plot(rows, out / "serve_load.png")
    print(f"wrote {out}/serve.json and {out}/serve_load.png")


if __name__ == "__main__":
    app.run(main)
