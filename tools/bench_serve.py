"""Load benchmark of the OpenAI-compatible HTTP API with aiperf (NVIDIA's LLM load generator, from PyPI).

Starts `python -m jaxserve serve`, then for each concurrency runs aiperf against /v1/chat/completions with
streaming: fixed-length synthetic prompts (--isl tokens) and exactly --osl generated tokens (ignore_eos),
`concurrency` warm-up requests first (they compile the step shapes), then 3 x concurrency measured requests
(at least 8). Prints TTFT, inter-token latency and throughput; writes docs/figures/serve.json and serve_load.png.

aiperf lives in its own environment (it pulls in transformers), and reads the tokenizer from a local folder
this script writes from jaxserve's model cache, so nothing needs the network:

    python3 -m venv .venv-bench && .venv-bench/bin/pip install aiperf==0.13.0
    .venv/bin/python tools/bench_serve.py [--aiperf=.venv-bench/bin/aiperf] [--concurrency=1,8,32]
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from absl import app, flags  # noqa: E402
from tqdm import tqdm  # noqa: E402

from jaxserve.models import registry  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("aiperf", ".venv-bench/bin/aiperf", "The aiperf executable.")
flags.DEFINE_list("concurrency", ["1", "8", "32"], "Concurrent streams, one aiperf run each.")
flags.DEFINE_integer("isl", 128, "Synthetic prompt tokens (the chat template adds its own on the server).")
flags.DEFINE_integer("osl", 64, "Generated tokens per request.")
flags.DEFINE_integer("max_num_seqs", 32, "Server's running batch.")
flags.DEFINE_string("out", "docs/figures", "Folder for serve.json and serve_load.png.")

API_KEY = "bench"
METRICS = {  # aiperf summary tag -> statistics kept
    "time_to_first_token": ("p50", "p99", "avg"), "inter_token_latency": ("p50", "p99", "avg"),
    "request_latency": ("p50", "p99"), "request_throughput": ("avg",), "output_token_throughput": ("avg",),
    "input_sequence_length": ("avg",), "output_sequence_length": ("avg",), "request_count": ("avg",),
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
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": meta["chat_template"],
              "add_bos_token": meta["add_bos"], "model_max_length": 1 << 20,
              **{k: specials[k] for k in ("bos_token", "eos_token") if k in specials}}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def start_server() -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve", "serve", "--grpc_port=0", "--http_port=0",
                             f"--max_num_seqs={FLAGS.max_num_seqs}", "--max_model_len=2048",
                             "--kv_cache_gib=0.5", f"--api_key={API_KEY}"], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    match = re.search(r"HTTP on http://127\.0\.0\.1:(\d+)", line)
    if not match:
        proc.kill()
        raise RuntimeError(f"the server did not start: {line!r}")
    return proc, int(match[1])


def run_aiperf(port: int, tokenizer: pathlib.Path, concurrency: int, out: pathlib.Path) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    # (aiperf 0.13 sends a local tokenizer path to the hub downloader when offline mode is set)
    cmd = [FLAGS.aiperf, "profile", "--model", registry.DEFAULT_MODEL, "--tokenizer", str(tokenizer),
           "--url", f"http://127.0.0.1:{port}", "--endpoint-type", "chat", "--streaming", "--api-key", API_KEY,
           "--isl", str(FLAGS.isl), "--isl-stddev", "0", "--osl", str(FLAGS.osl), "--osl-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--concurrency", str(concurrency),
           "--warmup-request-count", str(concurrency), "--request-count", str(max(8, 3 * concurrency)),
           "--random-seed", "0", "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry",
           "--artifact-dir", str(out)]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    return {f"{tag}_{stat}": summary[tag][stat] for tag, stats in METRICS.items() for stat in stats}


def plot(rows: list[dict[str, float]], path: pathlib.Path) -> None:
    c = [r["concurrency"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, tag, label in ((axes[0], "time_to_first_token", "TTFT (ms)"),
                           (axes[1], "inter_token_latency", "inter-token latency (ms)")):
        ax.plot(c, [r[f"{tag}_p50"] for r in rows], "o-", label="p50")
        ax.plot(c, [r[f"{tag}_p99"] for r in rows], "s--", label="p99")
        ax.set_ylabel(label)
        ax.legend()
    axes[2].plot(c, [r["output_token_throughput_avg"] for r in rows], "o-")
    axes[2].set_ylabel("output tokens/s")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.grid(alpha=0.3)
    fig.suptitle(f"jaxserve HTTP API under aiperf (CPU, {registry.DEFAULT_MODEL}, {FLAGS.isl} in / {FLAGS.osl} out)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> None:
    del argv
    if not shutil.which(FLAGS.aiperf):
        raise SystemExit(f"aiperf not found at {FLAGS.aiperf}; see this script's docstring to install it")
    out = pathlib.Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = hf_tokenizer_dir(registry.DEFAULT_MODEL, pathlib.Path(tmp) / "tokenizer")
        server, port = start_server()
        try:
            for c in tqdm([int(x) for x in FLAGS.concurrency], desc="concurrency"):
                rows.append({"concurrency": c, **run_aiperf(port, tokenizer, c, pathlib.Path(tmp) / f"c{c}")})
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(120)
    print(f"{'conc':>4} {'TTFT p50/p99 ms':>16} {'ITL p50/p99 ms':>15} {'e2e p50 s':>9} {'req/s':>6} {'out tok/s':>9}")
    for r in rows:
        print(f"{r['concurrency']:>4} {r['time_to_first_token_p50']:>7.0f}/{r['time_to_first_token_p99']:<8.0f} "
              f"{r['inter_token_latency_p50']:>7.1f}/{r['inter_token_latency_p99']:<7.1f} "
              f"{r['request_latency_p50'] / 1e3:>9.2f} {r['request_throughput_avg']:>6.2f} "
              f"{r['output_token_throughput_avg']:>9.1f}")
    (out / "serve.json").write_text(json.dumps({"isl": FLAGS.isl, "osl": FLAGS.osl, "max_num_seqs": FLAGS.max_num_seqs,
                                                "rows": rows}, indent=1))
    plot(rows, out / "serve_load.png")
    print(f"wrote {out}/serve.json and {out}/serve_load.png")


if __name__ == "__main__":
    app.run(main)
