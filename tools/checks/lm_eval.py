"""Check that lm-evaluation-harness works against jaxserve's `serve` and scores like Hugging Face transformers.

Runs the tiny tasks in benchmarks/lm_eval_task/ twice: with lm-eval's `local-completions` model against jaxserve's
/v1/completions, and with lm-eval's `hf` model (torch, float32, CPU) on the same weights. Then compares, item by
item, the loglikelihoods (multiple_choice / loglikelihood tasks) and the greedy generations (generate_until tasks),
prints the largest difference and both runs' metrics, and exits 1 if a loglikelihood differs by more than --tol.

What `local-completions` sends (lm_eval 0.4.13, lm_eval/models/openai_completions.py and api_models.py):
  loglikelihood: POST {"model", "prompt": [[context + continuation token ids], ...] (one list per prompt,
    --batch_size lists per request), "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": true};
    it reads choices[i].logprobs.token_logprobs[ctxlen:-1] (summed) and top_logprobs[ctxlen:-1] (is_greedy), so
    the reply must echo every prompt token's logprob and then exactly one generated token's.
  generate_until: POST {"prompt": [[context token ids]], "model", "max_tokens": max_gen_toks, "temperature": 0.0,
    "stop": [until..., eos string], "seed": 1234}; it reads choices[i].text.
Token ids come from the --hf_dir tokenizer (tokenizer_backend=huggingface), so both runs score the same tokens.

lm-eval lives in its own virtual environment (torch and transformers stay out of jaxserve's):

    python3 -m venv lmeval-venv                                  # anywhere: --lm_eval names its executable
    lmeval-venv/bin/pip install "torch==2.13.0+cpu"              # the CPU build; plain `torch` pulls CUDA wheels
    lmeval-venv/bin/pip install "lm-eval[hf,api]" gguf            # gguf: to write --hf_dir from the GGUF file
    export LM_EVAL=$PWD/lmeval-venv/bin/lm_eval                  # or pass --lm_eval=

Then, from the repository root, with jaxserve's environment (it starts the server through jaxserve.server.spawn):

    .venv/bin/python tools/checks/lm_eval.py                        # starts `serve`, runs both, compares
    .venv/bin/python tools/checks/lm_eval.py --base_url=http://127.0.0.1:8000/v1/completions   # a running server
    .venv/bin/python tools/checks/lm_eval.py --hf_samples=/tmp/lm_eval_check/hf   # reuse an earlier hf run

--hf_dir (default ~/.cache/jaxserve/hf/<gguf stem>-float32) is written once from the model's GGUF file by
transformers (dequantized to float32), if it is not there yet.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
import urllib.request

from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[2]
HF_DIR_TOOL = REPO / "tools" / "fixtures" / "hf_dir.py"
sys.path.insert(0, str(REPO))

from jaxserve.models import registry  # noqa: E402  (pure Python: no jax import)

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "lm_eval",
    os.environ.get("LM_EVAL") or shutil.which("lm_eval"),
    "lm-eval's executable (its venv's python, next to it, writes --hf_dir). Default: $LM_EVAL, else lm_eval on "
    "the PATH.",
)
flags.DEFINE_string("model", registry.DEFAULT_MODEL, "The model jaxserve serves (registered name or .gguf file).")
flags.DEFINE_bool(
    "serve_hf_dir",
    False,
    "Serve --hf_dir instead of --model (the very safetensors `hf` loads: rules "
    "out a difference between jaxserve's and transformers' GGUF dequantization).",
)
flags.DEFINE_string(
    "hf_dir",
    "",
    "Hugging Face directory for `--model hf` and the tokenizer of both runs "
    "(default: ~/.cache/jaxserve/hf/<gguf stem>-float32, written from the GGUF if absent).",
)
flags.DEFINE_string("base_url", "", "A running server's /v1/completions URL: no server is started.")
flags.DEFINE_bool("skip_serve", False, "Start no server: use --base_url, or http://127.0.0.1:--port/v1/completions.")
flags.DEFINE_integer("port", 8000, "The running server's HTTP port with --skip_serve and no --base_url.")
flags.DEFINE_string("served_model_name", "", "The `model` field sent (default: the server's /v1/models id).")
flags.DEFINE_string("api_key", "", "Key of the server (sent by lm-eval as OPENAI_API_KEY; also given to `serve`).")
flags.DEFINE_list(
    "serve_flags",
    ["--max_model_len=2048", "--kv_cache_gib=0.5", "--max_num_seqs=8"],
    "Extra `serve` flags (besides --model, --dtype=float32 and free ports).",
)
flags.DEFINE_list("tasks", ["jaxserve_tiny", "jaxserve_tiny_gen"], "lm-eval tasks (from benchmarks/lm_eval_task).")
flags.DEFINE_string("include_path", str(REPO / "benchmarks" / "lm_eval_task"), "lm-eval --include_path.")
flags.DEFINE_integer("limit", 0, "lm-eval --limit (documents per task; 0: all).")
flags.DEFINE_integer("batch_size", 1, "Prompts per /v1/completions request (local-completions batch_size).")
flags.DEFINE_integer("num_concurrent", 1, "Concurrent requests (local-completions num_concurrent).")
flags.DEFINE_integer("hf_batch_size", 8, "`--model hf` batch size.")
flags.DEFINE_string(
    "hf_samples",
    "",
    "Reuse this earlier `hf` output folder (its samples_*.jsonl) instead of running `--model hf` again.",
)
flags.DEFINE_float("tol", 1e-3, "Largest allowed absolute difference of a loglikelihood.")
flags.DEFINE_bool("strict_gen", False, "Also fail (exit 1) when a greedy generation differs.")
flags.DEFINE_string("out", "/tmp/lm_eval_check", "Output folder (local/, hf/, server.log).")
flags.DEFINE_integer("lm_eval_timeout", 3600, "Seconds each lm_eval run may take.")


def lm_eval_python() -> pathlib.Path:
    return pathlib.Path(FLAGS.lm_eval).parent / "python"


def hf_dir() -> pathlib.Path:
    """The Hugging Face directory both runs use (weights for `hf`, tokenizer for both); written if absent."""
    gguf = registry.resolve(FLAGS.model)
    if FLAGS.hf_dir:
        path = pathlib.Path(FLAGS.hf_dir).expanduser()
    elif gguf.is_dir():  # --model is already a Hugging Face directory
        return gguf
    else:
        path = registry.cache_dir() / "hf" / f"{gguf.stem}-float32"
    if (path / "config.json").is_file():
        return path
    if gguf.suffix != ".gguf":
        raise SystemExit(f"{path} is not a Hugging Face directory, and {gguf} is no GGUF file to write it from")
    print(f"writing {path} from {gguf} (transformers, float32) ...", flush=True)
    subprocess.run([str(lm_eval_python()), str(HF_DIR_TOOL), str(gguf), str(path)], check=True, env=lm_eval_env())
    return path


def lm_eval_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "JAX", "XLA"))}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if FLAGS.api_key:
        env["OPENAI_API_KEY"] = FLAGS.api_key  # local-completions sends `Authorization: Bearer $OPENAI_API_KEY`
    return env


def run_lm_eval(
    name: str, model: str, model_args: dict[str, str | int], batch_size: int, extra: list[str]
) -> pathlib.Path:
    """One lm_eval run into FLAGS.out/name (emptied first); its log is FLAGS.out/name.log. The output folder."""
    out = pathlib.Path(FLAGS.out) / name
    shutil.rmtree(out, ignore_errors=True)
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    cmd = [
        FLAGS.lm_eval,
        "--model",
        model,
        "--model_args",
        args,
        "--include_path",
        FLAGS.include_path,
        "--tasks",
        ",".join(FLAGS.tasks),
        "--batch_size",
        str(batch_size),
        "--output_path",
        str(out),
        "--log_samples",
        *extra,
    ]
    if FLAGS.limit:
        cmd += ["--limit", str(FLAGS.limit)]
    log = pathlib.Path(FLAGS.out) / f"{name}.log"
    print(f"[{name}] {' '.join(cmd)}\n[{name}] log: {log}", flush=True)
    start = time.monotonic()
    with open(log, "w") as f:
        # the task's data_files are relative to the repository root (benchmarks/lm_eval_task/*.yaml)
        done = subprocess.run(
            cmd, cwd=REPO, env=lm_eval_env(), stdout=f, stderr=subprocess.STDOUT, timeout=FLAGS.lm_eval_timeout
        )
    print(f"[{name}] exit {done.returncode} after {time.monotonic() - start:.0f} s", flush=True)
    if done.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise SystemExit(f"[{name}] lm_eval failed (exit {done.returncode}); the end of {log}:\n{tail}")
    return out


def read_run(out: pathlib.Path) -> tuple[dict[tuple, dict], dict[str, dict]]:
    """Per request (task, doc_id, i): its arguments and response; and each task's metrics."""
    items: dict[tuple, dict] = {}
    metrics: dict[str, dict] = {}
    for task in FLAGS.tasks:
        pattern = re.compile(rf"samples_{re.escape(task)}_\d{{4}}-\d\d-\d\dT.*\.jsonl")
        files = sorted(p for p in out.rglob("samples_*.jsonl") if pattern.fullmatch(p.name))
        if not files:
            raise SystemExit(f"{out}: no samples of task {task} (was lm_eval run with --log_samples?)")
        for line in files[-1].read_text().splitlines():
            s = json.loads(line)
            args = [list(a.values()) for a in s["arguments"].values()]
            for i, (arg, resp) in enumerate(zip(args, s["resps"], strict=True)):
                items[(task, s["doc_id"], i)] = {"args": arg, "resp": resp[0]}
    results = sorted(out.rglob("results_*.json"))
    if results:
        for task, res in json.loads(results[-1].read_text())["results"].items():
            metrics[task] = {
                k.split(",")[0]: v
                for k, v in res.items()
                if "," in k and "stderr" not in k and isinstance(v, (int, float))
            }
    return items, metrics


