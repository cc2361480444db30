"""Prefix caching, live: one long shared system prompt (about --system_tokens tokens) with a different short
question per request, sent one after another through the openai client (streaming chat completions). The first
request computes the whole prompt; the later ones find the system prompt in the prefix cache. The same
requests go to a server started with --noenable_prefix_caching, in the same run, as the control. Prints the first
request's TTFT, the median of the later ones and their ratio, with the cached tokens the server reported; writes
docs/figures/prefix_cache.json.

    .venv/bin/python tools/bench/prefix.py [--system_tokens=1500] [--requests=12]
"""

from __future__ import annotations

import json
import logging
import pathlib
import statistics
import time

import numpy as np
import openai
from absl import app, flags
from tqdm import tqdm

from jaxserve.server.spawn import ServerProcess

FLAGS = flags.FLAGS
flags.DEFINE_integer("system_tokens", 1500, "Tokens of the shared system prompt (approximately; usage says exactly).")
flags.DEFINE_integer("requests", 12, "Requests per server, the first one included.")
flags.DEFINE_integer("max_tokens", 8, "Tokens generated per request.")
flags.DEFINE_string("out", "docs/figures", "Where prefix_cache.json goes.")

API_KEY = "bench"
MODEL = "bench"
WORDS = (
    "policy",
    "request",
    "server",
    "token",
    "cache",
    "prefix",
    "device",
    "model",
    "layer",
    "block",
    "queue",
    "budget",
    "stream",
    "batch",
    "kernel",
    "memory",
    "answer",
    "question",
    "context",
    "window",
    "latency",
)


def system_prompt(rng: np.random.Generator, tokens: int) -> str:
    """Sentences of common words; these words are mostly one token each, with the spaces and full stops."""
    sentences = [" ".join(rng.choice(WORDS, 9)).capitalize() + "." for _ in range(tokens // 10)]
    return "You are a helpful assistant. Follow these notes.\n" + " ".join(sentences)


def run(client: openai.OpenAI, system: str, questions: list[str]) -> list[dict]:
    rows = []
    for q in tqdm(questions, desc="requests", leave=False):
        start = time.perf_counter()
        ttft, usage = None, None
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
            max_tokens=FLAGS.max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                ttft = time.perf_counter() - start
            usage = chunk.usage or usage
        details = usage.prompt_tokens_details
        rows.append(
            {
                "ttft": ttft,
                "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": details.cached_tokens if details else 0,
            }
        )
    return rows


def main(argv: list[str]) -> None:
    del argv
    for name in ("httpx", "httpx2"):  # openai's HTTP client (httpx2 in recent releases)
        logging.getLogger(name).setLevel(logging.WARNING)  # a line per request drowns the progress bar
    rng = np.random.default_rng(0)
    system = system_prompt(rng, FLAGS.system_tokens)
    questions = [
        f"Question {i}: which of the notes mentions the word '{rng.choice(WORDS)}' first?"
        for i in range(FLAGS.requests)
    ]
    result = {}
    for caching in (True, False):
        flag = "--enable_prefix_caching" if caching else "--noenable_prefix_caching"
        with ServerProcess(
            flag, "--max_model_len=2048", "--kv_cache_gib=0.5", f"--served_model_name={MODEL}", f"--api_key={API_KEY}"
        ) as server:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key=API_KEY)
            rows = run(client, system, questions)
        first, later = rows[0]["ttft"], statistics.median(r["ttft"] for r in rows[1:])
        result["on" if caching else "off"] = {
            "rows": rows,
            "first_ttft": first,
            "later_ttft_median": later,
            "ratio": later / first,
        }
        print(
            f"prefix caching {'on ' if caching else 'off'}: prompt {rows[0]['prompt_tokens']} tokens; first TTFT "
            f"{first * 1e3:.0f} ms, later median {later * 1e3:.0f} ms (ratio {later / first:.2f}); cached tokens "
            f"of the later requests: {sorted({r['cached_tokens'] for r in rows[1:]})}"
        )
    ratio = result["on"]["later_ttft_median"] / result["off"]["later_ttft_median"]
    print(f"later-request TTFT, caching on / off: {ratio:.2f}")
    out = pathlib.Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix_cache.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out}/prefix_cache.json")


if __name__ == "__main__":
    app.run(main)
