"""Hostile-input fuzz of a live server: thousands of HTTP requests and gRPC calls (jaxserve.fuzz) sent
`--workers` at a time to `python -m jaxserve serve`, with a canary stream beside them.

The bar (issue 17): 0 replies 5xx, 0 gRPC UNKNOWN/INTERNAL, 0 connections dropped without a reply, 0 error
bodies out of OpenAI's shape, 0 hangs; the canary's greedy text never changes and its largest inter-token gap
stays under 2 s; the server's memory (RSS) ends within 10% of where it started (after a warm-up round of the
same mix) and its KV blocks all come back.
Exit status 1 if any of it fails. Writes docs/figures/fuzz.json (the summary and every failure).

    .venv/bin/python tools/checks/fuzz_server.py [--http=2000] [--grpc=500] [--seed=0] [--workers=8]
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

from absl import app, flags
from tqdm import tqdm

from jaxserve.fuzz.runner import fuzz
from jaxserve.server.launch import Server
from jaxserve.server.spawn import ServerProcess

FLAGS = flags.FLAGS
flags.DEFINE_integer("http", 2000, "Hostile HTTP requests.")
flags.DEFINE_integer("grpc", 500, "Hostile gRPC calls.")
flags.DEFINE_integer("seed", 0, "Seed of the cases (a run is reproducible from it).")
flags.DEFINE_integer("workers", 8, "Requests in flight at once.")
flags.DEFINE_integer("warmup", 400, "Requests of the same mix before memory is first measured.")
flags.DEFINE_float("max_gap", 2.0, "The canary's largest allowed inter-token gap, seconds.")
flags.DEFINE_float("memory_slack", 0.10, "How far above its start the server's RSS may end.")
flags.DEFINE_string("out", "docs/figures/fuzz.json", "Where the report goes.")

KEY = "fuzz-key"
MODEL = "smollm2-135m-instruct"
SERVER_FLAGS = (
    "--max_model_len=1024",
    "--kv_cache_gib=0.25",
    "--max_num_seqs=8",
    "--max_queue=32",
    f"--api_key={KEY}",
    "--max_request_bytes=4194304",
    "--request_read_timeout=10",
)


def rss_bytes(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def settle(server: ServerProcess, timeout: float = 60.0) -> None:
    """Wait until nothing is running or waiting (aborted requests leave within a step), then for the idle
    server's heap trim (Server.TRIM_S)."""
    deadline = time.monotonic() + timeout
    while (m := server.metrics())["jaxserve_num_requests_running"] + m["jaxserve_num_requests_waiting"] > 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not go idle")
        time.sleep(0.2)
    time.sleep(Server.TRIM_S + 1.0)


def main(_) -> None:
    with ServerProcess(*SERVER_FLAGS) as server:
        pid = server.proc.pid
        settle(server)
        rss_idle = rss_bytes(pid)
        # A warm-up round of the same mix (another seed): the pools and arenas a server fills on first use
        # (gRPC's above all) are its working size, not growth
        fuzz(
            server.http_port,
            server.grpc_port,
            model=MODEL,
            key=KEY,
            n_http=FLAGS.warmup // 4 * 3,
            n_grpc=FLAGS.warmup // 4,
            seed=FLAGS.seed + 1,
            workers=FLAGS.workers,
        )
        settle(server)
        rss_start = rss_bytes(pid)
        with tqdm(total=FLAGS.http + FLAGS.grpc, desc="fuzz", unit="req") as bar:
            report = fuzz(
                server.http_port,
                server.grpc_port,
                model=MODEL,
                key=KEY,
                n_http=FLAGS.http,
                n_grpc=FLAGS.grpc,
                seed=FLAGS.seed,
                workers=FLAGS.workers,
                progress=bar.update,
            )
        settle(server)
        rss_end = rss_bytes(pid)
        kv_used = server.metrics()["jaxserve_kv_cache_blocks_used"]
        alive = server.proc.poll() is None
        summary = {
            **report.summary(),
            "seed": FLAGS.seed,
            "workers": FLAGS.workers,
            "warmup_requests": FLAGS.warmup,
            "rss_idle_mib": round(rss_idle / 2**20, 1),
            "rss_start_mib": round(rss_start / 2**20, 1),
            "rss_end_mib": round(rss_end / 2**20, 1),
            "rss_growth": round(rss_end / rss_start - 1, 4),
            "kv_blocks_used_end": kv_used,
            "server_alive": alive,
            "server_flags": list(SERVER_FLAGS),
        }
    checks = {
        "no failures (5xx, UNKNOWN/INTERNAL, dropped, misshaped, hangs)": not report.failures,
        "canary unchanged and never failed": report.canary_changed == 0 and not report.canary_errors,
        f"canary gap < {FLAGS.max_gap:g} s": report.canary_max_gap_s < FLAGS.max_gap,
        f"memory within {FLAGS.memory_slack:.0%}": rss_end <= rss_start * (1 + FLAGS.memory_slack),
        "KV blocks all back": kv_used == 0,
        "server alive": alive,
    }
    summary["checks"] = checks
    out = pathlib.Path(FLAGS.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"summary": summary, "failures": [vars(o) for o in report.failures], "canary_errors": report.canary_errors},
            indent=1,
        )
    )
    print(json.dumps(summary, indent=1))
    for o in report.failures[:20]:
        print(f"FAIL {o.interface} {o.kind} {o.status}: {o.failure}\n    {o.case}")
    print(f"report: {out}")
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    app.run(main)
