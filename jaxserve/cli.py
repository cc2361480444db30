"""Command line: `python -m jaxserve <command> [--flags]` (absl flags; `--helpfull` lists them all).

Commands:
  generate  reply to --prompt (through the model's chat template unless --nochat), streaming to stdout
  serve     serve --model over gRPC (--grpc_port) and the OpenAI-compatible HTTP API (--http_port) until SIGTERM
  client    send --prompt to a running server over gRPC (--target) and stream the reply to stdout
  fetch     download a registered model into the local cache (the only step that needs the package index)
  simulate  replay a trace or synthetic mix through the scheduler on a simulated cluster (no devices needed)
"""

from __future__ import annotations

import logging as std_logging
import os
import sys

from absl import app, flags, logging

from jaxserve import xla_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "Registered model name, .gguf file, or Hugging Face directory.")
flags.DEFINE_string("prompt", None, "Prompt text for `generate` and `client`.")
flags.DEFINE_bool("chat", True, "Wrap --prompt in the model's chat template as a user message.")
flags.DEFINE_integer("max_tokens", 128, "Most tokens to generate.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.")
flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0: all).")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass in (0, 1].")
flags.DEFINE_integer("seed", None, "Sampling seed (default: random).")
flags.DEFINE_multi_string("stop", [], "Stop string (repeatable).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights and KV cache dtype.")
flags.DEFINE_integer("max_model_len", None, "Context length (default: the model's).")

flags.DEFINE_string("host", "127.0.0.1", "serve: address to bind (0.0.0.0 or :: to listen beyond this machine).")
flags.DEFINE_integer("grpc_port", 50051, "serve: gRPC port (0: any free port).")
flags.DEFINE_integer("http_port", 8000, "serve: HTTP port of the OpenAI-compatible API (0: any free port).")
flags.DEFINE_string("api_key", None, "serve: key both interfaces require (`Authorization: Bearer <key>`); "
                    "client: the key to send. Default: $JAXSERVE_API_KEY, if set.")
flags.DEFINE_string("served_model_name", None, "serve: the model name clients use (default: --model).")
flags.DEFINE_integer("max_num_seqs", 16, "serve: most requests in the running batch.")
flags.DEFINE_integer("max_queue", 256, "serve: most requests waiting beyond the batch; more are refused "
                     "(RESOURCE_EXHAUSTED / HTTP 429).")
flags.DEFINE_float("kv_cache_gib", 2.0, "serve: KV cache size, GiB.")
flags.DEFINE_bool("quick_start", True, "serve: listen once the first requests' programs compile; the rest compile "
                  "in the background, and an uncached cost profile is measured when first idle (--noquick_start: "
                  "compile and measure everything before listening, so nothing compiles while serving).")
flags.DEFINE_float("drain_timeout", 30.0, "serve: on SIGTERM, seconds the whole shutdown may take (in-flight requests get most of it to finish).")
flags.DEFINE_integer("max_request_bytes", 32 << 20, "serve: the largest HTTP request body read; larger ones get 413 "
                     "before any parsing.")
flags.DEFINE_float("stall_timeout", 60.0, "serve: seconds without engine progress, with requests open, before "
                   "health reports NOT_SERVING (HTTP /health 503).")
flags.DEFINE_float("request_read_timeout", 30.0, "serve: seconds an HTTP client may take to send its request "
                   "headers (the connection is closed past it) and between two pieces of its body (408 past it).")
flags.DEFINE_string("target", "127.0.0.1:50051", "client: the server's gRPC address.")

flags.DEFINE_string("policy", "lars", "serve/generate/simulate: the scheduler's prefill ordering policy (fcfs, sjf, "
                    "ljf, edf, lrs, lars).")
