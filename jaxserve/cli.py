"""Command line: `python -m jaxserve <command> [--flags]` (absl flags; `--helpfull` lists them all).

Commands:
  generate  reply to --prompt (through the model's chat template unless --nochat), streaming to stdout
  serve     serve --model over gRPC (--grpc_port) and the OpenAI-compatible HTTP API (--http_port) until SIGTERM
  client    send --prompt to a running server over gRPC (--target) and stream the reply to stdout
  fetch     download a registered model into the local cache (the only step that needs the package index)
  simulate  replay a trace or synthetic mix through the scheduler on simulated replicas, or on a simulated
            cluster with --prefill_instances (serve's layout flags; no devices needed)
"""

from __future__ import annotations

import logging as std_logging
import os
import sys
import time
import typing
from typing import Any

from absl import app, flags, logging

from jaxserve import config, xla_flags
from jaxserve.sampling_params import SamplingParams

FLAGS = flags.FLAGS
# the sampling parameters `generate` and `client` take from the command line
SAMPLING_FLAGS = {
    "max_tokens": "Most tokens to generate.",
    "temperature": "Sampling temperature; 0 is greedy.",
    "top_k": "Keep the k most likely tokens (0: all).",
    "top_p": "Nucleus sampling mass in (0, 1].",
    "seed": "Sampling seed (default: random).",
    "stop": "Stop string (repeatable).",
    "min_p": "Keep tokens at least min_p times as likely as the most likely.",
    "presence_penalty": "Subtracted once from each token generated so far.",
    "frequency_penalty": "Subtracted per time each token was generated so far.",
    "repetition_penalty": "Divides positive logits of tokens already seen (1: off).",
    "min_tokens": "No EOS or stop before this many tokens.",
}


def _define(name: str, kind: Any, default: Any, help: str) -> None:
    """One absl flag of the field's type (X | None takes X's kind)."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) is typing.Literal:
        flags.DEFINE_enum(name, default, list(args), help)
    elif kind is bool:
        flags.DEFINE_bool(name, default, help)
    elif typing.get_origin(kind) is tuple:
        flags.DEFINE_multi_string(name, list(default), help)
    else:
        base = next((a for a in args if a is not type(None)), kind)
        define = {int: flags.DEFINE_integer, float: flags.DEFINE_float, str: flags.DEFINE_string}[base]
        define(name, default, help)


def _define_flags() -> None:
    """A flag for every setting of config.py (its default and help) and for the request's sampling parameters."""
    for flag, leaf in config.flags().items():
        _define(flag, leaf.kind, leaf.field.default, leaf.field.metadata["help"])
    kinds = typing.get_type_hints(SamplingParams)
    for name, help in SAMPLING_FLAGS.items():
        _define(name, kinds[name], SamplingParams.__dataclass_fields__[name].default, f"generate/client: {help}")


def _config(base: Any) -> Any:
    """base with every setting whose flag was given on the command line."""
    given = {}
    for name, leaf in config.leaves(type(base)).items():
        flag = config.flag_name(leaf.field)
        if flag and FLAGS[flag].present:
            value = FLAGS[flag].value
            given[name] = tuple(value) if isinstance(value, list) else value
    return config.replace(base, **given)


_define_flags()
COMMANDS = ("generate", "serve", "client", "fetch", "simulate")


def _sampling() -> dict:
    """The sampling flags `generate` and `client` share, once --prompt is known to be there."""
    if not FLAGS.prompt:
        raise ValueError("--prompt is required and must not be empty")
    return {name: tuple(FLAGS[name].value) if name == "stop" else FLAGS[name].value for name in SAMPLING_FLAGS}


def _join(model: config.ModelConfig) -> None:
    """Join the other processes when asked to (jax.distributed). A follower then replays the leader's device
    calls until the leader stops, and exits: its whole part in `serve` or `generate`."""
    dist = _config(config.DistributedConfig())
    if not (dist.coordinator_address or dist.distributed):
        return
    import jax

    from jaxserve import api

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts (GPUs use NCCL)
    jax.config.update("jax_enable_recoverability", True)  # a dead follower must not kill the leader: it fails
    # over and serves on (--heartbeat_timeout)
    jax.distributed.initialize(
        dist.coordinator_address, dist.num_processes, dist.process_id, heartbeat_timeout_seconds=dist.heartbeat_timeout
    )
    if jax.process_index() == 0:
        return
    api.follow(model)
    _exit_now()  # the leader's exit waits for this one's


def _generate() -> None:
    import jaxserve

    params = jaxserve.SamplingParams(**_sampling())
    engine = _config(config.EngineConfig())
    _join(engine.model)
    llm = jaxserve.LLM(engine)
    prompt = llm.chat_prompt([{"role": "user", "content": FLAGS.prompt}]) if FLAGS.chat else FLAGS.prompt
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if llm.engine.events:  # a cluster's: what its policy did (chunks, transfers, scale-ups, flips, ...)
        sys.stderr.write(f"cluster events: {', '.join(f'{k} {v}' for k, v in sorted(llm.engine.events.items()))}\n")
    llm.close()
    _exit_now()  # as serve: the processes leave jax.distributed together, before any teardown


def _api_key() -> str | None:
    return FLAGS.api_key or os.environ.get("JAXSERVE_API_KEY") or None


