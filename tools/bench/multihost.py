"""What running across processes adds (jax.distributed, one process per host; here local processes on CPU, gloo).

Three parts, each a fresh set of processes started by this script:

- transfer: KV-shaped arrays (SmolLM2-135M's layout, bfloat16) moved by `sharding/processes.move` (the path every
  KV transfer between hosts takes) from a device of process 0 to a device of process 1 and back, beside the same
  round trip between two devices of process 0. MB/s per size, timed on process 0, the values checked on return.
- lockstep: the per-call cost of the leader's broadcast (`cluster/lockstep.Leader`): publishing a step-sized call
  (seconds and bytes), how fast the followers replay a stream of them, and the round trip of one call until every
  follower has made it.
- serve: `serve`'s cluster (SmolLM2-135M; a CDSP pool of devices 0-5, which spans processes 0 and 1, and decode
  instances on devices 6 and 7) serving the same requests across the processes and on the same devices in one
  process: wall time, steps, chunks on groups spanning processes, calls published and their cost, tokens compared.

    .venv/bin/python tools/bench/multihost.py --out=bench_out/multihost [--processes=2 --devices_per_process=4]

Writes results.json (after every part, so a crash keeps what was measured) and transfer.png. On CPU the
figures are ratios on one machine: gloo over loopback TCP, not NCCL; the XLA CPU runtime of one process runs one
multi-device program at a time while separate processes overlap, on 2 cores.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
from absl import app, flags
from tqdm.auto import tqdm

FLAGS = flags.FLAGS
flags.DEFINE_integer("processes", 2, "Local processes (2 or 3).")
flags.DEFINE_integer("devices_per_process", 4, "CPU devices per process.")
flags.DEFINE_list("sizes_mb", ["0.0625", "1", "4", "16", "64"], "KV sizes moved, MiB.")
flags.DEFINE_integer("round_trips", 5, "Timed round trips per size.")
flags.DEFINE_integer("calls", 1000, "Calls published for the replay rate.")
flags.DEFINE_integer("pings", 50, "Calls timed one by one until every follower made them.")
flags.DEFINE_integer("requests", 8, "Requests served in the serve part.")
flags.DEFINE_list("parts", ["transfer", "lockstep", "serve"], "Parts to run.")
flags.DEFINE_string("out", "bench_out/multihost", "Directory for results.json and transfer.png.")
flags.DEFINE_integer("timeout", 1800, "Seconds a part may take.")
# set by the parent for its worker processes
flags.DEFINE_string("worker", None, "Internal: the part this process runs.")
flags.DEFINE_integer("process_id", 0, "Internal.")
flags.DEFINE_integer("num_processes", 1, "Internal.")
flags.DEFINE_integer("port", 0, "Internal: the coordinator's port.")
flags.DEFINE_string("result", "", "Internal: where process 0 writes its part's result.")

# SmolLM2-135M: 30 layers x (K, V) x 3 KV heads x 64 dims, bfloat16 -> 23,040 bytes per token
KV_TOKEN = (30, 2, 3, 64)
KV_TOKEN_BYTES = int(np.prod(KV_TOKEN)) * 2


# ---- the workers -----------------------------------------------------------------------------------------
def _transfer() -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from jaxserve.sharding import processes

    d = jax.devices()
    src = d[0]
    pairs = {"within a process": d[1], "across processes": d[FLAGS.devices_per_process]}
    rows = []
    for size in map(float, FLAGS.sizes_mb):
        tokens = max(1, int(size * 2**20) // KV_TOKEN_BYTES)
        shape = (tokens, *KV_TOKEN)
        here = src.process_index == jax.process_index()
        value = np.random.default_rng(0).standard_normal(shape, dtype=np.float32).astype(jnp.bfloat16)
        x = (
            jax.device_put(value, src)
            if here
            else processes.placeholder(shape, SingleDeviceSharding(src), jnp.bfloat16)
        )
        for kind, dst in pairs.items():

            def round_trip(x):
                return processes.move(processes.move(x, SingleDeviceSharding(dst)), SingleDeviceSharding(src))

            back = round_trip(x)  # compiles the pair programs
            jax.block_until_ready(back)
            start = time.perf_counter()
            for _ in range(FLAGS.round_trips):
                back = round_trip(back)
            jax.block_until_ready(back)
            seconds = (time.perf_counter() - start) / (2 * FLAGS.round_trips)
            if here:
                assert np.array_equal(np.asarray(back), value), "the moved KV changed"
            mb = tokens * KV_TOKEN_BYTES / 2**20
            rows.append(dict(kind=kind, mb=mb, tokens=tokens, ms=seconds * 1e3, mb_per_s=mb / seconds))
    return dict(rows=rows)


class Probe:
    """A device-layer stand-in whose calls cost nothing, so what is timed is the lockstep channel itself."""

    def __init__(self):
        self.calls = 0

    def step(self, plan: dict) -> None:
        self.calls += 1

    def pong(self, n: int) -> None:
        import jax

        from jaxserve.sharding.processes import coordination_client

        if jax.process_index() != 0:
            coordination_client().key_value_set(f"bench/pong/{jax.process_index()}/{n}", str(self.calls))


def _step_sized_plan(rng: np.random.Generator) -> dict:
    """What a decode step's call carries: 256 batched tokens, their positions and slots, four block tables."""
    return dict(
        tokens=rng.integers(0, 49152, 256, dtype=np.int32),
        positions=np.arange(256, dtype=np.int32),
        slots=rng.integers(0, 8192, 256, dtype=np.int32),
        tables=rng.integers(0, 512, (4, 64), np.int32),
        requests=[f"req-{i}" for i in range(4)],
    )