def compare(local: dict[tuple, dict], hf: dict[tuple, dict]) -> tuple[int, int]:
    """Print the differences; (loglikelihoods beyond --tol or missing, generations that differ)."""
    bad_ll, bad_gen, greedy_differs = 0, 0, 0
    diffs: list[tuple[float, tuple, float, float]] = []
    for key in sorted(set(local) | set(hf)):
        if key not in local or key not in hf:
            print(f"  {key}: only in {'local-completions' if key in local else 'hf'}")
            bad_ll += 1
            continue
        a, b = local[key], hf[key]
        if a["args"] != b["args"]:
            print(f"  {key}: the runs scored different requests: {a['args']!r} vs {b['args']!r}")
            bad_ll += 1
            continue
        if isinstance(b["resp"], str):  # generate_until
            if a["resp"] != b["resp"]:
                bad_gen += 1
                print(f"  {key}: generation differs: local {a['resp']!r} vs hf {b['resp']!r}")
            continue
        ll_a, ll_b = float(a["resp"][0]), float(b["resp"][0])
        diffs.append((abs(ll_a - ll_b), key, ll_a, ll_b))
        greedy_differs += str(a["resp"][1]) != str(b["resp"][1])
    diffs.sort(reverse=True)
    if diffs:
        worst = diffs[0]
        mean = sum(d[0] for d in diffs) / len(diffs)
        print(
            f"loglikelihoods: {len(diffs)} compared, max |diff| {worst[0]:.3g} at {worst[1]} "
            f"(local {worst[2]:.6f}, hf {worst[3]:.6f}), mean |diff| {mean:.3g}"
        )
        over = [d for d in diffs if not d[0] <= FLAGS.tol]  # NaN counts as over
        for d, key, x, y in over[:20]:
            print(f"  {key}: local {x:.6f} hf {y:.6f} |diff| {d:.3g} > {FLAGS.tol}")
        bad_ll += len(over)
        if greedy_differs:
            print(
                f"  note: is_greedy differs for {greedy_differs} requests (local-completions derives it from "
                "top_logprobs: check that they hold the top token's logprob, bit for bit)"
            )
    gens = sum(isinstance(v["resp"], str) for v in hf.values())
    if gens:
        print(f"generations: {gens} compared, {bad_gen} differ")
    return bad_ll, bad_gen


