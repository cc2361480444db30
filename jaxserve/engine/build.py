"""Building one replica's engines from an EngineConfig (beside sched/build.py and cluster/build.py): the weights
loaded, each device's KV pool sized, the longest context served, the step buckets, the cost profile (read,
measured, or measured while idle after a quick start), and the engine a fail-over moves to. `build_engine` is the
whole of it for one replica; cluster/build.py builds a cluster's instances through the same EngineBuilder."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import pathlib
import threading
from typing import Any, Callable, Sequence

import jax
import numpy as np
from absl import logging

from jaxserve.config import EngineConfig, InstanceShape, ModelConfig
from jaxserve.engine import kv_budget, profile
from jaxserve.engine.batch import Buckets
from jaxserve.engine.engine import Engine
from jaxserve.engine.kv_cache import cache_dtype
from jaxserve.engine.runner import ModelRunner
from jaxserve.models import quantize, registry
from jaxserve.models.config import LlamaConfig
from jaxserve.models.loader import DTYPES, load_weights, resolve_dtype
from jaxserve.models.tokenizer import TextTokenizer
from jaxserve.sched.batch_cost import EngineStepCost
from jaxserve.sched.build import packer_config, pool_context, replica_scheduler
from jaxserve.sched.kv_manager import KVCacheManager
from jaxserve.sched.packer import PackerConfig
from jaxserve.sched.spread_kv import SpreadKV

CPU_KV_GIB = 2.0  # a CPU's KV pool when no size is given: a share of a machine's memory that tests and laptops afford

# how the device layer is constructed: a plain call in one process; across processes lockstep.Leader.new, which
# makes the same object in every follower
Construct = Callable[..., Any]


def construct(cls: Callable, *args: Any, **kwargs: Any) -> Any:
    """The device layer's construction in one process: a plain call."""
    return cls(*args, **kwargs)


