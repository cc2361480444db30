"""A mixed trace served through the live cluster on CPU devices, each request's CDSP plan and TTFT next to the
simulator's for the same trace (sim/'s prefill pool, the same planner, the pool's measured Eq. (1)).

Read the comparison with this in mind: in one process the XLA CPU runtime runs one multi-device program at a
time, so chunks the planner puts side by side on disjoint groups run one after the other here, and the decode
steps take turns with them; the live TTFTs show the plans' ordering, not their overlap (on GPUs they overlap).
The simulator's chunk takes exactly its Eq. (1) prediction and nothing else runs.

    .venv/bin/python tools/bench_cluster.py --out=bench_out/cluster [--prefill_instances=6 --decode_instances=2
        --requests=16 --rate=0.3 --max_model_len=2048]

Writes run.json (trace, plans, chunks, TTFTs), plan_gantt.png (tools/plot_plan.py) and prints the table.
"""

from __future__ import annotations

import json
import os
import pathlib
import time

import numpy as np
from absl import app, flags
from tqdm.auto import tqdm

FLAGS = flags.FLAGS
flags.DEFINE_integer("prefill_instances", 6, "Instances in the CDSP prefill pool.")
flags.DEFINE_integer("decode_instances", 2, "Decode instances.")
flags.DEFINE_integer("node_size", 2, "Prefill instances per node.")
flags.DEFINE_integer("tp", 1, "Devices per instance, tensor-parallel (SmolLM2: 1 or 3).")
flags.DEFINE_integer("requests", 16, "Requests in the trace.")
flags.DEFINE_float("rate", 0.3, "Poisson arrival rate, requests/s.")
flags.DEFINE_float("long_fraction", 0.3, "Share of long prompts (max_model_len/2 .. max_model_len - 64 tokens; "
                   "the others 64-512).")
flags.DEFINE_integer("max_model_len", 2048, "Context length.")
flags.DEFINE_integer("min_chunk", 256, "Smallest CDSP chunk, tokens.")
flags.DEFINE_integer("seed", 0, "Trace seed.")
flags.DEFINE_string("out", "bench_out/cluster", "Directory for run.json and plan_gantt.png.")


