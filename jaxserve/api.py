"""Python API: `LLM(model=...)` with generate / stream / chat."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import pathlib
import resource
import threading
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from absl import logging
from tqdm.auto import tqdm

from jaxserve import config
from jaxserve.config import EngineConfig, InstanceShape, ModelConfig
from jaxserve.engine import kv_budget, profile, scoring
from jaxserve.cluster import pool_profile
from jaxserve.cluster import length_predictor, lockstep
from jaxserve.cluster.build import Compiling, build, pool_context, warmup, warmup_steps
from jaxserve.cluster.engine import ClusterEngine
from jaxserve.cluster.multi_master import MultiMaster
from jaxserve.engine.batch import Buckets
from jaxserve.engine.engine import Engine, RequestOutput, TokenLogprob, token_logprobs
from jaxserve.engine.interface import ServingEngine
from jaxserve.engine.kv_cache import cache_dtype
from jaxserve.engine.runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from jaxserve.models import quantize, registry
from jaxserve.models.loader import DTYPES, load_weights, resolve_dtype
from jaxserve.models.tokenizer import TextTokenizer
from jaxserve.sched.kv_manager import KVCacheManager
from jaxserve.sched.batch_cost import EngineStepCost
from jaxserve.sched.build import packer_config, replica_scheduler
from jaxserve.sched.packer import PackerConfig
from jaxserve.sched.spread_kv import SpreadKV

Messages = Sequence[dict[str, str]]


@dataclasses.dataclass
class Completion:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None  # one per token, when SamplingParams.logprobs asked for them


def _enable_compilation_cache() -> None:
    """Keep compiled step functions on disk so a restart skips XLA compilation (unless the user set a cache)."""
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(registry.cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


CPU_KV_GIB = 2.0  # a CPU's KV pool when no size is given: a share of a machine's memory that tests and laptops afford


class LLM:
    """A model with its engine: the scheduler in sched/ drives one compiled step per iteration.

    Several generate/stream callers may interleave (e.g. two open streams): every engine step's outputs are
    routed to per-request queues, so no caller loses another's tokens. Not thread-safe: one thread drives it.
    """

    def __init__(self, model: str | EngineConfig = registry.DEFAULT_MODEL, *, progress: bool = True, **settings: Any):
        """model: a registered name, a .gguf file or a Hugging Face folder, or a whole EngineConfig. settings: any
        of EngineConfig's settings by name (e.g. max_num_seqs=32), over it; jaxserve/config.py says what each does.

        Start-up: with `warmup` (serve) every step program compiles here, and a cost model not cached is measured.
        Without it (generate, notebooks) a program compiles when a step first needs it, and steps are bounded by
        max_num_batched_tokens alone until a cost model is known. `quick_start` compiles only the first
        requests' programs here, the rest in the background. With prefill_instances > 0 the engine is a live
        cluster (cluster/): a CDSP prefill pool, then decode instances."""
        base = model if isinstance(model, EngineConfig) else EngineConfig(model=ModelConfig(model=model))
        self.engine_config = cfg = config.replace(base, **settings)
        _enable_compilation_cache()
        self.model_name, self._dtype_name = cfg.model.model, resolve_dtype(cfg.model.dtype)
        self._dtype = DTYPES[self._dtype_name]
        self.config, params, self.tokenizer = load_weights(cfg.model.model, self._dtype_name, cfg.model.quantization)
        if cfg.model.tokenizer:
            self.tokenizer = TextTokenizer.from_hf_dir(cfg.model.tokenizer)
            if self.tokenizer.vocab_size > self.config.vocab_size:
                raise ValueError(
                    f"tokenizer {cfg.model.tokenizer} has {self.tokenizer.vocab_size} tokens; the model "
                    f"reads {self.config.vocab_size}"
                )
        if jax.process_index() != lockstep.LEADER:
            raise RuntimeError("LLM runs on the leader (process 0); other processes call jaxserve.api.follow")
        if jax.process_count() > 1:  # on the host: each process puts its copy on whichever of its devices need it
            params = jax.tree.map(np.asarray, params)
        # the device layer: in one process made here; with several, made here and in every follower (lockstep)
        self.lockstep = lockstep.Leader(params) if jax.process_count() > 1 else None
        self._new = self.lockstep.new if self.lockstep else lambda cls, *args, **kwargs: cls(*args, **kwargs)
        self._params, self._kv_bytes = params, {}  # _kv_bytes: a device's KV pool by (tp, stages), once measured
        # the fail-over engine's programs compiling (prepare_fail_over): its runner, their future, a stop
        self._fail_over_programs: tuple[ModelRunner, concurrent.futures.Future, threading.Event] | None = None
        self._kv_tokens = self._kv_pool_tokens(cfg.parallel.instance)
        # a cluster's decode instances' (their tensor-parallel size may differ from the pool's)
        self._decode_kv_tokens = (
            self._kv_pool_tokens(InstanceShape(), cfg.parallel.decoder_tp)
            if cfg.parallel.prefill_instances
            else self._kv_tokens
        )
        self.max_model_len = self._context(cfg.model.max_model_len)
        self._buckets = self._make_buckets()
        self._quick_start = cfg.startup.quick_start and cfg.startup.warmup and jax.process_count() == 1
        self.cost = None
        self.engine: ServingEngine
        if cfg.parallel.prefill_instances:
            self.engine = self._make_cluster(progress)
        else:
            self.engine = replica = self.make_engine(progress=progress)
            if (
                self.lockstep is None
                and cfg.parallel.tp == 1
                and replica.runner.stages == 1
                and not replica.runner.scan_mixed
            ):
                self._params = replica.runner.params  # one copy of the weights (the runner's, per layer)
        if self.lockstep is not None:  # ready when every process is (followers compile their devices' programs)
            self.lockstep.sync()
        self._queues: dict[str, collections.deque[RequestOutput]] = {}

    def _context_sets(self) -> int:
        """The KV-parallel sets one request's KV may spread over: the engine's --kvp, or a cluster's decode
        instance's --decode_kvp (ESP: one instance's)."""
        layout = self.engine_config.parallel
        if not layout.prefill_instances:
            return layout.instance.kvp
        if layout.cluster_policy == "esp":  # a request's KV spreads over the pool's instances (multi-master)
            return layout.prefill_instances if self.lockstep is None else 1
        return layout.decode_kvp

    def _context(self, asked: int | None) -> int:
        """The longest context served: `asked` (default: the model's positions), capped by the model's positions
        and by what the KV-parallel sets a request may spread over hold together (a cap below what was asked is
        logged with its numbers)."""
        sets, positions = self._context_sets(), self.config.max_position_embeddings
        layout = self.engine_config.parallel
        per_set = self._decode_kv_tokens if layout.prefill_instances else self._kv_tokens
        pool = per_set * sets
        held = f"{sets} KV-parallel sets of {per_set:,} tokens" if sets > 1 else f"{pool:,} tokens"
        if (
            layout.prefill_instances
            and (stores := pool_context(layout, self._kv_tokens, self.engine_config.cache.key_block)) is not None
        ):
            pool = min(pool, stores)
            held += f", the prefill pool {stores:,} ({layout.prefill_instances} instances' history stores)"
        if asked is not None and asked > min(pool, positions):
            logging.warning(
                "max_model_len %d cut to %d: the model has %d positions, the KV pool holds %s",
                asked,
                min(pool, positions),
                positions,
                held,
            )
        return min(asked or positions, pool, positions)

    def _kv_pool_tokens(self, shape: InstanceShape, tp: int | None = None) -> int:
        """Tokens an instance's KV pool holds: kv_cache_tokens, or what kv_cache_gib holds, or what
        gpu_memory_utilization leaves a device (engine/kv_budget.py; the default on an accelerator), or 2 GiB's worth
        on a CPU (per device: with tp > 1 a device holds its share of each token's KV heads, with pipeline stages
        its stage's layers'). tp: the instance's (default --tp)."""
        cache, tp = self.engine_config.cache, tp or self.engine_config.parallel.tp
        stages, kvp = shape.stages, shape.kvp
        kv_heads = self.config.split(tp).kv_heads  # per device; a ValueError when tp does not divide the model
        if tp * stages * kvp > len(jax.devices()):
            sizes = (("tp", tp), ("stages", stages), ("kvp", kvp))
            named = " x ".join(f"{k}={v}" for k, v in sizes if k == "tp" or v > 1)
            raise ValueError(f"{named} needs {tp * stages * kvp} devices; there are {len(jax.devices())}")
        kv_dtype = cache_dtype(self._dtype, jax.devices()[0].platform, cache.kv_cache_dtype)
        layers = -(-self.config.num_layers // stages)  # the largest stage's
        token_bytes = 2 * layers * kv_heads * self.config.head_dim * kv_dtype.itemsize
        if cache.kv_cache_tokens or cache.kv_cache_gib:
            return cache.kv_cache_tokens or int(cache.kv_cache_gib * 2**30 // token_bytes)
        device = jax.devices()[0]
        utilization = cache.gpu_memory_utilization or (0.9 if device.platform != "cpu" else None)
        if utilization is None:
            return int(CPU_KV_GIB * 2**30 // token_bytes)
        if (tp, stages) not in self._kv_bytes:  # measured once, before any runner: later ones (a fail-over) as much
            sched = self.engine_config.scheduler
            all_weights = quantize.nbytes(self._params)
            b = kv_budget.budget(
                device,
                utilization,
                all_weights // (tp * stages),
                kv_budget.activation_bytes(
                    self.config,
                    sched.max_num_batched_tokens,
                    sched.max_num_seqs,
                    cache.key_block,
                    self._dtype.itemsize,
                    tp,
                    quantized=self.engine_config.model.quantization is not None,
                ),
            )
            if b.kv // token_bytes < 2 * cache.block_size:
                raise ValueError(
                    f"gpu_memory_utilization {utilization} leaves no room for the KV cache: "
                    f"{b.describe(max(b.kv // token_bytes, 0), utilization)}"
                )
            logging.info(b.describe(b.kv // token_bytes, utilization))
            self._kv_bytes[tp, stages] = b.kv
        return int(self._kv_bytes[tp, stages] // token_bytes)

    def _make_buckets(self) -> Buckets:
        """The step shapes to compile. On a CPU the jnp attention runs every tile of a mixed program: row buckets
        from 4 keep a lone chunk's few. On a GPU one decode row runs as two: XLA computes a one-row matmul under
        10M weights (k_proj, v_proj) as multiply + reduce, fused into the KV write, far slower than the GEMM
        (docs/BENCHMARKS.md, "Serving on one H200, profiled")."""
        cache, sched = self.engine_config.cache, self.engine_config.scheduler
        on_cpu = jax.devices()[0].platform == "cpu"
        return Buckets.make(
            sched.max_num_batched_tokens,
            sched.max_num_seqs,
            self.max_model_len,
            cache.block_size,
            cache.key_block,
            min_rows=4 if on_cpu else None,
            max_prefills=sched.max_prefills_per_step,
            num_scheduler_steps=sched.num_scheduler_steps,
            min_decode_rows=1 if on_cpu else 2,
        )

    def make_engine(
        self,
        devices: Sequence[jax.Device] | None = None,
        progress: bool = True,
        kv_cache_tokens: int | None = None,
        shape: InstanceShape | None = None,
        compiled: dict | None = None,
        tp: int | None = None,
        max_model_len: int | None = None,
    ) -> Engine:
        """An engine with this LLM's settings on `devices` (default: JAX's first tp x kvp x stages devices; runs
        of tp are tensor-parallel instances, several instances form a KV-parallel group whose KV pool is the sum of
        theirs, and with pipeline stages each stage is an equal share of them), its step programs compiled; the
        step cost model is measured once (on the first engine) and shared. kv_cache_tokens: each instance's pool
        (default: this LLM's). shape: its stages and KV-parallel sets (default: this LLM's). compiled: its
        programs, compiled already (ModelRunner.compiled_programs of a runner like it). tp: devices per instance
        (default --tp; a cluster's decode instances: --decode_tp, whose pool is its own). max_model_len: its
        requests' longest context (default: this LLM's; an ESP instance's: what its own pool holds)."""
        cfg = self.engine_config
        cache, shape = cfg.cache, shape or cfg.parallel.instance
        tp, context = tp or cfg.parallel.tp, max_model_len or self.max_model_len
        if kv_cache_tokens is None and tp != cfg.parallel.tp:
            kv_cache_tokens = self._decode_kv_tokens
        devices = list(devices or jax.devices()[: tp * shape.kvp * shape.stages])
        kvp = len(devices) // (tp * shape.stages)
        num_blocks = self._num_blocks(devices, kv_cache_tokens, shape, tp)
        # before the runner: a bad kvp_tokens is refused before anything is placed or compiled
        kv = KVCacheManager(
            num_blocks,
            cache.block_size,
            enable_prefix_caching=cache.enable_prefix_caching,
            scratch_blocks=kvp,
            kvp_tokens=shape.kvp_tokens if kvp > 1 else None,
            sliding_window=self.config.uniform_window,
        )
        runner = self._new(
            ModelRunner,
            self.config,
            self._params,
            self._dtype,
            compiled=compiled,
            **self._runner_settings(devices, num_blocks, shape, tp),
        )
        # one engine starts quickly while its cost model is unknown (measured later); a cluster always: its
        # instances are many and its pool compiles while idle too. A cluster's instances get prompts as KV
        cluster = bool(cfg.parallel.prefill_instances)
        quick = self._quick_start and (self.cost is None or cluster)
        first = runner.first_programs(mixed=not cluster)
        if cfg.startup.warmup:
            runner.warmup(first if quick else None, progress=progress)
        path = None
        if self.cost is None:
            path = (
                pathlib.Path(cfg.startup.cost_profile)
                if cfg.startup.cost_profile
                else profile.default_path(self.model_name, self._dtype_name, runner)
            )
            self.cost = profile.read_kept(path, lambda: profile.load(path, runner))
            if self.cost is None and cfg.startup.warmup and not quick:
                self.cost = profile.load_or_measure(path, runner, context, progress)
        engine = self._engine(runner, kv, context)
        if quick:
            compiled = runner.compile_in_background(runner.later_programs(first))
            scheduler = engine.scheduler
            if self._buckets.burst_steps > 1:  # no burst before its programs compile (the step would wait)
                scheduler.num_scheduler_steps = 1
                compiled.add_done_callback(
                    lambda _: setattr(scheduler, "num_scheduler_steps", self._buckets.burst_steps)
                )
            if self.cost is None:
                engine.defer(functools.partial(self._measure_when_idle, engine, path, compiled))
        return engine

    def make_spread_engine(self, instances: Sequence[Engine]) -> Engine:
        """The engine of ESP's multi-master group over `instances` (one device set each): it decodes the requests
        whose KV spreads over several of them, in blocks of their own pools (cluster/multi_master.py,
        sched/spread_kv.py); its context is this LLM's, at most what their pools hold together."""
        runner = MultiMaster([e.runner for e in instances], self._params, self._buckets)
        kv = SpreadKV([e.kv for e in instances])
        engine = self._engine(runner, kv, min(self.max_model_len, kv.capacity * kv.block_size))
        if self.cost is None:  # a quick start: its instances measure the step profile while idle
            engine.defer(functools.partial(self._adopt_cost, engine))
        return engine

    def _engine(self, runner: ModelRunner, kv: KVCacheManager | SpreadKV, max_model_len: int) -> Engine:
        """The engine over a runner and its block manager, scheduled by this LLM's settings and cost model."""
        cfg = self.engine_config
        cost = self.cost or profile.unmeasured(runner)
        scheduler = replica_scheduler(
            cfg.scheduler,
            cost,
            kv,
            self._packer(cost, measured=self.cost is not None),
            num_scheduler_steps=self._buckets.burst_steps,
            admission=cfg.parallel.decode_admission,
        )
        return Engine(runner, scheduler, self.tokenizer, max_model_len=max_model_len)

    def _num_blocks(
        self, devices: Sequence[jax.Device], kv_cache_tokens: int | None, shape: InstanceShape, tp: int
    ) -> int:
        """KV blocks of an engine on `devices` of instances of `tp`: each KV-parallel set's pool (default: this
        LLM's) and its scratch block."""
        cache = self.engine_config.cache
        kvp = len(devices) // (tp * shape.stages)
        return (-(-(kv_cache_tokens or self._kv_tokens) // cache.block_size) + 1) * kvp

    def _runner_settings(self, devices: Sequence[jax.Device], num_blocks: int, shape: InstanceShape, tp: int) -> dict:
        """ModelRunner's settings (after the model, its weights and dtype) for an engine of this LLM's."""
        cache = self.engine_config.cache
        return dict(
            num_blocks=num_blocks,
            block_size=cache.block_size,
            buckets=self._buckets,
            key_block=cache.key_block,
            devices=list(devices),
            tp=tp,
            stages=shape.stages,
            kv_cache_dtype=cache.kv_cache_dtype,
        )

    def _packer(self, cost: EngineStepCost, measured: bool) -> PackerConfig:
        return packer_config(
            self.engine_config.scheduler,
            cost,
            max_model_len=self.max_model_len,
            chunk_align=self._buckets.tokens[0],
            max_prefills=self._buckets.max_prefills,
            measured=measured,
        )

    def _measure_when_idle(
        self, engine: Engine, path: pathlib.Path, compiled: concurrent.futures.Future, stop: Callable[[], bool]
    ) -> bool:
        """Engine.defer's work after a quick start: once every program is compiled (timings taken beside a
        compile would be wrong), measure the cost profile and plan with it. Whether it is done."""
        if self.cost is not None:  # another engine of the cluster's measured it
            return self._adopt_cost(engine, stop)
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

    def _adopt_cost(self, engine: Engine, stop: Callable[[], bool]) -> bool:
        """Engine.defer's work for an engine that measures nothing itself (ESP's multi-master group, a cluster's
        later decode instances): plan by the cost profile once another engine has it. Whether it has."""
        if self.cost is None:
            return False
        engine.scheduler.use_cost(self.cost, self._packer(self.cost, measured=True))
        return True

    def _make_cluster(self, progress: bool) -> ClusterEngine:
        layout, key_block = self.engine_config.parallel, self.engine_config.cache.key_block
        prefill_profile = self.engine_config.startup.prefill_profile
        path = (
            pathlib.Path(prefill_profile)
            if prefill_profile
            else pool_profile.default_path(
                self.model_name,
                self._dtype_name,
                f"{layout.cluster_policy}-{layout.pool_attention}",
                layout.prefill_instances,
                layout.node_size,
                layout.tp,
                self.max_model_len,
                key_block,
            )
        )
        # an ESP instance serves alone the requests that fit its own pool; its group, those that spread
        instance_context = min(self.max_model_len, self._kv_tokens) if layout.cluster_policy == "esp" else None
        make_group = self.make_spread_engine if self.lockstep is None else None
        cluster = build(
            self.config,
            self._params,
            layout,
            lambda ds, tp: self.make_engine(ds, progress, tp=tp, max_model_len=instance_context),
            path,
            capacity=self.max_model_len,
            store_tokens=self._kv_tokens,
            dtype=self._dtype,
            key_block=key_block,
            progress=progress,
            new=self._new,
            make_group=make_group,
            kv_cache_dtype=self.engine_config.cache.kv_cache_dtype,
            predictor_file=length_predictor.default_path(self.model_name, self._dtype_name),
            defer=self.engine_config.startup.quick_start and self.lockstep is None,
        )
        # as one engine: serve compiles everything first (a quick start: while idle), generate as steps need it;
        # between processes always first (a transfer's communicator is set up there, which both processes must
        # reach within a deadline)
        if self._quick_start:
            cluster.defer(Compiling(warmup_steps(cluster, self.max_model_len)), first=True)
        elif self.engine_config.startup.warmup or self.lockstep is not None:
            warmup(cluster, self.max_model_len, progress)
        logging.info(
            "the cluster is built; this process's peak memory so far: %.1f GiB",
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        )  # KiB on Linux
        return cluster

    def _fail_over_layout(self) -> tuple[list[jax.Device], int, InstanceShape]:
        """Where a fail-over's engine runs: this process's first devices, as many KV-parallel sets as the context
        needs and this process has (too few, and each holds more); its tokens per set; its shape."""
        tp = self.engine_config.parallel.tp
        per_set = self._kv_pool_tokens(InstanceShape())
        sets = max(min(-(-self.max_model_len // per_set), len(jax.local_devices()) // tp), 1)
        return jax.local_devices()[: tp * sets], max(per_set, -(-self.max_model_len // sets)), InstanceShape(kvp=sets)

    def prepare_fail_over(self) -> None:
        """Compile the fail-over engine's step programs in the background, one at a time while this one serves,
        from shapes alone (nothing is placed on the devices), so that a fail-over waits for no compile."""
        devices, tokens, shape = self._fail_over_layout()
        tp = self.engine_config.parallel.tp
        runner = ModelRunner(
            self.config,
            self._params,
            self._dtype,
            placed=False,
            **self._runner_settings(devices, self._num_blocks(devices, tokens, shape, tp), shape, tp),
        )
        programs, stop = runner.programs(), threading.Event()
        logging.info("compiling the fail-over engine's %d step programs in the background", len(programs))
        self._fail_over_programs = runner, runner.compile_in_background(programs, stop), stop

    def fail_over(self) -> ServingEngine:
        """After a follower process is lost: the engine becomes one replica on this process's first devices
        (the cluster's layout spanned the lost process), its programs compiled: those prepare_fail_over compiled
        (if it ran), the rest now, in parallel; the lockstep ends (nothing is published any more). What the old
        engine held is dropped. Returns the new engine."""
        self.lockstep = None  # the follower is gone: publish nothing (a stop would wait for no one)
        self._new = lambda cls, *args, **kwargs: cls(*args, **kwargs)
        devices, tokens, shape = self._fail_over_layout()
        compiled = None
        if self._fail_over_programs is not None:
            prepared, done, stop = self._fail_over_programs
            stop.set()  # the one compiling now ends; make_engine compiles what is left, in parallel
            concurrent.futures.wait([done])  # a failure was logged; what did compile is still used
            compiled = prepared.compiled_programs()
        logging.warning("building one engine on this process's %d first device(s) after a lost process", len(devices))
        self.engine = self.make_engine(devices, progress=False, kv_cache_tokens=tokens, shape=shape, compiled=compiled)
        return self.engine

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

    def chat_prompt(
        self,
        messages: Messages,
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template (which carries its own BOS), with
        the tools it offers (OpenAI's shape) if any; text in a message that spells a control token stays plain
        text. add_generation_prompt: open the assistant's turn; continue_final_message: end inside the last
        message instead (a prefilled reply the model continues; needs add_generation_prompt false)."""
        return self.tokenizer.encode_chat(messages, add_generation_prompt, tools, continue_final_message)

    def render_chat(self, messages: Messages) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    # ---- driving the engine -------------------------------------------------------------------------
    def _submit(self, requests: Sequence[tuple[list[int], SamplingParams]]) -> list[list[str]]:
        """Queue all requests, or none: every one is checked before the first is added. Each request's ids: one
        per sample (SamplingParams.siblings), the later ones held back until the first has prefilled."""
        checked = [(self.engine.check_request(ids, sp), sp) for ids, sp in requests]
        rids = []
        for ids, sp in checked:
            first, *rest = sp.siblings()
            rids.append([self.engine.enqueue(ids, first)])
            rids[-1] += [self.engine.enqueue(ids, p, after=rids[-1][0]) for p in rest]
        self._queues.update({rid: collections.deque() for group in rids for rid in group})
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
        if params.n > 1 or params.best_of is not None:
            raise ValueError("stream() yields one sample: n and best_of are for generate()")
        ((rid,),) = self._submit([(ids, params)])
        try:
            while True:
                out = self._next_output(rid)
                yield out
                if out.finished:
                    return
        finally:  # also when the consumer stops early
            self._forget([rid])

    # ---- generation ---------------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[Completion]:
        """Generate for every prompt (continuously batched); results in prompt order, SamplingParams.n of them
        per prompt (with best_of: the n of the highest total logprob, best first)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        prepared = [self._prompt_ids(p) for p in prompts]
        groups = self._submit([(ids, sp) for (_, ids), sp in zip(prepared, plist)])
        rids = [rid for group in groups for rid in group]
        outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in rids}
        try:
            for rid in tqdm(rids, disable=not progress, desc="generate"):
                outs = outputs[rid]
                while not outs or not outs[-1].finished:
                    outs.append(self._next_output(rid))
        finally:
            self._forget(rids)  # aborts whatever an exception left unfinished
        completions = []
        for (text_prompt, ids), group, sp in zip(prepared, groups, plist):
            samples = [
                Completion(
                    text_prompt,
                    ids,
                    "".join(o.new_text for o in outs),
                    [t for o in outs for t in o.new_token_ids],
                    outs[-1].finish_reason.value,
                    [x for o in outs for x in o.logprobs or ()],
                )
                for outs in (outputs[rid] for rid in group)
            ]
            for i in sp.kept([c.logprobs for c in samples]):
                completions.append(
                    dataclasses.replace(samples[i], logprobs=samples[i].logprobs if sp.logprobs is not None else None)
                )
        return completions

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield this request's new tokens and text as they are produced; aborts the request if abandoned.

        Bad input raises here; the request is queued when iteration starts."""
        _, ids = self._prompt_ids(prompt)
        params = params or SamplingParams()
        return self._stream(self.engine.check_request(ids, params), params)

    def chat(
        self,
        conversations: Messages | Sequence[Messages],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Reply to one conversation (a list of {'role', 'content'} messages) or to several."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        texts = [self.render_chat(c) for c in conversations]
        completions = self.generate([self.chat_prompt(c) for c in conversations], params)
        plist = params if isinstance(params, Sequence) else [params or SamplingParams()] * len(texts)
        for c, text in zip(completions, (t for t, sp in zip(texts, plist) for _ in range(sp.n))):
            c.prompt = text
        return completions

    def prompt_logits(self, prompt: str | Sequence[int]) -> np.ndarray:
        """Logits [tokens, vocab] of every prompt position: a scoring pass outside the serving path."""
        _, ids = self._prompt_ids(prompt)
        ids = self.engine.check_request(ids, SamplingParams())
        return scoring.prompt_logits(self.config, self._params, self._dtype, ids)

    def prompt_logprobs(self, prompt: str | Sequence[int], k: int = 0) -> list[TokenLogprob | None]:
        """Each prompt token's logprob given the ones before it, with the k most likely there (k <= 20); None for
        the first token, which has nothing before it. A scoring pass outside the serving path (what echo with
        logprobs returns, and what evaluation harnesses score by)."""
        _, ids = self._prompt_ids(prompt)
        ids = self.engine.check_request(ids, SamplingParams(logprobs=k))
        lp, ranks = scoring.prompt_logprobs(self.config, self._params, self._dtype, ids)
        return [None] + [x._replace(rank=int(r)) for x, r in zip(token_logprobs(ids[1:], lp, k), ranks)]


def follow(model: ModelConfig = ModelConfig()) -> None:
    """A follower's life (jax.distributed, every process but the leader): load the same weights as the leader's
    LLM, then make the device-layer calls the leader publishes until it stops (cluster/lockstep.py)."""
    _enable_compilation_cache()
    _, params, _ = load_weights(model.model, resolve_dtype(model.dtype), model.quantization)
    lockstep.follow(jax.tree.map(np.asarray, params))