def enable_compilation_cache() -> None:
    """Keep compiled step functions on disk so a restart skips XLA compilation (unless the user set a cache)."""
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(registry.cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model's weights as loaded: its name, dtype, architecture, parameters and tokenizer."""

    name: str
    dtype_name: str
    config: LlamaConfig
    params: Any
    tokenizer: TextTokenizer

    @property
    def dtype(self) -> Any:
        return DTYPES[self.dtype_name]


def load_model(cfg: ModelConfig, on_host: bool = False) -> LoadedModel:
    """The model `cfg` names, with the tokenizer it names instead of the model's own (if any). on_host: the
    parameters as host arrays (across processes: each process places its copy on whichever devices need it)."""
    dtype_name = resolve_dtype(cfg.dtype)
    config, params, tokenizer = load_weights(cfg.model, dtype_name, cfg.quantization)
    if cfg.tokenizer:
        tokenizer = TextTokenizer.from_hf_dir(cfg.tokenizer)
        if tokenizer.vocab_size > config.vocab_size:
            raise ValueError(
                f"tokenizer {cfg.tokenizer} has {tokenizer.vocab_size} tokens; the model reads {config.vocab_size}"
            )
    if on_host:
        params = jax.tree.map(np.asarray, params)
    return LoadedModel(cfg.model, dtype_name, config, params, tokenizer)


def build_engine(cfg: EngineConfig, devices: Sequence[jax.Device] | None = None, progress: bool = True) -> Engine:
    """One replica serving `cfg` on `devices` (default: JAX's first the layout needs), in one process."""
    enable_compilation_cache()
    return EngineBuilder(cfg, load_model(cfg.model)).replica(devices, progress)


class EngineBuilder:
    """Makes engines with one EngineConfig's settings over one loaded model: each engine's KV pool, the buckets
    its programs compile for, and one step cost model they share (measured once, on the first engine).

    Attributes a caller reads: kv_tokens (an instance's pool), decode_kv_tokens (a cluster's decode instance's,
    whose tensor-parallel size may differ), max_model_len (the longest context served), buckets, cost (None
    until measured or read), params (the weights; after a one-device replica is built, its runner's copy)."""

    def __init__(self, cfg: EngineConfig, model: LoadedModel, new: Construct | None = None):
        """new: across processes, how the device layer is constructed in every process (lockstep.Leader.new);
        None in one process."""
        self.cfg, self.model, self.params = cfg, model, model.params
        self.new: Construct = new or construct
        self.cost: EngineStepCost | None = None
        self._kv_bytes: dict[tuple[int, int], int] = {}  # a device's KV pool by (tp, stages), once measured
        # the fail-over engine's programs compiling (prepare_fail_over): its runner, their future, a stop
        self._fail_over_programs: tuple[ModelRunner, concurrent.futures.Future, threading.Event] | None = None
        layout = cfg.parallel
        self.kv_tokens = self.kv_pool_tokens(layout.instance)
        self.decode_kv_tokens = (
            self.kv_pool_tokens(InstanceShape(), layout.decoder_tp) if layout.prefill_instances else self.kv_tokens
        )
        self.max_model_len = self._context(cfg.model.max_model_len)
        self.buckets = self._make_buckets()
        self.quick_start = cfg.startup.quick_start and cfg.startup.warmup and not self.across_processes

    @property
    def across_processes(self) -> bool:
        """Whether the device layer is made in every process (lockstep), until a fail-over ends that."""
        return self.new is not construct

    # ---- sizes ----------------------------------------------------------------------------------------
    def _context_sets(self) -> int:
        """The KV-parallel sets one request's KV may spread over: the engine's --kvp, or a cluster's decode
        instance's --decode_kvp (ESP: one instance's)."""
        layout = self.cfg.parallel
        if not layout.prefill_instances:
            return layout.instance.kvp
        if layout.cluster_policy == "esp":  # a request's KV spreads over the pool's instances (multi-master)
            return 1 if self.across_processes else layout.prefill_instances
        return layout.decode_kvp

    def _context(self, asked: int | None) -> int:
        """The longest context served: `asked` (default: the model's positions), capped by the model's positions
        and by what the KV-parallel sets a request may spread over hold together (a cap below what was asked is
        logged with its numbers)."""
        sets, positions = self._context_sets(), self.model.config.max_position_embeddings
        layout = self.cfg.parallel
        per_set = self.decode_kv_tokens if layout.prefill_instances else self.kv_tokens
        pool = per_set * sets
        held = f"{sets} KV-parallel sets of {per_set:,} tokens" if sets > 1 else f"{pool:,} tokens"
        if (
            layout.prefill_instances
            and (stores := pool_context(layout, self.kv_tokens, self.cfg.cache.key_block)) is not None
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

    def kv_pool_tokens(self, shape: InstanceShape, tp: int | None = None) -> int:
        """Tokens an instance's KV pool holds: kv_cache_tokens, or what kv_cache_gib holds, or what
        gpu_memory_utilization leaves a device (engine/kv_budget.py; the default on an accelerator), or 2 GiB's worth
        on a CPU (per device: with tp > 1 a device holds its share of each token's KV heads, with pipeline stages
        its stage's layers'). tp: the instance's (default --tp)."""
        cache, tp, config = self.cfg.cache, tp or self.cfg.parallel.tp, self.model.config
        stages, kvp = shape.stages, shape.kvp
        kv_heads = config.split(tp).kv_heads  # per device; a ValueError when tp does not divide the model
        if tp * stages * kvp > len(jax.devices()):
            sizes = (("tp", tp), ("stages", stages), ("kvp", kvp))
            named = " x ".join(f"{k}={v}" for k, v in sizes if k == "tp" or v > 1)
            raise ValueError(f"{named} needs {tp * stages * kvp} devices; there are {len(jax.devices())}")
        kv_dtype = cache_dtype(self.model.dtype, jax.devices()[0].platform, cache.kv_cache_dtype)
        layers = -(-config.num_layers // stages)  # the largest stage's
        token_bytes = 2 * layers * kv_heads * config.head_dim * kv_dtype.itemsize
        if cache.kv_cache_tokens or cache.kv_cache_gib:
            return cache.kv_cache_tokens or int(cache.kv_cache_gib * 2**30 // token_bytes)
        device = jax.devices()[0]
        utilization = cache.gpu_memory_utilization or (0.9 if device.platform != "cpu" else None)
        if utilization is None:
            return int(CPU_KV_GIB * 2**30 // token_bytes)
        if (tp, stages) not in self._kv_bytes:  # measured once, before any runner: later ones (a fail-over) as much
            sched = self.cfg.scheduler
            b = kv_budget.budget(
                device,
                utilization,
                quantize.nbytes(self.params) // (tp * stages),
                kv_budget.activation_bytes(
                    config,
                    sched.max_num_batched_tokens,
                    sched.max_num_seqs,
                    cache.key_block,
                    self.model.dtype.itemsize,
                    tp,
                    quantized=self.cfg.model.quantization is not None,
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
        (docs/BENCHMARKS.md, "Serving on one H200, profiled, and on one H100")."""
        cache, sched = self.cfg.cache, self.cfg.scheduler
        platform = jax.devices()[0].platform
        on_cpu = platform == "cpu"
        return Buckets.make(
            sched.max_num_batched_tokens,
            sched.max_num_seqs,
            self.max_model_len,
            cache.block_size,
            cache.key_block,
            min_rows=4 if on_cpu else None,
            max_prefills=sched.max_prefills_per_step,
            num_scheduler_steps=self.cfg.burst_steps(platform),
            min_decode_rows=1 if on_cpu else 2,
        )

    def _num_blocks(
        self, devices: Sequence[jax.Device], kv_cache_tokens: int | None, shape: InstanceShape, tp: int
    ) -> int:
        """KV blocks of an engine on `devices` of instances of `tp`: each KV-parallel set's pool (default:
        kv_tokens) and its scratch block."""
        kvp = len(devices) // (tp * shape.stages)
        return (-(-(kv_cache_tokens or self.kv_tokens) // self.cfg.cache.block_size) + 1) * kvp

    def _runner_settings(self, devices: Sequence[jax.Device], num_blocks: int, shape: InstanceShape, tp: int) -> dict:
        """ModelRunner's settings (after the model, its weights and dtype) for an engine of these settings."""
        cache = self.cfg.cache
        return dict(
            num_blocks=num_blocks,
            block_size=cache.block_size,
            buckets=self.buckets,
            key_block=cache.key_block,
            devices=list(devices),
            tp=tp,
            stages=shape.stages,
            kv_cache_dtype=cache.kv_cache_dtype,
        )

    # ---- engines --------------------------------------------------------------------------------------
    def replica(self, devices: Sequence[jax.Device] | None = None, progress: bool = True) -> Engine:
        """The engine of a replica serving alone. In one process, one device and one stage, its runner's weights
        become the only copy kept (the runner's, per layer)."""
        engine = self.engine(devices, progress=progress)
        runner = engine.runner
        if not self.across_processes and self.cfg.parallel.tp == 1 and runner.stages == 1 and not runner.scan_mixed:
            self.params = runner.params
        return engine

    def engine(
        self,
        devices: Sequence[jax.Device] | None = None,
        progress: bool = True,
        kv_cache_tokens: int | None = None,
        shape: InstanceShape | None = None,
        compiled: dict | None = None,
        tp: int | None = None,
        max_model_len: int | None = None,
    ) -> Engine:
        """An engine on `devices` (default: JAX's first tp x kvp x stages devices; runs of tp are tensor-parallel
        instances, several instances form a KV-parallel group whose KV pool is the sum of theirs, and with pipeline
        stages each stage is an equal share of them), its step programs compiled; the step cost model is measured
        once (on the first engine) and shared. kv_cache_tokens: each instance's pool (default: kv_tokens). shape:
        its stages and KV-parallel sets (default: the config's). compiled: its programs, compiled already
        (ModelRunner.compiled_programs of a runner like it). tp: devices per instance (default --tp; a cluster's
        decode instances: --decode_tp, whose pool is its own). max_model_len: its requests' longest context
        (default: max_model_len; an ESP instance's: what its own pool holds)."""
        cfg = self.cfg
        cache, shape = cfg.cache, shape or cfg.parallel.instance
        tp, context = tp or cfg.parallel.tp, max_model_len or self.max_model_len
        if kv_cache_tokens is None and tp != cfg.parallel.tp:
            kv_cache_tokens = self.decode_kv_tokens
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
            sliding_window=self.model.config.uniform_window,
        )
        runner = self.new(
            ModelRunner,
            self.model.config,
            self.params,
            self.model.dtype,
            compiled=compiled,
            **self._runner_settings(devices, num_blocks, shape, tp),
        )
        # one engine starts quickly while its cost model is unknown (measured later); a cluster always: its
        # instances are many and its pool compiles while idle too. A cluster's instances get prompts as KV
        cluster = bool(cfg.parallel.prefill_instances)
        quick = self.quick_start and (self.cost is None or cluster)
        first = runner.first_programs(mixed=not cluster)
        if cfg.startup.warmup:
            runner.warmup(first if quick else None, progress=progress)
        path = None
        if self.cost is None:
            path = (
                pathlib.Path(cfg.startup.cost_profile)
                if cfg.startup.cost_profile
                else profile.default_path(self.model.name, self.model.dtype_name, runner)
            )
            self.cost = profile.read_kept(path, lambda: profile.load(path, runner))
            if self.cost is None and cfg.startup.warmup and not quick:
                self.cost = profile.load_or_measure(path, runner, context, progress)
        engine = self.over(runner, kv, context)
        if quick:
            compiled = runner.compile_in_background(runner.later_programs(first))
            scheduler = engine.scheduler
            if self.buckets.burst_steps > 1:  # no burst before its programs compile (the step would wait)
                scheduler.num_scheduler_steps = 1
                compiled.add_done_callback(
                    lambda _: setattr(scheduler, "num_scheduler_steps", self.buckets.burst_steps)
                )
            if self.cost is None:  # measured by this engine (the first); others adopt it
                engine.defer(functools.partial(self._measure_when_idle, engine, path, compiled))
        return engine

    def over(self, runner: Any, kv: KVCacheManager | SpreadKV, max_model_len: int) -> Engine:
        """The engine over a runner (a ModelRunner, or ESP's multi-master group's) and its block manager,
        scheduled by these settings and the cost model."""
        cost = self.cost or profile.unmeasured(runner)
        scheduler = replica_scheduler(
            self.cfg.scheduler,
            cost,
            kv,
            self._packer(cost, measured=self.cost is not None),
            num_scheduler_steps=self.buckets.burst_steps,
            admission=self.cfg.parallel.decode_admission,
        )
        return Engine(runner, scheduler, self.model.tokenizer, max_model_len=max_model_len)

    def adopt_cost(self, engine: Engine) -> None:
        """An engine that measures nothing itself (ESP's multi-master group) plans by the cost model once another
        engine has measured it (at once if one has)."""
        if self.cost is None:
            engine.defer(functools.partial(self._adopt_cost, engine))

    def _packer(self, cost: EngineStepCost, measured: bool) -> PackerConfig:
        return packer_config(
            self.cfg.scheduler,
            cost,
            max_model_len=self.max_model_len,
            chunk_align=self.buckets.tokens[0],
            max_prefills=self.buckets.max_prefills,
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

    # ---- fail-over --------------------------------------------------------------------------------------
    def _fail_over_layout(self) -> tuple[list[jax.Device], int, InstanceShape]:
        """Where a fail-over's engine runs: this process's first devices, as many KV-parallel sets as the context
        needs and this process has (too few, and each holds more); its tokens per set; its shape."""
        tp = self.cfg.parallel.tp
        per_set = self.kv_pool_tokens(InstanceShape())
        sets = max(min(-(-self.max_model_len // per_set), len(jax.local_devices()) // tp), 1)
        return jax.local_devices()[: tp * sets], max(per_set, -(-self.max_model_len // sets)), InstanceShape(kvp=sets)

    def prepare_fail_over(self) -> None:
        """Compile the fail-over engine's step programs in the background, one at a time while this one serves,
        from shapes alone (nothing is placed on the devices), so that a fail-over waits for no compile."""
        devices, tokens, shape = self._fail_over_layout()
        tp = self.cfg.parallel.tp
        runner = ModelRunner(
            self.model.config,
            self.params,
            self.model.dtype,
            placed=False,
            **self._runner_settings(devices, self._num_blocks(devices, tokens, shape, tp), shape, tp),
        )
        programs, stop = runner.programs(), threading.Event()
        logging.info("compiling the fail-over engine's %d step programs in the background", len(programs))
        self._fail_over_programs = runner, runner.compile_in_background(programs, stop), stop

    def fail_over(self) -> Engine:
        """After a follower process is lost: one replica on this process's first devices, its programs compiled:
        those prepare_fail_over compiled (if it ran), the rest now, in parallel. From now on everything is
        constructed in this process alone."""
        self.new = construct
        devices, tokens, shape = self._fail_over_layout()
        compiled = None
        if self._fail_over_programs is not None:
            prepared, done, stop = self._fail_over_programs
            stop.set()  # the one compiling now ends; engine() compiles what is left, in parallel
            concurrent.futures.wait([done])  # a failure was logged; what did compile is still used
            compiled = prepared.compiled_programs()
        logging.warning("building one engine on this process's %d first device(s) after a lost process", len(devices))
        return self.engine(devices, progress=False, kv_cache_tokens=tokens, shape=shape, compiled=compiled)
