"""Each cluster policy served live on CPU devices, then replayed in the simulator with the costs the live run
measured (sim/replay.py): P50 and P99 TTFT and TPOT live and simulated, and a Gantt chart of the prefill work.

One policy per call (each builds its own cluster); every call prints the table of all policies found in --out:

    .venv/bin/python tools/bench/cluster.py --cluster_policy=cdsp --out=bench_out/cluster
    .venv/bin/python tools/bench/cluster.py --cluster_policy=tetriinfer --out=bench_out/cluster
    .venv/bin/python tools/bench/cluster.py --cluster_policy=esp --out=bench_out/cluster
    .venv/bin/python tools/bench/cluster.py --cluster_policy=csps --out=bench_out/cluster

Measured on the live devices: the prefill model (cdsp, csps: the pool's Eq. (1); esp: LoongServe's batch model; both
measured when the cluster starts, cached; tetriinfer: Eq. (1) at SP 1 on one instance, measured here), the decode
engine's step cost (engine/profile.py) and a line through the live KV transfers (seconds against tokens).

Read the comparison with this in mind: in one process the XLA CPU runtime runs one multi-device program at a
time, so work the simulator overlaps (chunks on disjoint groups, decode steps beside chunks) runs one piece after
another here. Where requests overlap, live times exceed the simulator's; at a low rate they mostly do not.

Writes <policy>.json (the LiveRun, each request's live and simulated TTFT and TPOT) and <policy>_gantt.png.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time

import numpy as np
from absl import app, flags
from tqdm.auto import tqdm

from jaxserve.sim.replay import POLICIES  # jax-free: XLA_FLAGS is set in main, before JAX starts

FLAGS = flags.FLAGS
flags.DEFINE_enum("cluster_policy", "cdsp", POLICIES, "The policy to serve and replay.")
flags.DEFINE_integer("prefill_instances", 4, "Prefill instances (esp: the instances, which decode too).")
flags.DEFINE_integer("decode_instances", 2, "Decode instances (cdsp, csps, tetriinfer).")
flags.DEFINE_integer("node_size", 2, "Prefill instances per node (cdsp, csps).")
flags.DEFINE_integer("partition_tokens", 512, "CSPS's sequence partition, tokens.")
flags.DEFINE_integer("prefill_chunk", 256, "TetriInfer's fixed chunk, tokens.")
flags.DEFINE_integer("requests", 16, "Requests in the trace.")
flags.DEFINE_float("rate", 0.1, "Poisson arrival rate, requests/s.")
flags.DEFINE_float(
    "long_fraction", 0.3, "Share of long prompts (max_model_len/2 .. max_model_len - 64 tokens; the others 64-512)."
)
flags.DEFINE_integer("max_model_len", 2048, "Context length.")
flags.DEFINE_integer("min_chunk", 256, "Smallest CDSP chunk, tokens.")
flags.DEFINE_integer("seed", 0, "Trace seed.")
flags.DEFINE_string("out", "bench_out/cluster", "Directory for <policy>.json and <policy>_gantt.png.")


def trace(rng: np.random.Generator) -> list[tuple[float, int, int]]:
    """(arrival from the first, prompt tokens, output tokens) per request."""
    n, top = FLAGS.requests, FLAGS.max_model_len
    long = rng.random(n) < FLAGS.long_fraction
    prompt = np.where(long, rng.integers(top // 2, top - 64, n), rng.integers(64, 513, n))
    arrival = np.cumsum(rng.exponential(1 / FLAGS.rate, n))
    return [(float(a - arrival[0]), int(p), int(o)) for a, p, o in zip(arrival, prompt, rng.integers(4, 17, n))]


def serve(cluster, requests: list[tuple[float, int, int]], rng: np.random.Generator) -> dict:
    """Submit each request at its arrival and step until all finish. Per request (seconds from the start):
    submitted, first token, finished; the request index of each engine id; the start on the cluster's clock."""
    from jaxserve.sampling_params import SamplingParams

    prompts = [rng.integers(1000, 20000, p).tolist() for _, p, _ in requests]
    index, submitted, first, finished = {}, {}, {}, {}
    start = cluster.clock()
    pending = list(range(len(requests)))
    with tqdm(total=len(requests), desc="serve the trace", unit="request") as bar:
        while pending or cluster.has_unfinished():
            now = cluster.clock() - start
            while pending and requests[pending[0]][0] <= now:
                k = pending.pop(0)
                submitted[k] = cluster.clock() - start
                index[cluster.add_request(prompts[k], SamplingParams(max_tokens=requests[k][2], ignore_eos=True))] = k
            if not cluster.has_unfinished():
                time.sleep(max(0.0, min(0.01, requests[pending[0]][0] - now)))
                continue
            for out in cluster.step():
                k = index[out.request_id]
                if out.new_token_ids:
                    first.setdefault(k, cluster.clock() - start)
                if out.finished:
                    finished[k] = cluster.clock() - start
                    bar.update()
    return dict(index=index, start=start, submitted=submitted, first=first, finished=finished)