def _serve() -> None:
    import asyncio

    import jaxserve
    from jaxserve.server.launch import Server

    engine = config.replace(_config(config.EngineConfig()), warmup=True)
    _join(engine.model)
    llm = jaxserve.LLM(engine)
    server = Server(llm, _config(config.ServerConfig()), api_key=_api_key(), heartbeat_timeout=FLAGS.heartbeat_timeout)
    try:
        asyncio.run(server.serve_until_signalled())
    finally:
        llm.close()
    if server.engine.lost and not server.engine.failed_over:  # a step may be stuck waiting for the lost
        sys.stderr.write(f"error: {server.engine.lost}\n")  # process, and jax.distributed's exit too
        sys.stderr.flush()
        os._exit(3)
    _exit_now(leave=not server.engine.failed_over)  # a lost process cannot meet jax.distributed's exit barrier


# seconds the leader keeps the coordination service up after the shutdown barrier
SERVICE_GRACE_S = 2.0


def _exit_now(leave: bool = True) -> None:
    """Exit 0 without the interpreter's teardown, which frees each compiled program one by one (over a second,
    counted against drain_timeout); the OS takes the memory back at once. leave: leave jax.distributed first."""
    if leave:
        _leave_distributed()
    std_logging.shutdown()  # flushes the log handlers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _leave_distributed() -> None:
    """Every process leaves jax.distributed together: the client's shutdown is a barrier. The leader hosts the
    coordination service and keeps it up a moment after the barrier, so that the followers' shutdown calls get
    their answer: torn down at once, a follower's call could fail, and the follower aborted (status 134)."""
    from jax._src import distributed  # the service is not public; without it, jax.distributed.shutdown() alone

    import jax

    state = getattr(distributed, "global_state", None)
    service = getattr(state, "service", None)
    if service is not None:
        state.service = None  # jax.distributed.shutdown() below leaves it running
    jax.distributed.shutdown()
    if service is not None:
        time.sleep(SERVICE_GRACE_S)
        service.shutdown()


def _client() -> None:
    import grpc

    from jaxserve.client import Client

    params = _sampling()
    prompt = dict(messages=[{"role": "user", "content": FLAGS.prompt}]) if FLAGS.chat else dict(prompt=FLAGS.prompt)
    with Client(FLAGS.target, api_key=_api_key()) as client:
        try:
            for reply in client.stream(**prompt, **params):
                sys.stdout.write(reply.text)
                sys.stdout.flush()
        except grpc.RpcError as e:
            raise RuntimeError(f"{FLAGS.target}: {e.code().name}: {e.details()}") from None
    sys.stdout.write("\n")


def _fetch() -> None:
    from jaxserve.models import registry

    print(registry.fetch_model(FLAGS.model))


def _flags_of(section: type) -> set[str]:
    return {f for leaf in config.leaves(section).values() if (f := config.flag_name(leaf.field))}


def _simulate() -> None:
    import json

    from jaxserve.sim import plots, run

    w, sim = _config(config.WorkloadConfig()), _config(config.SimConfig())
    workload = run.make_workload(
        w.trace, w.rate, w.requests, seed=w.seed, long_fraction=w.long_fraction, arrival=w.arrival, cv=w.cv
    )
    if FLAGS.prefill_instances:  # a cluster, from the flags that serve it
        from jaxserve.sim.cluster import simulate_cluster

        layout = _config(config.ParallelConfig())
        # the replicas' settings (their scheduler's included) mean nothing to a cluster's simulation
        unread = sorted(
            f
            for f in _flags_of(config.SimConfig) - _flags_of(config.ParallelConfig) - {"profile", "out"}
            if FLAGS[f].present
        )
        if unread:
            raise ValueError(
                f"{', '.join('--' + f for f in unread)}: not read when simulating a cluster "
                f"(--prefill_instances); leave {'it' if len(unread) == 1 else 'them'} out"
            )
        results, label = simulate_cluster(workload, layout, sim.profile), layout.cluster_policy
    else:
        if FLAGS["tp"].present:  # --tp is the engine's setting; a simulated replica takes it too
            sim = config.replace(sim, tp=FLAGS.tp)
        results, label = run.simulate(workload, sim), sim.scheduler.policy
    summary = results.summary()
    print(json.dumps(summary, indent=1))
    if sim.out:
        os.makedirs(sim.out, exist_ok=True)
        results.to_json(os.path.join(sim.out, "summary.json"))
        results.to_csv(os.path.join(sim.out, "requests.csv"))
        plots.ttft_cdf(
            {label: results},
            os.path.join(sim.out, "ttft_cdf.png"),
            which="all",
            title=f"{workload.name}, {workload.rate:.2f} req/s",
        )
        print(f"wrote {sim.out}/summary.json, requests.csv, ttft_cdf.png")


def main(argv: list[str]) -> None:
    xla_flags.for_gpu(os.environ)
    if len(argv) != 2 or argv[1] not in COMMANDS:
        raise app.UsageError(f"usage: python -m jaxserve {{{'|'.join(COMMANDS)}}} [--flags]; got {argv[1:]}")
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # keep library INFO logs (orbax) off the reply
    try:
        commands = {"generate": _generate, "serve": _serve, "client": _client, "fetch": _fetch, "simulate": _simulate}
        commands[argv[1]]()
    except (ValueError, RuntimeError, OSError) as e:  # bad input or set-up: one line, not a traceback
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)


def run() -> None:
    app.run(main)
