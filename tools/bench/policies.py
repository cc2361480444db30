"""Scheduling policies live, against the real server, and the same arrivals replayed in the simulator.

A stream of short requests (Poisson arrivals) plus a few long prompts (>= 3/4 of --max_model_len) is sent to
`python -m jaxserve serve` through the openai client (streaming /v1/completions with token-id prompts, so
lengths are exact and no prefix is shared; prefix caching is off, as in the simulator). Each variant gets a
fresh server on the same cost profile (measured once, by the first server, into a file they all load). Per
variant: P50/P99 TTFT of the short requests and TTFT-SLO attainment (the deadline the scheduler ranks by:
max(--ttft_slo, 3 x the prompt's prefill time alone)). Then sim/ replays the same arrivals with the same
scheduler settings and the engine's cost model, twice: as profiled at start-up, and fitted to the run (each
step charged at the model's time x the live steps' wall time over the model's estimate of them, from the
server's /metrics; the scheduler still plans with the model, as the live one did). The simulated P50/P99 TTFT
are set beside the live ones. Writes docs/figures/live_policies.json, live_policies_ttft.png and
live_policies_sim.png.

    .venv/bin/python tools/bench/policies.py [--rate=0.75] [--longs=6] [--duration=60] \
        [--variants=fcfs,edf,edf_multi,lars_ss]
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import pathlib
import tempfile
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import openai  # noqa: E402
from absl import app, flags  # noqa: E402
from tqdm import tqdm  # noqa: E402

from jaxserve.sched.batch_cost import EngineStepCost  # noqa: E402
from jaxserve.config import SLO, SchedulerConfig, SimConfig  # noqa: E402
from jaxserve.sched.build import packer_config  # noqa: E402
from jaxserve.sched.packer import PackerConfig  # noqa: E402
from jaxserve.sched.request import Request, RequestStatus  # noqa: E402
from jaxserve.server.spawn import ServerProcess  # noqa: E402
from jaxserve.sim.metrics import Results  # noqa: E402
from jaxserve.sim.simulator import Simulator  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("variants", ["fcfs", "edf", "edf_multi", "lars_ss"], "Which of VARIANTS to run, in order.")
flags.DEFINE_float("rate", 0.75, "Short requests per second (Poisson).")
flags.DEFINE_float("duration", 60.0, "Seconds over which requests arrive.")
flags.DEFINE_integer("longs", 6, "Long prompts, spread evenly over the duration.")
flags.DEFINE_list("short_prompt", ["32", "256"], "Short prompt length range, tokens.")
flags.DEFINE_list("short_output", ["8", "32"], "Short output length range, tokens.")
flags.DEFINE_integer("long_output", 8, "Tokens generated for a long prompt.")
flags.DEFINE_integer("max_model_len", 2048, "Server context; long prompts take 3/4 to 15/16 of it.")
flags.DEFINE_integer("max_num_seqs", 32, "Server's running batch.")
flags.DEFINE_integer("max_num_batched_tokens", 512, "Server's step token budget.")
flags.DEFINE_float("kv_cache_gib", 0.5, "Server's KV pool.")
flags.DEFINE_float("ttft_slo", 1.0, "Seconds: the shortest TTFT deadline.")
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_string("cost_profile", "", "Cost profile file (default: a temporary one, measured by the first server).")
flags.DEFINE_string("out", "docs/figures", "Where live_policies.json and the plots go.")

# key -> (label, policy, multi-prefill, space sharing); fcfs is the old engine's behaviour (one prompt's chunk a
# step, in arrival order); edf_multi separates what multi-prefill batching gives from what LARS adds
VARIANTS = {
    "fcfs": ("FCFS, one prefill/step", "fcfs", False, False),
    "edf": ("EDF, one prefill/step", "edf", False, False),
    "edf_multi": ("EDF + multi-prefill", "edf", True, False),
    "lars_ss": ("LARS + space sharing", "lars", True, True),
}
API_KEY = "bench"
MODEL = "bench"


@dataclasses.dataclass
class Arrival:
    time: float  # seconds after the start
    prompt: list[int]
    output_len: int
    long: bool


def workload(rng: np.random.Generator) -> list[Arrival]:
    lo, hi = (int(x) for x in FLAGS.short_prompt)
    olo, ohi = (int(x) for x in FLAGS.short_output)
    times = np.cumsum(rng.exponential(1 / FLAGS.rate, int(FLAGS.rate * FLAGS.duration * 2)))
    times = times[times < FLAGS.duration]
    out = [
        Arrival(
            float(t),
            rng.integers(1000, 30000, int(rng.integers(lo, hi + 1))).tolist(),
            int(rng.integers(olo, ohi + 1)),
            False,
        )
        for t in times
    ]
    m = FLAGS.max_model_len
    for i in range(FLAGS.longs):
        n = int(rng.integers(3 * m // 4, 15 * m // 16 - FLAGS.long_output))
        out.append(
            Arrival(
                FLAGS.duration * (i + 0.5) / FLAGS.longs, rng.integers(1000, 30000, n).tolist(), FLAGS.long_output, True
            )
        )
    return sorted(out, key=lambda a: a.time)


def server_flags(policy: str, multi: bool, sharing: bool, cost_profile: str) -> list[str]:
    return [
        f"--policy={policy}",
        f"--{'' if multi else 'no'}multi_prefill",
        f"--{'' if sharing else 'no'}space_sharing",
        "--noenable_prefix_caching",
        f"--cost_profile={cost_profile}",
        f"--max_model_len={FLAGS.max_model_len}",
        f"--max_num_seqs={FLAGS.max_num_seqs}",
        f"--max_num_batched_tokens={FLAGS.max_num_batched_tokens}",
        f"--kv_cache_gib={FLAGS.kv_cache_gib}",
        f"--ttft_slo={FLAGS.ttft_slo}",
        f"--served_model_name={MODEL}",
        f"--api_key={API_KEY}",
        "--max_queue=4096",
    ]


async def drive(port: int, arrivals: list[Arrival], bar: tqdm) -> list[Request]:
    """Send every request at its arrival time; its timeline as the client saw it (seconds after the start)."""
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=3600)
    start = time.monotonic()

    async def one(i: int, a: Arrival) -> Request:
        r = Request(str(i), a.time, len(a.prompt), a.output_len)
        await asyncio.sleep(max(a.time - (time.monotonic() - start), 0))
        stream = await client.completions.create(
            model=MODEL, prompt=a.prompt, max_tokens=a.output_len, stream=True, extra_body={"ignore_eos": True}
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                r.add_tokens(1, time.monotonic() - start)
        r.generated = a.output_len  # a chunk may carry more than one token (or none, mid-character)
        r.finish(RequestStatus.FINISHED_LENGTH, r.last_token_at)
        bar.update()
        return r

    try:
        return await asyncio.gather(*(one(i, a) for i, a in enumerate(arrivals)))
    finally:
        await client.close()


def summarize(requests: list[Request], long_threshold: int) -> dict[str, float]:
    s = Results(
        requests,
        [],
        span=max(r.finished_at for r in requests),
        wall_seconds=0.0,
        config={},
        long_threshold=long_threshold,
    ).summary()
    return {
        "short_ttft_p50": s["short"]["ttft_p50"],
        "short_ttft_p99": s["short"]["ttft_p99"],
        "long_ttft_p50": s["long"]["ttft_p50"],
        "ttft_p50": s["all"]["ttft_p50"],
        "ttft_p99": s["all"]["ttft_p99"],
        "ttft_attainment": s["all"]["ttft_attainment"],
        "short_ttft_attainment": s["short"]["ttft_attainment"],
    }


def packer(cost: EngineStepCost, multi: bool, sharing: bool) -> PackerConfig:
    """The packer the server runs with these flags."""
    return packer_config(
        scheduler(multi, sharing),
        cost,
        max_model_len=FLAGS.max_model_len,
        chunk_align=cost.shapes.tokens[0],
        max_prefills=cost.shapes.max_prefills,
    )


def scheduler(multi: bool, sharing: bool, policy: str = "lars") -> SchedulerConfig:
    """The server's scheduler settings under these flags."""
    return SchedulerConfig(
        policy=policy,
        max_num_batched_tokens=FLAGS.max_num_batched_tokens,
        max_num_seqs=FLAGS.max_num_seqs,
        multi_prefill=multi,
        space_sharing=sharing,
        slo=SLO(ttft_slo=FLAGS.ttft_slo),
    )


