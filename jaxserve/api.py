"""Python API: `LLM(model=...)` with generate / stream / chat."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import math
import pathlib
from typing import Callable, Iterator, Sequence

import jax
import numpy as np
from absl import logging
from tqdm.auto import tqdm

from jaxserve.engine import profile, scoring
from jaxserve.cluster import pool_profile
from jaxserve.cluster import lockstep
from jaxserve.cluster.build import Layout, build, warmup
from jaxserve.cluster.engine import ClusterEngine
from jaxserve.engine.batch import Buckets
from jaxserve.engine.engine import Engine, RequestOutput
from jaxserve.engine.kv_cache import cache_dtype
from jaxserve.engine.runner import ModelRunner
from jaxserve.engine.sampling import SamplingParams
from jaxserve.models import registry
from jaxserve.models.loader import DTYPES, load_weights
from jaxserve.sched.kv_manager import KVCacheManager
from jaxserve.sched.batch_cost import EngineStepCost
from jaxserve.sched.packer import PackerConfig, engine_packer
from jaxserve.sched.policies import make_policy
from jaxserve.sched.scheduler import ReplicaScheduler
from jaxserve.sched.slo import SLO

Messages = Sequence[dict[str, str]]


@dataclasses.dataclass
class Completion:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str


def _enable_compilation_cache() -> None:
    """Keep compiled step functions on disk so a restart skips XLA compilation (unless the user set a cache)."""
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(registry.cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


class LLM:
    """A model with its engine: the scheduler in sched/ drives one compiled step per iteration.

    Several generate/stream callers may interleave (e.g. two open streams): every engine step's outputs are
    routed to per-request queues, so no caller loses another's tokens. Not thread-safe: one thread drives it.
    """

    def __init__(self, model: str = registry.DEFAULT_MODEL, *, dtype: str = "float32",
                 max_model_len: int | None = None, kv_cache_tokens: int | None = None,
                 kv_cache_gib: float = 2.0, block_size: int = 16, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, max_prefills_per_step: int = 8, policy: str = "lars",
                 space_sharing: bool = True,
                 multi_prefill: bool = True, iteration_budget: float | None = None, ttft_slo: float = 1.0,
                 prefix_caching: bool = True, cost_profile: str | None = None, key_block: int = 256,
                 tp: int = 1, prefill_instances: int = 0, decode_instances: int = 1, decode_kvp: int = 1,
                 node_size: int = 2, receive_buffers: int = 4, min_chunk: int = 1024,
                 prefill_profile: str | None = None, warmup: bool = False, quick_start: bool = False,
                 num_scheduler_steps: int = 1, progress: bool = True):
        """kv_cache_tokens sizes the KV pool directly; otherwise it holds as many tokens as fit in kv_cache_gib
        (per device: with tp > 1 a device holds its share of each token's KV heads). max_model_len defaults to the
        model's context, capped by what the pool holds.

        Scheduling: `policy` orders prefills (fcfs, sjf, ljf, edf, lrs, lars); each step holds at most
        max_num_batched_tokens tokens and max_prefills_per_step prompts' chunks and, by the cost model, takes at
        most `iteration_budget` seconds (default: the measured time of a full step of max_num_seqs rows, all but
        one decodes at the longest context); `multi_prefill` lets several prompts' chunks share a step and
        `space_sharing` makes a long prefill yield budget to urgent short ones. A prompt's first token is due
        `ttft_slo` seconds after arrival (or 3x its prefill time alone, if longer). `num_scheduler_steps` > 1:
        when no prompt waits, up to that many decode steps run in one device loop (multi-step decode), as many
        as fit the iteration budget; one engine only (not a cluster), and after a quick start only once the
        background compile is done. The cost model is measured on
        this device at first start and cached (`cost_profile` names the file to load or write instead).

        Start-up: with `warmup` (what `serve` does) every step program is compiled here, before the first request,
        and the cost model is measured if it is not cached. Without it (the default, for generate and notebooks)
        each program compiles the first time a step needs it, and a cost model not yet cached is not measured:
        steps are then bounded by max_num_batched_tokens alone (as in vLLM), with no time budget (unless
        iteration_budget sets one). With `quick_start` as well (what `serve` does by default), only the programs
        the first few requests run compile here (runner.first_programs); the rest compile in the background,
        small ones first, and a step that needs one first waits for it. A cost model not yet cached is then
        deferred work (Engine.run_deferred): the server measures it when its engine is idle and every program
        has compiled, yielding to any request that arrives. Steps are bounded by tokens until then. Quick start
        applies to one engine in one process; a cluster or several processes warm up in full.

        Layout: an instance is `tp` devices of `jax.devices()`, tensor-parallel (each holds a share of every
        layer's heads and MLP). By default the engine is one instance. With prefill_instances > 0 it is a live
        cluster (cluster/): the first prefill_instances instances form a CDSP prefill pool (node_size to a node;
        chunks of at least min_chunk tokens), then decode_instances decode instances of decode_kvp instances each
        (KV-parallel when more than one), each with receive_buffers receive buffers. The pool's Eq. (1) is
        measured at first start and cached (`prefill_profile` names the file instead)."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        for name, value in (("block_size", block_size), ("kv_cache_tokens", kv_cache_tokens or 1),
                            ("max_model_len", max_model_len or 2), ("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_prefills_per_step", max_prefills_per_step),
                            ("num_scheduler_steps", num_scheduler_steps)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if num_scheduler_steps > 1 and prefill_instances:
            raise ValueError("num_scheduler_steps > 1 (multi-step decode) serves one engine; a cluster's decode "
                             "instances step one token at a time, so that its loop admits prompts between steps")
        _enable_compilation_cache()
        self.model_name, self._dtype_name = model, dtype
        self.config, params, self.tokenizer = load_weights(model, dtype)
        if jax.process_index() != lockstep.LEADER:
            raise RuntimeError("LLM runs on the leader (process 0); other processes call jaxserve.api.follow")
        # the device layer: in one process made here; with several, made here and in every follower (lockstep)
        if jax.process_count() > 1:  # on the host: each process puts its copy on whichever of its devices need it
            params = jax.tree.map(np.asarray, params)
        self.lockstep = lockstep.Leader(params) if jax.process_count() > 1 else None
        self._new = self.lockstep.new if self.lockstep else lambda cls, *args, **kwargs: cls(*args, **kwargs)
        cfg = self.config
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tp must be a positive integer, got {tp!r}")
        kv_heads = cfg.split(tp).kv_heads  # per device; a ValueError when tp does not divide the model
        if tp > len(jax.devices()):
            raise ValueError(f"tp={tp} needs {tp} devices; there are {len(jax.devices())}")
        kv_dtype = cache_dtype(DTYPES[dtype], jax.devices()[0].platform)
        token_bytes = 2 * cfg.num_layers * kv_heads * cfg.head_dim * kv_dtype.itemsize
        kv_tokens = kv_cache_tokens or int(kv_cache_gib * 2**30 // token_bytes)
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings, kv_tokens)
        self._params, self._dtype = params, DTYPES[dtype]
        self._kv_tokens, self._tp = kv_tokens, tp
        self._block_size, self._key_block, self._cost_profile = block_size, key_block, cost_profile
        # on a CPU the jnp attention runs every tile of a mixed program: row buckets from 4 keep a lone chunk's few;
        # on a GPU one decode row is run as two: XLA computes a one-row matmul under 10M weights (k_proj, v_proj) as
        # multiply + reduce, fused into the KV write, 30x slower than the GEMM (0.12 ms a layer on an H200)
        on_cpu = jax.devices()[0].platform == "cpu"
        self._buckets = Buckets.make(max_num_batched_tokens, max_num_seqs, self.max_model_len, block_size, key_block,
                                     min_rows=4 if on_cpu else None, max_prefills=max_prefills_per_step,
                                     num_scheduler_steps=num_scheduler_steps, min_decode_rows=1 if on_cpu else 2)
        self._warmup = warmup
        self._quick_start = quick_start and warmup and not prefill_instances and jax.process_count() == 1
        self._sched_args = dict(policy=policy, ttft_slo=ttft_slo, prefix_caching=prefix_caching,
                                max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                multi_prefill=multi_prefill, space_sharing=space_sharing,
                                iteration_budget=iteration_budget)
        self.cost = None
        if prefill_instances:
            self.engine = self._make_cluster(Layout(prefill_instances, decode_instances, node_size, receive_buffers,
                                                    decode_kvp, tp), min_chunk, prefill_profile, progress)
        else:
            self.engine = self.make_engine(progress=progress)
            runner = self.engine.runner
            if self.lockstep is None and tp == 1 and not runner.scan_mixed:
                self._params = runner.params  # one copy of the weights (the runner's, per layer), not two
        if self.lockstep is not None:  # ready when every process is (followers compile their devices' programs)
            self.lockstep.sync()
        self._queues: dict[str, collections.deque[RequestOutput]] = {}

    def make_engine(self, devices: Sequence[jax.Device] | None = None, progress: bool = True,
                    kv_cache_tokens: int | None = None) -> Engine:
        """An engine with this LLM's settings on `devices` (default: JAX's first tp devices; runs of tp are
        tensor-parallel instances, and several instances form a KV-parallel group whose KV pool is the sum of
        theirs), its step programs compiled; the step cost model is measured once (on the first engine) and
        shared. kv_cache_tokens: each instance's pool (default: this LLM's)."""
        a = self._sched_args
        devices = list(devices or jax.devices()[:self._tp])
        kvp = len(devices) // self._tp
        per_instance = -(-(kv_cache_tokens or self._kv_tokens) // self._block_size) + 1  # + its scratch block
        num_blocks = per_instance * kvp
        runner = self._new(ModelRunner, self.config, self._params, self._dtype, num_blocks=num_blocks,
                           block_size=self._block_size, buckets=self._buckets, key_block=self._key_block,
                           devices=devices, tp=self._tp)
        quick = self._quick_start and self.cost is None  # no cost model known yet: measure it later
        if self._warmup:
            runner.warmup(runner.first_programs() if quick else None, progress=progress)
        path = None
        if self.cost is None:
            path = (pathlib.Path(self._cost_profile) if self._cost_profile else
                    profile.default_path(self.model_name, self._dtype_name, runner))
            if path.exists():
                self.cost = profile.load(path, runner)
            elif self._warmup and not quick:
                self.cost = profile.load_or_measure(path, runner, self.max_model_len, progress)
        kv = KVCacheManager(num_blocks, self._block_size, enable_prefix_caching=a["prefix_caching"],
                            scratch_blocks=kvp)
        cost = self.cost or profile.unmeasured(runner)
        scheduler = ReplicaScheduler(make_policy(a["policy"]), cost, self._packer(cost, measured=self.cost is not None),
                                     kv, slo=SLO(ttft_min=a["ttft_slo"]), max_running=a["max_num_seqs"],
                                     num_scheduler_steps=self._buckets.burst_steps)
        engine = Engine(runner, scheduler, self.tokenizer, max_model_len=self.max_model_len)
        if quick:
            compiled = runner.compile_in_background(runner.later_programs())
            if self._buckets.burst_steps > 1:  # no burst before its programs compile (the step would wait)
                scheduler.num_scheduler_steps = 1
                compiled.add_done_callback(lambda _: setattr(scheduler, "num_scheduler_steps",
                                                             self._buckets.burst_steps))
            if self.cost is None:
                engine.defer(functools.partial(self._measure_when_idle, engine, path, compiled))
        return engine

    def _packer(self, cost: EngineStepCost, measured: bool) -> PackerConfig:
        a = self._sched_args
        budget = a["iteration_budget"]
        if not measured and budget is None:
            budget = math.inf  # no time model: the token budget alone bounds a step
        return engine_packer(cost, max_batch_tokens=a["max_num_batched_tokens"], max_num_seqs=a["max_num_seqs"],
                             max_model_len=self.max_model_len, chunk_align=self._buckets.tokens[0],
                             max_prefills=self._buckets.max_prefills, multi_prefill=a["multi_prefill"],
                             space_sharing=a["space_sharing"], t_target=budget)

    def _measure_when_idle(self, engine: Engine, path: pathlib.Path, compiled: concurrent.futures.Future,
                           stop: Callable[[], bool]) -> bool:
        """Engine.defer's work after a quick start: once every program is compiled (timings taken beside a
        compile would be wrong), measure the cost profile and plan with it. Whether it is done."""
        if not compiled.done() or stop():
            return False
        engine.scheduler.kv.reset_prefix_cache()  # the measurement writes its own KV over free blocks, cached too
        try:
            cost = profile.load_or_measure(path, engine.runner, self.max_model_len, progress=False, stop=stop)
        except profile.Interrupted:
            return False
        self.cost = cost
        engine.scheduler.use_cost(cost, self._packer(cost, measured=True))
        logging.info("cost profile measured (%s); steps are planned by time from now on", path)
        return True

    def _make_cluster(self, layout: Layout, min_chunk: int, prefill_profile: str | None,
                      progress: bool) -> ClusterEngine:
        path = (pathlib.Path(prefill_profile) if prefill_profile else
                pool_profile.default_path(self.model_name, self._dtype_name, layout.prefill_instances,
                                          layout.node_size, layout.tp, self.max_model_len, self._key_block))
        cluster = build(self.config, self._params, layout, lambda ds: self.make_engine(ds, progress), path,
                        capacity=self.max_model_len, dtype=self._dtype, min_chunk=min_chunk,
                        key_block=self._key_block, progress=progress, new=self._new)
        warmup(cluster, self.max_model_len, progress)
        return cluster

    def lost(self, timeout: float) -> str | None:
        """Why a follower process counts as gone (no heartbeat for `timeout` seconds), or None."""
        return self.lockstep.lost(timeout) if self.lockstep is not None else None

    def close(self) -> None:
        """Release the followers (with several processes; they return from `follow`)."""
        if self.lockstep is not None:
            self.lockstep.stop()
            self.lockstep = None

    # ---- prompts ------------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def chat_prompt(self, messages: Messages) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template (which carries its own BOS); text in a
        message that spells a control token stays plain text."""
        return self.tokenizer.encode_chat(messages)

    def render_chat(self, messages: Messages) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    # ---- driving the engine -------------------------------------------------------------------------
    def _submit(self, requests: Sequence[tuple[list[int], SamplingParams]]) -> list[str]:
        """Queue all requests, or none: every one is checked before the first is added."""
        checked = [(self.engine.check_request(ids, sp), sp) for ids, sp in requests]
        rids = [self.engine.enqueue(ids, sp) for ids, sp in checked]
        self._queues.update({rid: collections.deque() for rid in rids})
        return rids

    def _next_output(self, rid: str) -> RequestOutput:
        """This request's next output, stepping the engine (for every request) until there is one."""
        queue = self._queues[rid]
        while not queue:
            if not self.engine.has_unfinished():
                raise RuntimeError(f"request {rid} is no longer in the engine")
            for out in self.engine.step():
                if out.request_id in self._queues:
                    self._queues[out.request_id].append(out)
        out = queue.popleft()
        if out.error is not None:
            raise RuntimeError(f"request {rid} failed: {out.error}")
        return out

    def _forget(self, rids: Sequence[str]) -> None:
        """Drop the queues of rids and abort whichever of them is still in the engine."""
        for rid in rids:
            self._queues.pop(rid, None)
            self.engine.abort(rid)

    def _stream(self, ids: list[int], params: SamplingParams) -> Iterator[RequestOutput]:
        (rid,) = self._submit([(ids, params)])
        try:
            while True:
                out = self._next_output(rid)
                yield out
                if out.finished:
                    return
        finally:  # also when the consumer stops early
            self._forget([rid])

    # ---- generation ---------------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: bool = False) -> list[Completion]:
        """Generate for every prompt (continuously batched); results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        prepared = [self._prompt_ids(p) for p in prompts]
        rids = self._submit([(ids, sp) for (_, ids), sp in zip(prepared, plist)])
        outputs: list[list[RequestOutput]] = [[] for _ in rids]
        try:
            for rid, outs in zip(tqdm(rids, disable=not progress, desc="generate"), outputs):
                while not outs or not outs[-1].finished:
                    outs.append(self._next_output(rid))
        finally:
            self._forget(rids)  # aborts whatever an exception left unfinished
        return [Completion(text_prompt, ids, "".join(o.new_text for o in outs),
                           [t for o in outs for t in o.new_token_ids], outs[-1].finish_reason.value)
                for (text_prompt, ids), outs in zip(prepared, outputs)]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield this request's new tokens and text as they are produced; aborts the request if abandoned.

        Bad input raises here; the request is queued when iteration starts."""
        _, ids = self._prompt_ids(prompt)
        params = params or SamplingParams()
        return self._stream(self.engine.check_request(ids, params), params)

    def chat(self, conversations: Messages | Sequence[Messages],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Reply to one conversation (a list of {'role', 'content'} messages) or to several."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        texts = [self.render_chat(c) for c in conversations]
        completions = self.generate([self.chat_prompt(c) for c in conversations], params)
        for c, text in zip(completions, texts):
            c.prompt = text
        return completions

    def prompt_logits(self, prompt: str | Sequence[int]) -> np.ndarray:
        """Logits [tokens, vocab] of every prompt position: a scoring pass outside the serving path."""
        _, ids = self._prompt_ids(prompt)
        ids = self.engine.check_request(ids, SamplingParams())
        return scoring.prompt_logits(self.config, self._params, self._dtype, ids)


def follow(model: str = registry.DEFAULT_MODEL, *, dtype: str = "float32") -> None:
    """A follower's life (jax.distributed, every process but the leader): load the same weights as the leader's
    LLM, then make the device-layer calls the leader publishes until it stops (cluster/lockstep.py)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    _enable_compilation_cache()
    _, params, _ = load_weights(model, dtype)
    lockstep.follow(jax.tree.map(np.asarray, params))