def trace(rng: np.random.Generator) -> list[dict]:
    n, top = FLAGS.requests, FLAGS.max_model_len
    long = rng.random(n) < FLAGS.long_fraction
    prompt = np.where(long, rng.integers(top // 2, top - 64, n), rng.integers(64, 513, n))
    arrival = np.cumsum(rng.exponential(1 / FLAGS.rate, n))
    return [dict(arrival=float(a - arrival[0]), prompt_len=int(p), output_len=int(o))
            for a, p, o in zip(arrival, prompt, rng.integers(4, 17, n))]


def serve(llm, requests: list[dict], rng: np.random.Generator) -> tuple[dict[int, float], dict[str, int], float]:
    """Submit each request at its arrival time and step until all finish: first-token time per request (seconds
    from the start), request index per engine id, and the start on the cluster's clock."""
    from jaxserve.sampling_params import SamplingParams

    cluster = llm.engine
    prompts = [rng.integers(1000, 20000, r["prompt_len"]).tolist() for r in requests]
    index, first = {}, {}
    start = cluster.clock()
    pending = list(range(len(requests)))
    with tqdm(total=len(requests), desc="serve the trace", unit="request") as bar:
        while pending or cluster.has_unfinished():
            now = cluster.clock() - start
            while pending and requests[pending[0]]["arrival"] <= now:
                k = pending.pop(0)
                index[cluster.add_request(prompts[k], SamplingParams(max_tokens=requests[k]["output_len"],
                                                                     ignore_eos=True))] = k
            if not cluster.has_unfinished():
                time.sleep(max(0.0, min(0.01, requests[pending[0]]["arrival"] - now)))
                continue
            for out in cluster.step():
                k = index[out.request_id]
                if out.new_token_ids and k not in first:
                    first[k] = cluster.clock() - start
                bar.update(int(out.finished))
    return first, index, start


def main(argv: list[str]) -> None:
    del argv
    devices = (FLAGS.prefill_instances + FLAGS.decode_instances) * FLAGS.tp
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"  # before JAX's backend starts
    import jax

    import jaxserve
    from plot_plan import draw, simulate

    out = pathlib.Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(FLAGS.seed)
    requests = trace(rng)
    top = FLAGS.max_model_len
    llm = jaxserve.LLM(max_model_len=top, kv_cache_tokens=2 * top, max_num_seqs=4, max_num_batched_tokens=256,
                       prefill_instances=FLAGS.prefill_instances, decode_instances=FLAGS.decode_instances,
                       node_size=FLAGS.node_size, min_chunk=FLAGS.min_chunk, tp=FLAGS.tp)
    cluster = llm.engine
    first, index, start = serve(llm, requests, rng)
    pool_index = {d: i for i, d in enumerate(cluster.pool_ids)}
    chunks = [dict(request=index[c.request_id], group=[pool_index[d] for d in c.group], tokens=c.tokens,
                   history=c.history, start=c.start - start, end=c.end - start,
                   predicted_start=c.predicted_start - start, predicted_end=c.predicted_end - start)
              for c in cluster.records]
    for rid, k in index.items():
        requests[k]["live_plan"] = [[c.sp, c.tokens] for c in cluster.plans[rid].chunks]
        requests[k]["live_ttft"] = first[k] - requests[k]["arrival"]
        requests[k]["planned_ttft"] = cluster.plans[rid].ttft
    run = dict(device=f"{jax.devices()[0].device_kind} x {devices} (one process)", requests=requests, chunks=chunks,
               pool=dict(instances=FLAGS.prefill_instances, node_size=FLAGS.node_size, tp=FLAGS.tp),
               planner=dict(improvement_rate=cluster.planner.improvement_rate, sizes=cluster.planner.sizes,
                            min_chunk=cluster.planner.min_chunk),
               eq1=json.loads(cluster.planner.model.to_json()))
    sim = simulate(run)
    for r, plan in zip(requests, sim.plans):
        r["sim_plan"] = [[c.sp, c.tokens] for c in plan.chunks]
        r["sim_ttft"] = plan.ttft
    (out / "run.json").write_text(json.dumps(run, indent=1))
    draw(run, sim, str(out / "plan_gantt.png"))

    print(f"{'#':>3} {'arrive':>7} {'prompt':>6}  {'live plan (sp x tokens)':<28} {'sim plan':<28} "
          f"{'planned':>8} {'live':>8} {'sim':>8}")
    for k, r in enumerate(requests):
        fmt = lambda plan: " ".join(f"{sp}x{n}" for sp, n in plan)  # noqa: E731
        print(f"{k:>3} {r['arrival']:7.2f} {r['prompt_len']:>6}  {fmt(r['live_plan']):<28} {fmt(r['sim_plan']):<28} "
              f"{r['planned_ttft']:8.3f} {r['live_ttft']:8.3f} {r['sim_ttft']:8.3f}")
    live, sim_t = np.array([r["live_ttft"] for r in requests]), np.array([r["sim_ttft"] for r in requests])
    same = sum(r["live_plan"] == r["sim_plan"] for r in requests)
    err = np.array([c["end"] - c["start"] for c in chunks]) / np.array(
        [c["predicted_end"] - c["predicted_start"] for c in chunks])
    print(f"plans identical: {same}/{len(requests)}; TTFT live/sim: median {np.median(live / sim_t):.2f}x, "
          f"p90 {np.percentile(live / sim_t, 90):.2f}x; chunk time measured/Eq. (1): median {np.median(err):.2f}x")
    print(f"wrote {out}/run.json and {out}/plan_gantt.png")


if __name__ == "__main__":
    app.run(main)