def simulate(
    arrivals: list[Arrival],
    cost: EngineStepCost,
    kv_tokens: int,
    policy: str,
    multi: bool,
    sharing: bool,
    time_scale: float = 1.0,
) -> list[Request]:
    """The same arrivals through the simulator, with the server's scheduler, packer and cost model."""
    live = packer(cost, multi, sharing)
    config = SimConfig(
        tp=1,
        scheduler=dataclasses.replace(scheduler(multi, sharing, policy), iteration_budget=live.iteration_budget),
        chunk_align=live.chunk_align,
        long_threshold=live.long_threshold,
        max_prefills=live.max_prefills,
        kv_capacity=kv_tokens,
        time_scale=time_scale,
    )
    requests = [Request(str(i), a.time, len(a.prompt), a.output_len) for i, a in enumerate(arrivals)]
    return Simulator(config, cost).run_requests(requests, progress=False).requests


def plot(
    rows: list[dict], live: dict[str, list[Request]], path_cdf: pathlib.Path, path_sim: pathlib.Path, threshold: int
) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for row in rows:
        ttft = np.sort([r.first_token_at - r.arrival for r in live[row["key"]] if r.prompt_len < threshold])
        ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=row["label"])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT of short requests (s)")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"live, CPU: {FLAGS.rate:g} short req/s + {FLAGS.longs} long prompts")
    fig.tight_layout()
    fig.savefig(path_cdf, dpi=110)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(rows))
    for ax, stat in zip(axes, ("ttft_p50", "ttft_p99")):
        for k, (key, label) in enumerate(
            (
                ("live", "live"),
                ("sim", "simulated, profiled model"),
                ("sim_fitted", "simulated, model fitted to the run"),
            )
        ):
            ax.bar(x + (k - 1) * 0.27, [r[key][stat] for r in rows], 0.27, label=label)
        ax.set_xticks(x, [r["label"] for r in rows], rotation=15, fontsize=8)
        ax.set_ylabel(f"{stat.replace('_', ' ').upper()} (s), all requests")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.suptitle("live server vs sim/ replay of the same arrivals (the engine's cost model)")
    fig.tight_layout()
    fig.savefig(path_sim, dpi=110)