def _lockstep() -> dict:
    import jax

    from jaxserve.cluster import lockstep
    from jaxserve.sharding import processes

    if jax.process_index() != 0:
        lockstep.follow(None)
        return {}
    leader, client = lockstep.Leader(None), processes.coordination_client()
    probe = leader.new(Probe)
    followers = range(1, jax.process_count())

    def pong(n: int) -> None:
        probe.pong(n)
        for p in followers:
            client.blocking_key_value_get(f"bench/pong/{p}/{n}", 60_000)

    pong(-1)  # every follower is up and replaying
    rng = np.random.default_rng(0)
    plans = [_step_sized_plan(rng) for _ in range(16)]
    published, seconds, size = leader.published, leader.publish_seconds, leader.published_bytes
    start = time.perf_counter()
    for i in tqdm(range(FLAGS.calls), desc="publish", unit="call"):
        probe.step(plans[i % len(plans)])
    pong(0)
    replay = time.perf_counter() - start
    n = leader.published - published - 1
    per_call = dict(
        publish_ms=(leader.publish_seconds - seconds) / (n + 1) * 1e3,
        bytes=(leader.published_bytes - size) / (n + 1),
        replay_calls_per_s=n / replay,
    )
    pings = []
    for i in range(1, FLAGS.pings + 1):
        start = time.perf_counter()
        pong(i)
        pings.append(time.perf_counter() - start)
    leader.stop()
    return dict(
        followers=len(followers),
        **per_call,
        round_trip_ms_median=float(np.median(pings)) * 1e3,
        round_trip_ms_p90=float(np.percentile(pings, 90)) * 1e3,
    )


def _serve() -> dict:
    import jax

    import jaxserve
    from jaxserve import api
    from jaxserve.sampling_params import SamplingParams

    if jax.process_index() != 0:
        api.follow()
        return {}
    # `serve`'s cluster: the pool is devices 0-5 (with 4 per process, it spans two processes), decode on 6 and 7;
    # Eq. (1) measured on the pool by the first run and loaded by the next (both plan with the same one)
    llm = jaxserve.LLM(
        max_model_len=1024,
        kv_cache_tokens=2048,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        prefill_instances=6,
        node_size=2,
        decode_instances=2,
        min_chunk=256,
        progress=False,
    )
    cluster, leader = llm.engine, llm.lockstep
    rng = np.random.default_rng(0)
    lengths = [900 if i % 2 == 0 else int(rng.integers(40, 200)) for i in range(FLAGS.requests)]
    prompts = [rng.integers(100, 5000, n).tolist() for n in lengths]
    before = (leader.published, leader.publish_seconds, leader.published_bytes) if leader else (0, 0.0, 0)
    rids = [cluster.add_request(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in prompts]
    got, steps = {r: [] for r in rids}, 0
    start = time.perf_counter()
    with tqdm(total=len(rids), desc="serve", unit="request") as bar:
        while cluster.has_unfinished():
            steps += 1
            for o in cluster.step():
                assert o.error is None, o.error
                got[o.request_id] += o.new_token_ids
                bar.update(int(o.finished))
    wall = time.perf_counter() - start
    spanning = sum(len({d.process_index for d in jax.devices() if d.id in r.group}) > 1 for r in cluster.records)
    result = dict(
        processes=jax.process_count(),
        prompt_tokens=sum(lengths),
        steps=steps,
        seconds=wall,
        chunks=len(cluster.records),
        chunks_spanning_processes=spanning,
        tokens=[got[r] for r in rids],
    )
    if leader:
        result.update(
            calls=leader.published - before[0],
            publish_seconds=leader.publish_seconds - before[1],
            bytes=leader.published_bytes - before[2],
        )
    llm.close()
    return result


def worker() -> None:
    import jax

    if FLAGS.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            f"127.0.0.1:{FLAGS.port}", num_processes=FLAGS.num_processes, process_id=FLAGS.process_id
        )
    result = {"transfer": _transfer, "lockstep": _lockstep, "serve": _serve}[FLAGS.worker]()
    if jax.process_index() == 0:
        pathlib.Path(FLAGS.result).write_text(json.dumps(result))
    if FLAGS.num_processes > 1:
        jax.distributed.shutdown()