def measure(llm, policy: str):
    """The LiveRun's measured costs: the prefill model, the decode step cost, the KV transfer line."""
    from jaxserve.cluster import pool_profile
    from jaxserve.engine import profile
    from jaxserve.sim.replay import Line

    cluster = llm.engine
    if policy == "esp":
        model = cluster.scheduler.elastic.model
    elif policy == "cdsp":
        model = cluster.planner.model
    elif policy == "csps":
        model = cluster.planner.model.model  # MeasuredCSPS's Eq. (1)
    else:  # TetriInfer plans nothing with a model: Eq. (1) at SP 1 measured on one instance, for the replay
        layout = llm.engine_config.parallel
        path = pool_profile.default_path(
            llm.model_name,
            llm.builder.model.dtype_name,
            "tetriinfer-sp1",
            layout.prefill_instances,
            1,
            layout.tp,
            FLAGS.max_model_len,
            llm.engine_config.cache.key_block,
        )
        model = pool_profile.load_or_measure(path, cluster.prefill, {1: (cluster.pool_ids[0],)}, FLAGS.max_model_len)
    runner = cluster.decoders[0].engine.runner
    step = llm.builder.cost or profile.load_or_measure(
        profile.default_path(llm.model_name, llm.builder.model.dtype_name, runner), runner, FLAGS.max_model_len
    )
    moved = [(t.tokens, t.landed - t.sent) for _, t in cluster.transfers]
    return json.loads(model.to_json()), step.to_dict(), Line.fit(*zip(*moved)) if moved else Line(0.0, 0.0)


def percentiles(values) -> tuple[float, float]:
    values = [v for v in values if v is not None and np.isfinite(v)]
    return (float(np.percentile(values, 50)), float(np.percentile(values, 99))) if values else (np.nan, np.nan)


def table(out: pathlib.Path) -> None:
    print(
        f"\n{'policy':<11} {'TTFT P50 live / sim (s)':>24} {'TTFT P99 live / sim':>20} "
        f"{'TPOT P50 live / sim (ms)':>25} {'TPOT P99 live / sim':>20}"
    )
    for policy in POLICIES:
        path = out / f"{policy}.json"
        if not path.exists():
            continue
        rows = json.loads(path.read_text())["requests"]
        cells = []
        for key, scale in (("ttft", 1), ("tpot", 1e3)):
            live, sim = percentiles(r[f"live_{key}"] for r in rows), percentiles(r[f"sim_{key}"] for r in rows)
            cells += [f"{scale * live[i]:.3g} / {scale * sim[i]:.3g} ({live[i] / sim[i]:.2f}x)" for i in (0, 1)]
        print(f"{policy:<11} {cells[0]:>24} {cells[1]:>20} {cells[2]:>25} {cells[3]:>20}")