def main(argv: list[str]) -> None:
    del argv
    for name in ("httpx", "httpx2"):  # openai's HTTP client (httpx2 in recent releases)
        logging.getLogger(name).setLevel(logging.WARNING)  # a line per request drowns the progress bar
    arrivals = workload(np.random.default_rng(FLAGS.seed))
    out = pathlib.Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, live = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        cost_path = FLAGS.cost_profile or str(pathlib.Path(tmp) / "cost.json")
        for key in FLAGS.variants:
            label, policy, multi, sharing = VARIANTS[key]
            with ServerProcess(*server_flags(policy, multi, sharing, cost_path)) as server:
                cost = EngineStepCost.from_dict(json.loads(pathlib.Path(cost_path).read_text()))
                kv_tokens = int(server.metrics()["jaxserve_kv_cache_blocks_free"]) * 16  # block size
                with tqdm(total=len(arrivals), desc=label, unit="req") as bar:
                    live[key] = asyncio.run(drive(server.http_port, arrivals, bar))
                m = server.metrics()
                steps = {
                    "count": m["jaxserve_engine_step_seconds_count"],
                    "live_s": m["jaxserve_engine_step_seconds_sum"],
                    "model_s": m["jaxserve_engine_step_predicted_seconds_total"],
                }
            threshold = packer(cost, multi, sharing).long_threshold
            simulated = simulate(arrivals, cost, kv_tokens, policy, multi, sharing)
            fitted = simulate(arrivals, cost, kv_tokens, policy, multi, sharing, steps["live_s"] / steps["model_s"])
            for lr, sr in zip(live[key], simulated):  # the deadline depends on the prompt only: the sim's applies
                lr.ttft_deadline, lr.tpot_slo = sr.ttft_deadline - sr.arrival + lr.arrival, sr.tpot_slo
            rows.append(
                {
                    "key": key,
                    "label": label,
                    "live": summarize(live[key], threshold),
                    "sim": summarize(simulated, threshold),
                    "sim_fitted": summarize(fitted, threshold),
                    "steps": steps,
                }
            )
    shorts = sum(not a.long for a in arrivals)
    print(
        f"{len(arrivals)} requests ({shorts} short at {FLAGS.rate:g}/s, {len(arrivals) - shorts} long) over "
        f"{FLAGS.duration:g} s; TTFT in seconds"
    )
    print(
        f"{'variant':24s} {'short P50':>9s} {'short P99':>9s} {'long P50':>8s} {'TTFT SLO met':>12s} "
        f"{'all P50 live/sim':>17s} {'all P99 live/sim':>17s}"
    )
    for r in rows:
        lv, sm = r["live"], r["sim"]
        print(
            f"{r['label']:24s} {lv['short_ttft_p50']:9.3f} {lv['short_ttft_p99']:9.3f} {lv['long_ttft_p50']:8.2f} "
            f"{lv['ttft_attainment']:12.1%} {lv['ttft_p50']:8.3f}/{sm['ttft_p50']:<8.3f} "
            f"{lv['ttft_p99']:8.3f}/{sm['ttft_p99']:<8.3f}"
        )
    by_key = {r["key"]: r for r in rows}
    if "fcfs" in by_key:
        for r in rows[1:]:
            print(
                f"P50 short TTFT, {by_key['fcfs']['label']} / {r['label']}: "
                f"{by_key['fcfs']['live']['short_ttft_p50'] / r['live']['short_ttft_p50']:.1f}x"
            )
    for r in rows:
        st = r["steps"]
        print(
            f"{r['label']}: live steps took {st['live_s'] / st['model_s']:.2f}x the cost model's estimate "
            f"({st['count']:.0f} steps, mean {st['live_s'] / st['count'] * 1e3:.0f} ms)"
        )
        for key, what in (("sim", "profiled"), ("sim_fitted", "fitted")):
            errs = [abs(r[key][s] / r["live"][s] - 1) for s in ("ttft_p50", "ttft_p99")]
            print(
                f"  sim ({what} model) vs live: all P50 {r[key]['ttft_p50']:.2f} s, off by {errs[0]:.0%}; "
                f"P99 {r[key]['ttft_p99']:.2f} s, off by {errs[1]:.0%}"
            )
    settings = {
        k: getattr(FLAGS, k)
        for k in (
            "rate",
            "duration",
            "longs",
            "short_prompt",
            "short_output",
            "long_output",
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "kv_cache_gib",
            "ttft_slo",
            "seed",
        )
    }
    (out / "live_policies.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    plot(rows, live, out / "live_policies_ttft.png", out / "live_policies_sim.png", threshold)
    print(f"wrote {out}/live_policies.json, live_policies_ttft.png, live_policies_sim.png")


if __name__ == "__main__":
    app.run(main)