# ---- the parent ------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_part(part: str, processes: int, devices: int, out: pathlib.Path) -> dict:
    """Start the part's processes, wait for them, return process 0's result."""
    port, result = _free_port(), out / f"{part}-{processes}.json"
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    args = [
        a
        for a in sys.argv[1:]
        if not a.startswith(("--worker", "--process_id", "--num_processes", "--port", "--result"))
    ]
    procs = [
        subprocess.Popen(
            [
                "timeout",
                "-k",
                "10",
                str(FLAGS.timeout),
                sys.executable,
                __file__,
                *args,
                f"--worker={part}",
                f"--process_id={i}",
                f"--num_processes={processes}",
                f"--port={port}",
                f"--result={result}",
            ],
            env=env,
            stdout=subprocess.DEVNULL if i else None,
            stderr=(out / f"{part}-p{i}.log").open("w"),
        )
        for i in range(processes)
    ]
    codes = [p.wait() for p in procs]
    if codes != [0] * processes:
        raise RuntimeError(f"{part}: exit codes {codes}; logs in {out}/{part}-p*.log")
    return json.loads(result.read_text())


def plot(transfer: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind in ("within a process", "across processes"):
        rows = [r for r in transfer["rows"] if r["kind"] == kind]
        ax.plot([r["mb"] for r in rows], [r["mb_per_s"] for r in rows], "o-", label=kind)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="KV moved (MiB)",
        ylabel="MiB/s",
        title="processes.move, one device to one device (CPU)",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(results: dict) -> None:
    if "transfer" in results:
        print(
            "\nKV transfer (one way, mean of round trips)\n"
            "| kind | MiB | tokens | ms | MiB/s |\n|---|---:|---:|---:|---:|"
        )
        for r in results["transfer"]["rows"]:
            print(f"| {r['kind']} | {r['mb']:.3g} | {r['tokens']} | {r['ms']:.2f} | {r['mb_per_s']:.0f} |")
    if "lockstep" in results:
        r = results["lockstep"]
        print(
            f"\nlockstep, {r['followers']} follower(s): publish {r['publish_ms']:.3f} ms/call "
            f"({r['bytes']:.0f} bytes), replay {r['replay_calls_per_s']:.0f} calls/s, round trip "
            f"{r['round_trip_ms_median']:.2f} ms median ({r['round_trip_ms_p90']:.2f} p90)"
        )
    if "serve" in results:
        many, one = results["serve"]["across processes"], results["serve"]["one process"]
        print(
            f"\nserve {FLAGS.requests} requests: {many['seconds']:.1f} s across {many['processes']} processes vs "
            f"{one['seconds']:.1f} s in one ({many['seconds'] / one['seconds']:.2f}x); steps {many['steps']} vs "
            f"{one['steps']}; {many['chunks_spanning_processes']} of {many['chunks']} chunks on groups spanning "
            f"processes; {many['calls']} calls published ({many['bytes'] / max(1, many['calls']):.0f} bytes "
            f"each), {many['publish_seconds']:.2f} s publishing ({many['publish_seconds'] / many['seconds']:.1%} "
            f"of the wall time); tokens equal: {results['serve']['tokens_equal']}"
        )


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.worker:
        return worker()
    out = pathlib.Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    n, per = FLAGS.processes, FLAGS.devices_per_process
    results: dict = dict(processes=n, devices_per_process=per)
    for part in tqdm(FLAGS.parts, desc="parts", unit="part"):
        if part == "serve":
            if n * per < 8:
                raise ValueError("serve needs 8 devices in all (its layout uses devices 2-7)")
            many = run_part(part, n, per, out)
            one = run_part(part, 1, n * per, out)
            results[part] = {
                "across processes": many,
                "one process": one,
                "tokens_equal": many.pop("tokens") == one.pop("tokens"),
            }
        else:
            results[part] = run_part(part, n, per, out)
            if part == "transfer":
                plot(results[part], out / "transfer.png")
        (out / "results.json").write_text(json.dumps(results, indent=1))
    report(results)


if __name__ == "__main__":
    app.run(main)