def served_name(base_url: str) -> str:
    if FLAGS.served_model_name:
        return FLAGS.served_model_name
    root = base_url.split("/v1/")[0]
    req = urllib.request.Request(f"{root}/v1/models", headers={"Authorization": f"Bearer {FLAGS.api_key}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def run_local(base_url: str, tokenizer: pathlib.Path) -> pathlib.Path:
    args = {
        "model": served_name(base_url),
        "base_url": base_url,
        "tokenizer": tokenizer,
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,
        "num_concurrent": FLAGS.num_concurrent,
        "max_retries": 1,
        "max_length": 2048,
    }
    return run_lm_eval("local", "local-completions", args, FLAGS.batch_size, [])


def main(argv: list[str]) -> int:
    del argv
    pathlib.Path(FLAGS.out).mkdir(parents=True, exist_ok=True)
    if not FLAGS.lm_eval or not pathlib.Path(FLAGS.lm_eval).is_file():
        raise SystemExit(f"no lm_eval at {FLAGS.lm_eval}: install it (see this file's docstring) or pass --lm_eval")
    tokenizer = hf_dir()
    print(f"Hugging Face directory: {tokenizer}")

    if FLAGS.base_url or FLAGS.skip_serve:
        local_out = run_local(FLAGS.base_url or f"http://127.0.0.1:{FLAGS.port}/v1/completions", tokenizer)
    else:
        from jaxserve.server.spawn import ServerProcess  # imports jax: only when a server is started

        model = str(tokenizer) if FLAGS.serve_hf_dir else FLAGS.model
        flags_ = [f"--model={model}", "--dtype=float32", *FLAGS.serve_flags]
        if FLAGS.api_key:
            flags_.append(f"--api_key={FLAGS.api_key}")
        print(f"starting: python -m jaxserve serve {' '.join(flags_)}", flush=True)
        server = ServerProcess(*flags_)
        try:
            url = f"http://127.0.0.1:{server.http_port}/v1/completions"
            print(f"server up: {url}", flush=True)
            local_out = run_local(url, tokenizer)
        finally:
            server.stop()
            log = pathlib.Path(FLAGS.out) / "server.log"
            log.write_text(server.log())
            print(f"server log: {log}")

    if FLAGS.hf_samples:
        hf_out = pathlib.Path(FLAGS.hf_samples)
    else:
        hf_out = run_lm_eval(
            "hf", "hf", {"pretrained": tokenizer, "dtype": "float32"}, FLAGS.hf_batch_size, ["--device", "cpu"]
        )

    local, local_metrics = read_run(local_out)
    hf, hf_metrics = read_run(hf_out)
    print("\nmetrics (local-completions vs hf):")
    for task in FLAGS.tasks:
        for name in sorted(set(local_metrics.get(task, {})) | set(hf_metrics.get(task, {}))):
            print(f"  {task} {name}: {local_metrics.get(task, {}).get(name)} vs {hf_metrics.get(task, {}).get(name)}")
    bad_ll, bad_gen = compare(local, hf)
    failed = bad_ll > 0 or (FLAGS.strict_gen and bad_gen > 0)
    print("FAIL" if failed else "PASS", f"(loglikelihood tolerance {FLAGS.tol})")
    return 1 if failed else 0


if __name__ == "__main__":
    app.run(main)