flags.DEFINE_string("trace", "azure_conv", "simulate: azure_conv, azure_code, arxiv, or mix (short + long requests).")
flags.DEFINE_float("rate", None, "simulate: arrival rate, requests/s (traces: rescaled to it; default: as recorded).")
flags.DEFINE_integer("requests", None, "simulate: number of requests (default: the whole trace).")
flags.DEFINE_string("out", None, "simulate: directory for summary.json, requests.csv and ttft_cdf.png.")
flags.DEFINE_string("profile", "a100_llama3_8b", "simulate: GPU/model profile (a100_llama3_8b, h100_llama2_7b, "
                    "h100_llama2_70b).")
flags.DEFINE_integer("stages", 1, "simulate: pipeline stages per replica.")
flags.DEFINE_integer("replicas", 1, "simulate: number of replicas.")
flags.DEFINE_integer("kvp", 1, "simulate: KV-parallel worker groups per replica (Medha's KVP).")
flags.DEFINE_integer("kvp_tokens", None, "simulate: tokens of one sequence a KVP worker holds before the next "
                     "joins (default: what its memory holds).")
flags.DEFINE_float("t_target", 0.05, "simulate: iteration time budget, seconds (from the TPOT SLO).")
flags.DEFINE_bool("space_sharing", True, "serve/generate/simulate: long prefills yield budget by relative slack "
                  "(Medha).")
flags.DEFINE_bool("multi_prefill", True, "serve/generate/simulate: several prefill chunks per batch (--nomulti_prefill "
                  "with --policy=fcfs is one prompt's chunk per step, the old engine's behaviour).")
flags.DEFINE_float("iteration_budget", None, "serve/generate: most seconds a step may take by the cost model "
                   "(default: the measured time of a full step of --max_num_batched_tokens in --max_num_seqs "
                   "rows, all decodes at --max_model_len but one fresh prompt's chunk).")
flags.DEFINE_integer("max_num_batched_tokens", 512, "serve/generate: most tokens in one step.")
flags.DEFINE_integer("max_prefills_per_step", 8, "serve/generate: most prompts' chunks in one step (the compiled "
                     "step's attention runs over room for that many partial tiles, used or not).")
flags.DEFINE_integer("num_scheduler_steps", 1, "serve/generate/simulate: multi-step decode: when no prompt waits, "
                     "up to this many decode steps run in one device loop (as many as fit the iteration budget).")
flags.DEFINE_float("ttft_slo", 1.0, "serve/generate: seconds to the first token a prompt is due (or 3x its prefill "
                   "time alone, if longer); a request may set its own (gRPC/HTTP field ttft_slo).")
flags.DEFINE_bool("prefix_caching", True, "serve/generate: reuse cached KV of shared prompt prefixes.")
flags.DEFINE_string("cost_profile", None, "serve/generate: the step cost profile to load, or to measure and write "
                    "(default: measured at first start, cached per device, model and dtype).")
flags.DEFINE_integer("tp", None, "Tensor-parallel degree. serve/generate (default 1): devices per instance, each "
                     "holding a share of every layer's attention heads and MLP (the model's heads must divide by it); "
                     "without a cluster layout the engine is one instance on the first --tp devices. simulate "
                     "(default 8): per simulated replica.")
flags.DEFINE_integer("prefill_instances", 0, "serve/generate: instances (from the first device) forming a CDSP "
                     "prefill pool; with more than 0 the engine is a live cluster (prompts chunked over growing SP "
                     "groups, their KV streamed to decode instances). 0: one engine on one instance.")
flags.DEFINE_integer("decode_instances", 1, "serve/generate: decode instances after the prefill pool (with "
                     "--prefill_instances).")
flags.DEFINE_integer("decode_kvp", 1, "serve/generate: instances per decode instance; more than 1 splits its KV "
                     "cache over them (KV-parallel decode).")
flags.DEFINE_integer("node_size", 2, "serve/generate: prefill instances per node (the planner keeps groups on whole "
                     "nodes where it can).")