def main(argv: list[str]) -> None:
    del argv
    policy = FLAGS.cluster_policy
    devices = FLAGS.prefill_instances + (0 if policy == "esp" else FLAGS.decode_instances)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"  # before JAX's backend starts
    import jax

    import jaxserve
    from jaxserve.sim import plots
    from jaxserve.sched.improvement_rate import AdaptiveCDSP
    from jaxserve.sim.replay import LiveRun, replay

    out = pathlib.Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(FLAGS.seed)
    requests = trace(rng)
    top = FLAGS.max_model_len
    layout = dict(prefill_instances=FLAGS.prefill_instances, cluster_policy=policy)
    if policy != "esp":
        layout |= dict(decode_instances=FLAGS.decode_instances)
    if policy == "cdsp":
        layout |= dict(node_size=FLAGS.node_size, min_chunk=FLAGS.min_chunk)
    if policy == "csps":
        layout |= dict(node_size=FLAGS.node_size, partition_tokens=FLAGS.partition_tokens)
    if policy == "tetriinfer":
        layout |= dict(prefill_chunk=FLAGS.prefill_chunk)
    llm = jaxserve.LLM(
        max_model_len=top,
        kv_cache_tokens=2 * top,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        quick_start=False,
        **layout,
    )  # the pool's model measured before serving: the replay reads it
    cluster = llm.engine
    live = serve(cluster, requests, rng)
    prefill_model, step_cost, transfer = measure(llm, policy)
    first = cluster.decoders[0]
    planner = {}
    if policy == "cdsp":
        adaptive = isinstance(cluster.planner, AdaptiveCDSP)
        cdsp = cluster.planner.planner if adaptive else cluster.planner
        planner = dict(improvement_rate=cdsp.improvement_rate, sizes=list(cdsp.sizes), min_chunk=cdsp.min_chunk)
        if cdsp.balancing is not None:
            planner["balancing"] = dataclasses.asdict(cdsp.balancing)
        if adaptive:
            planner["improvement_rates"] = dataclasses.asdict(cluster.planner.table)
    if policy == "csps":
        planner = dict(partition_tokens=cluster.planner.spt, sizes=list(cluster.planner.sizes))
    # the trace as it was submitted (the loop submits a little after each arrival)
    submitted = [(live["submitted"][k], p, o) for k, (_, p, o) in enumerate(requests)]
    run = LiveRun(
        policy,
        FLAGS.prefill_instances,
        0 if policy == "esp" else FLAGS.decode_instances,
        FLAGS.node_size,
        submitted,
        prefill_model,
        step_cost,
        transfer,
        first.kv_tokens,
        first.engine.max_num_seqs,
        top,
        planner,
        prefill_chunk=FLAGS.prefill_chunk,
    )
    sim = replay(run)
    sim_rows = {int(r["id"]): r for r in sim.table()}
    rows = []
    for k, (arrival, p, o) in enumerate(submitted):
        ttft = live["first"][k] - arrival
        tpot = (live["finished"][k] - live["first"][k]) / (o - 1) if o > 1 else None
        rows.append(
            dict(
                arrival=arrival,
                prompt_len=p,
                output_len=o,
                live_ttft=ttft,
                live_tpot=tpot,
                sim_ttft=sim_rows[k]["ttft"],
                sim_tpot=sim_rows[k]["tpot"],
            )
        )
    device = f"{jax.devices()[0].device_kind} x {devices} (one process)"
    (out / f"{policy}.json").write_text(
        json.dumps(dict(device=device, run=run.to_dict(), requests=rows, events=dict(cluster.events)), indent=1)
    )
    pool = {d: i for i, d in enumerate(cluster.pool_ids)}
    live_bars = [
        plots.Bar(
            live["index"][c.request_id], tuple(pool[d] for d in c.group), c.start - live["start"], c.end - live["start"]
        )
        for c in cluster.records
    ]
    sim_bars = [plots.Bar(int(ids[0]), tuple(group), start, end) for ids, group, start, end in sim.prefills]
    plots.gantt(
        {f"{policy} live (measured)": live_bars, f"{policy} simulated (measured costs)": sim_bars},
        FLAGS.prefill_instances,
        str(out / f"{policy}_gantt.png"),
        title=f"{len(requests)} requests at {FLAGS.rate}/s, {policy} ({device})",
    )
    print(
        f"{policy}: events {dict(cluster.events)}; KV transfer {1e3 * transfer.fixed:.2f} ms + "
        f"{1e6 * transfer.per_token:.2f} us/token; wrote {out}/{policy}.json and {out}/{policy}_gantt.png"
    )
    table(out)


if __name__ == "__main__":
    app.run(main)