flags.DEFINE_integer("receive_buffers", 4, "serve/generate: KV transfers a decode instance receives at once.")
flags.DEFINE_integer("min_chunk", 1024, "serve/generate: the smallest CDSP chunk, tokens.")
flags.DEFINE_string("prefill_profile", None, "serve/generate: the prefill pool's Eq. (1) profile to load, or to "
                    "measure and write (default: measured at first start, cached per device, model and pool).")
flags.DEFINE_string("coordinator_address", None, "serve/generate across processes (jax.distributed): HOST:PORT of "
                    "process 0, which runs the servers and the scheduler; the others replay its device calls.")
flags.DEFINE_integer("num_processes", None, "serve/generate across processes: how many (with --coordinator_address).")
flags.DEFINE_integer("process_id", None, "serve/generate across processes: this one's rank, 0 to --num_processes - 1.")
flags.DEFINE_bool("distributed", False, "serve/generate across processes, the cluster (e.g. SLURM) detected by "
                  "jax.distributed instead of --coordinator_address/--num_processes/--process_id.")
flags.DEFINE_integer("heartbeat_timeout", 10, "serve/generate across processes: seconds without a heartbeat after "
                     "which a process counts as dead and the job ends.")
flags.DEFINE_float("long_fraction", 0.05, "simulate: share of long requests in --trace=mix.")
flags.DEFINE_enum("arrival", "poisson", ["poisson", "gamma"], "simulate: arrival process of --trace=mix.")
flags.DEFINE_float("cv", 1.0, "simulate: coefficient of variation of gamma inter-arrival times (1 = Poisson).")
flags.DEFINE_float("ttft_min", 1.0, "simulate: smallest TTFT deadline, seconds.")
flags.DEFINE_float("ttft_factor", 3.0, "simulate: TTFT deadline = max(ttft_min, factor * prefill time alone).")
flags.DEFINE_float("tpot_slo", 0.1, "simulate: time-per-output-token SLO, seconds.")

COMMANDS = ("generate", "serve", "client", "fetch", "simulate")


def _sampling_flags() -> dict:
    """The sampling flags `generate` and `client` share, once --prompt is known to be there."""
    if not FLAGS.prompt:
        raise ValueError("--prompt is required and must not be empty")
    return dict(max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p,
                seed=FLAGS.seed, stop=tuple(FLAGS.stop))


def _tp(default: int) -> int:
    """--tp, whose default depends on the command."""
    return default if FLAGS.tp is None else FLAGS.tp


def _engine_flags() -> dict:
    """The engine and scheduler flags `generate` and `serve` share."""
    return dict(dtype=FLAGS.dtype, max_model_len=FLAGS.max_model_len, policy=FLAGS.policy,
                space_sharing=FLAGS.space_sharing, multi_prefill=FLAGS.multi_prefill,
                iteration_budget=FLAGS.iteration_budget, max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                max_prefills_per_step=FLAGS.max_prefills_per_step, ttft_slo=FLAGS.ttft_slo,
                num_scheduler_steps=FLAGS.num_scheduler_steps,
                prefix_caching=FLAGS.prefix_caching, cost_profile=FLAGS.cost_profile, tp=_tp(1),
                prefill_instances=FLAGS.prefill_instances, decode_instances=FLAGS.decode_instances,
                decode_kvp=FLAGS.decode_kvp, node_size=FLAGS.node_size, receive_buffers=FLAGS.receive_buffers,
                min_chunk=FLAGS.min_chunk, prefill_profile=FLAGS.prefill_profile)


def _join() -> None:
    """Join the other processes when asked to (jax.distributed). A follower then replays the leader's device
    calls until the leader stops, and exits: its whole part in `serve` or `generate`."""
    if not (FLAGS.coordinator_address or FLAGS.distributed):
        return
    import jax

    from jaxserve import api

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts (GPUs use NCCL)
    jax.config.update("jax_enable_recoverability", True)  # a dead follower must not kill the leader: it ends
    # its requests with UNAVAILABLE first (--heartbeat_timeout)
    jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                               heartbeat_timeout_seconds=FLAGS.heartbeat_timeout)
    if jax.process_index() == 0:
        return
    api.follow(FLAGS.model, dtype=FLAGS.dtype)
    _exit_now()  # the leader's exit waits for this one's


def _generate() -> None:
    import jaxserve

    params = jaxserve.SamplingParams(**_sampling_flags())
    _join()
    llm = jaxserve.LLM(FLAGS.model, **_engine_flags())
    prompt = llm.chat_prompt([{"role": "user", "content": FLAGS.prompt}]) if FLAGS.chat else FLAGS.prompt
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    llm.close()


def _api_key() -> str | None:
    return FLAGS.api_key or os.environ.get("JAXSERVE_API_KEY") or None


def _serve() -> None:
    import asyncio

    import jaxserve
    from jaxserve.server.launch import Server

    _join()
    llm = jaxserve.LLM(FLAGS.model, kv_cache_gib=FLAGS.kv_cache_gib, max_num_seqs=FLAGS.max_num_seqs,
                       warmup=True, quick_start=FLAGS.quick_start, **_engine_flags())
    server = Server(llm, host=FLAGS.host, grpc_port=FLAGS.grpc_port, http_port=FLAGS.http_port,
                    model_name=FLAGS.served_model_name, api_key=_api_key(),
                    max_queue=FLAGS.max_queue, drain_timeout=FLAGS.drain_timeout,
                    max_body_bytes=FLAGS.max_request_bytes, read_timeout=FLAGS.request_read_timeout,
                    stall_timeout=FLAGS.stall_timeout, heartbeat_timeout=FLAGS.heartbeat_timeout)
    try:
        asyncio.run(server.serve_until_signalled())
    finally:
        llm.close()
    if server.engine.lost:  # a step may be stuck waiting for the lost process, and jax.distributed's exit too
        sys.stderr.write(f"error: {server.engine.lost}\n")
        sys.stderr.flush()
        os._exit(3)
    _exit_now()


def _exit_now() -> None:
    """Exit 0 without the interpreter's teardown, which frees each compiled program one by one (over a second,
    counted against drain_timeout); the OS takes the memory back at once."""
    import jax
    jax.distributed.shutdown()  # with several processes: the exit every process makes together
    std_logging.shutdown()  # flushes the log handlers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _client() -> None:
    import grpc

    from jaxserve.client import Client

    params = _sampling_flags()
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


def _simulate() -> None:
    import json

    from jaxserve.sched.slo import SLO
    from jaxserve.sim import plots, run

    workload = run.make_workload(FLAGS.trace, FLAGS.rate, FLAGS.requests, seed=FLAGS.seed or 0,
                                 long_fraction=FLAGS.long_fraction, arrival=FLAGS.arrival, cv=FLAGS.cv)
    config = run.config_for(FLAGS.policy, FLAGS.profile, _tp(8), FLAGS.stages, FLAGS.replicas, FLAGS.t_target,
                            FLAGS.space_sharing, FLAGS.multi_prefill,
                            slo=SLO(FLAGS.ttft_min, FLAGS.ttft_factor, FLAGS.tpot_slo), kvp=FLAGS.kvp,
                            kvp_tokens=FLAGS.kvp_tokens, num_scheduler_steps=FLAGS.num_scheduler_steps)
    results = run.simulate(workload, config)
    summary = results.summary()
    print(json.dumps(summary, indent=1))
    if FLAGS.out:
        os.makedirs(FLAGS.out, exist_ok=True)
        results.to_json(os.path.join(FLAGS.out, "summary.json"))
        results.to_csv(os.path.join(FLAGS.out, "requests.csv"))
        plots.ttft_cdf({FLAGS.policy: results}, os.path.join(FLAGS.out, "ttft_cdf.png"), which="all",
                       title=f"{workload.name}, {workload.rate:.2f} req/s")
        print(f"wrote {FLAGS.out}/summary.json, requests.csv, ttft_cdf.png")


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
