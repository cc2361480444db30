"""Assembling a live cluster from `jax.devices()`: the prefill pool, the CDSP planner over it, decode instances,
and the warm-up that compiles every program the layout can run: before the first request, or after a quick start
while the cluster idles (Compiling)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import pathlib
import resource
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from jaxserve.cluster import pool_profile
from jaxserve.config import ParallelConfig
from jaxserve.cluster.decode import LiveDecoder
from jaxserve.cluster.engine import ClusterEngine
from jaxserve.cluster.length_predictor import KeptClassifier, PromptFeatures, default_path
from jaxserve.cluster.multi_master import MultiMaster
from jaxserve.cluster.esp import ESPCluster
from jaxserve.cluster.tetriinfer import TetriInferCluster
from jaxserve.cluster.transfer import KVMover
from jaxserve.engine.build import EngineBuilder, construct
from jaxserve.engine.engine import Engine
from jaxserve.engine.sp_prefill import SPPrefill, next_power_of_two
from jaxserve.sched.build import MIN_LOCAL
from jaxserve.sched.cdsp import CDSPPlanner, MeasuredBalancing, Pool, planner_groups
from jaxserve.sched.cluster import CDSPPolicy, ESPPolicy, TetriInferPolicy
from jaxserve.sched.csps import CSPSPlanner, MeasuredCSPS
from jaxserve.sched.decode_dispatch import ObservedLengths
from jaxserve.sched.esp import ESPScheduler, aligned_groups
from jaxserve.sched.flip import FlipPolicy
from jaxserve.sched.improvement_rate import AdaptiveCDSP, read_rate_table
from jaxserve.sched.prefill_batches import PrefillBatchScheduler
from jaxserve.sched.spread_kv import SpreadKV
from jaxserve.sched.cost_models import LoongServePrefill, TetrisPrefill


def devices_needed(layout: ParallelConfig) -> int:
    """Devices a cluster layout uses: the prefill pool's instances of `tp` devices first, then `decode_instances`
    decode instances of `decode_kvp` instances of `decoder_tp` devices each (a KV-parallel group when more than
    one). Under ESP the pool's instances decode too."""
    if layout.cluster_policy == "esp":
        return layout.prefill_instances * layout.tp
    return layout.prefill_instances * layout.tp + layout.decode_instances * layout.decode_kvp * layout.decoder_tp


def check_layout(layout: ParallelConfig, available: int) -> None:
    """The layout's devices against those there are (the rest of it ParallelConfig checked when made)."""
    if devices_needed(layout) > available:
        tp = f", {layout.tp} devices each" if layout.tp > 1 else ""
        if layout.cluster_policy == "esp":
            raise ValueError(
                f"the layout needs {devices_needed(layout)} devices ({layout.prefill_instances} "
                f"elastic instances{tp}); there are {available}"
            )
        decode_tp = f", {layout.decoder_tp} devices each" if layout.decoder_tp > 1 else ""
        raise ValueError(
            f"the layout needs {devices_needed(layout)} devices ({layout.prefill_instances} prefill"
            f"{tp} + {layout.decode_instances} decode x {layout.decode_kvp}{decode_tp}); there are "
            f"{available}"
        )


def pool_of(layout: ParallelConfig) -> Pool:
    """The prefill pool as the planner sees it: `node_size` instances to a node."""
    return Pool(layout.prefill_instances // layout.node_size, layout.node_size)


def warmup_steps(cluster: ClusterEngine, max_tokens: int) -> list[Callable[[], Any]]:
    """Every program the layout can run, a step each (a compile, or one instance's pieces): the length
    predictor's feature programs, every chunk program (group x local bucket the policy can run), each prefill
    instance's KV-move and KV-export pieces and its transfers to every decode instance, each decode instance's
    landing programs and its decode programs and samplers (a recompute's prefill compiles when it comes; after a
    quick start its engine compiles them in the background too: a step finds one compiled, or waits for it)."""
    sp = cluster.prefill
    steps = [functools.partial(cluster.features.warmup, max_tokens)] if cluster.features is not None else []
    steps += [functools.partial(sp.program, g, b) for g, b in cluster.chunk_shapes(max_tokens)]
    for i in sp.stores:
        steps += [functools.partial(sp.warmup_moves, i), functools.partial(cluster.mover.warmup, i)]
    for d in cluster.decoders:
        runner = d.engine.runner
        steps.append(functools.partial(runner.warmup_land, sp.cap))
        steps += [functools.partial(runner.warmup, [p], progress=False) for p in runner.programs(mixed=False)]
    return steps


def warmup(cluster: ClusterEngine, max_tokens: int, progress: bool = True) -> None:
    """Every warmup step now, before serving (the decode programs first, a thread per core)."""
    for d in cluster.decoders:
        d.engine.runner.warmup(d.engine.runner.programs(mixed=False), progress=progress)
    for step in tqdm(
        warmup_steps(cluster, max_tokens), desc="compile the cluster's programs", unit="program", disable=not progress
    ):
        step()


@dataclasses.dataclass
class Compiling:
    """The cluster's programs compiled while it idles, after a quick start: warmup_steps one at a time (a request
    that comes first compiles what it needs itself). IdleWork."""

    steps: list[Callable[[], Any]]
    name: str = "compile the cluster's programs"
    _next: int = 0

    @property
    def done(self) -> bool:
        return self._next == len(self.steps)

    def step(self) -> None:
        self.steps[self._next]()
        self._next += 1

    def finish(self) -> None:
        logging.info("%s: the %d steps done while idle", self.name, len(self.steps))


def build(
    cfg,
    params,
    layout: ParallelConfig,
    make_engine: Callable[[list[jax.Device], int], Engine],
    prefill_cost: TetrisPrefill | LoongServePrefill | pathlib.Path,
    *,
    capacity: int,
    store_tokens: int | None = None,
    dtype=jnp.float32,
    kv_cache_dtype: str = "auto",
    sizes: Sequence[int] | None = None,
    dispatch: str = "freeness",
    key_block: int = 256,
    min_local: int = MIN_LOCAL,
    devices: Sequence[jax.Device] | None = None,
    progress: bool = True,
    predictor_file: pathlib.Path | None = None,
    defer: bool = False,
    make_group: Callable[[list[Engine]], Engine] | None = None,
    new: Callable[..., Any] = construct,
) -> ClusterEngine:
    """layout.cluster_policy picks the prefill side: cdsp (a CDSP planner over the pool), csps (CSPS's planner:
    whole prompts on SP-NTP groups sized by --partition_tokens), tetriinfer (each pool
    instance its own PrefillBatchScheduler; power-of-two dispatch) or esp (the pool's instances decode too, an
    ESPScheduler batches prompts onto elastic groups). make_engine(devices, tp): a decode engine on `devices` of
    instances of `tp`. prefill_cost (cdsp, csps: Eq. (1); esp: LoongServe's batch model): the planner's model, or the
    file to load it from (measured on this pool and written there first if it does not exist). sizes: the SP
    sizes chunks may use (default: the fitted ones, or the powers of two from a node to the pool when
    measuring). capacity: the longest prompt; store_tokens: what a CDSP pool instance's history store holds (its
    device's KV budget; default: capacity), a prompt's history spread over its chunks' groups (pool_context).
    predictor_file: where `--length_predictor=prompt` keeps what it learned (default: nowhere). defer: a
    prefill_cost file that does not exist yet is not measured now: the pool plans with a prior model until the
    cluster measures its own while idle (ClusterEngine.run_deferred) and switches to it.
    make_group(engines): under esp, the multi-master engine over the instances' engines that decodes the requests
    whose KV spreads over several instances (None: each request decodes on one instance, its context one's).
    new: makes the device-layer objects (across processes: lockstep.Leader.new)."""
    devices = list(devices or jax.devices())
    check_layout(layout, len(devices))
    tp, first = layout.tp, layout.prefill_instances * layout.tp
    # a TetriInfer prompt's pieces each fill a power-of-two bucket of rows: the first and the last waste less
    # than a chunk each (a power of two), the pieces between fill theirs. An ESP prompt is one chunk: each
    # instance of its group takes an even share, at most what its decode pool holds (the batches are placed so),
    # and fills a power-of-two bucket
    held = min(capacity, store_tokens or capacity)
    rows = {"tetriinfer": capacity + 2 * layout.prefill_chunk, "esp": next_power_of_two(held)}.get(
        layout.cluster_policy, held
    )
    flips = bool(layout.flip_window)
    if flips:  # every instance may prefill and decode: a store and an engine on each
        first = (layout.prefill_instances + layout.decode_instances) * tp
    sp = new(
        SPPrefill,
        cfg,
        params,
        devices[:first],
        capacity=rows,
        dtype=dtype,
        key_block=key_block,
        min_local=min_local,
        tp=tp,
        sp_attention=layout.pool_sp_attention,
        sparse_attention=layout.sparse_attention,
        kv_cache_dtype=kv_cache_dtype,
    )
    if layout.cluster_policy == "esp" or flips:  # instances that decode on the pool's devices
        engines = [make_engine(devices[i * tp : (i + 1) * tp], tp) for i in range(first // tp)]
    else:
        g = layout.decode_kvp * layout.decoder_tp
        engines = [
            make_engine(devices[first + i * g : first + (i + 1) * g], layout.decoder_tp)
            for i in range(layout.decode_instances)
        ]
    features = PromptFeatures(params) if layout.length_predictor == "prompt" else None
    predictor = ObservedLengths() if features is None else KeptClassifier(predictor_file, features.dim)
    group = make_group(engines) if layout.cluster_policy == "esp" and make_group and len(engines) > 1 else None
    decoding = engines + ([group] if group is not None else [])
    mover = new(KVMover, sp, [e.runner for e in decoding])
    decoders = [LiveDecoder(i, e, layout.receive_buffers, mover) for i, e in enumerate(decoding)]
    pool_ids = sorted(sp.instances)
    later: list[pool_profile.Later] = []

    def now_or_later(now: Callable[[], Any], or_later: Callable[[], tuple[Any, pool_profile.Later | None]]):
        """A pool model: cached, else measured now, or (defer) what stands in until the cluster measures it."""
        if not defer:
            return now()
        model, pending = or_later()
        later.extend([pending] if pending is not None else [])
        return model

    def pool_model(
        path: pathlib.Path, groups: dict[int, tuple[int, ...]], use: Callable[[Any], None], esp: bool = False
    ):
        """The pool's prefill model in `path` (a prior until measured, with defer)."""
        return now_or_later(
            lambda: pool_profile.load_or_measure(path, sp, groups, capacity, progress, esp=esp),
            lambda: pool_profile.load_or_later(path, sp, groups, capacity, use, esp=esp),
        )

    def measuring(cluster: ClusterEngine) -> ClusterEngine:
        for pending in later:
            cluster.defer(pending)
        return cluster

    if layout.cluster_policy == "tetriinfer":
        instances = [
            PrefillBatchScheduler(layout.prefill_chunk, layout.prefill_batch, layout.prefill_order, (d,))
            for d in pool_ids
        ]
        flip = FlipPolicy(window=layout.flip_window, check_every=layout.flip_window / 12) if flips else None
        scheduler = TetriInferPolicy(
            instances,
            pool_ids,
            len(decoders),
            "power_of_two",
            predictor,
            flip=flip,
            prefilling=layout.prefill_instances,
        )
        return TetriInferCluster(sp, scheduler, decoders, mover, features=features)
    if layout.cluster_policy == "esp":
        groups = aligned_groups(layout.prefill_instances)

        def measured_batches(model: LoongServePrefill) -> None:
            esp.use(model, ESPScheduler.served_knee(model, tp, capacity))

        if isinstance(prefill_cost, pathlib.Path):
            first_group = {len(g): tuple(pool_ids[i] for i in g) for g in reversed(groups)}
            prefill_cost = pool_model(prefill_cost, first_group, measured_batches, esp=True)
        knee = ESPScheduler.served_knee(prefill_cost, tp, capacity)
        esp = ESPScheduler(prefill_cost, tp, knee, None, 0.0, groups=groups)  # no bandwidth: no KV evacuated
        scheduler = ESPPolicy(
            esp, pool_ids, "freeness", predictor, spread=group is not None, instance_context=engines[0].max_model_len
        )
        return measuring(ESPCluster(sp, scheduler, decoders, mover, features=features))
    if layout.cluster_policy == "csps":  # a prompt is one chunk with no history: Eq. (1) at h = 0 prices it

        def measured_csps(model: TetrisPrefill) -> None:
            planner.model = MeasuredCSPS(model)

        if isinstance(prefill_cost, pathlib.Path):
            sizes = sizes or [1 << i for i in range(layout.prefill_instances.bit_length())]
            groups = {s: tuple(devices[i * tp].id for i in range(s)) for s in sizes}  # each size's first group
            prefill_cost = pool_model(prefill_cost, groups, measured_csps)
        sizes = sizes or sorted(s for s in prefill_cost.coefficients if s <= layout.prefill_instances)
        planner = CSPSPlanner(
            MeasuredCSPS(prefill_cost), pool_of(layout), layout.partition_tokens, sizes, stores=sp.room
        )
        return measuring(
            ClusterEngine(sp, CDSPPolicy(planner, pool_ids, dispatch, predictor), decoders, mover, features=features)
        )
    plan_with = dict(model=prefill_cost, moves=None)  # a model given (not measured here): moves priced free

    def cdsp_planner(model: TetrisPrefill, moves: MeasuredBalancing | None) -> CDSPPlanner:
        return CDSPPlanner(
            model,
            pool_of(layout),
            layout.improvement_rate,
            sizes=sizes,
            min_chunk=layout.min_chunk,
            balancing=moves,
            stores=sp.room,
        )

    def replan(**measured) -> None:  # a measured model or move line in place of the prior's
        plan_with.update(measured)
        planner = cdsp_planner(**plan_with)
        if isinstance(scheduler.planner, AdaptiveCDSP):  # the rate the load chose stays
            planner.improvement_rate = scheduler.planner.planner.improvement_rate
            scheduler.planner.planner = planner
        else:
            scheduler.planner = planner

    if isinstance(prefill_cost, pathlib.Path):
        pool = pool_of(layout)
        sizes = sizes or [s for s in (pool.per_node << i for i in range(pool.size.bit_length())) if s <= pool.size]
        first_group = {len(g): g for g in reversed(planner_groups(pool, sizes))}  # the first group of each size
        groups = {s: tuple(devices[i * tp].id for i in g) for s, g in first_group.items()}
        moves_file = prefill_cost.with_name(prefill_cost.stem + "-moves.json")
        plan_with["model"] = pool_model(prefill_cost, groups, lambda model: replan(model=model))
        if len(groups) > 1:  # a chunk may move its history onto a larger group: priced as measured (free until)
            plan_with["moves"] = now_or_later(
                lambda: pool_profile.load_or_measure_moves(moves_file, sp, groups, capacity, pool.per_node, progress),
                lambda: pool_profile.moves_or_later(
                    moves_file, sp, groups, capacity, pool.per_node, lambda moves: replan(moves=moves)
                ),
            )
    planner = cdsp_planner(**plan_with)
    if layout.improvement_rates is not None:  # the user's own file: a bad one is refused, naming it
        planner = AdaptiveCDSP(planner, read_rate_table(pathlib.Path(layout.improvement_rates)))
    scheduler = CDSPPolicy(planner, pool_ids, dispatch, predictor)
    return measuring(ClusterEngine(sp, scheduler, decoders, mover, features=features))


def spread_engine(builder: EngineBuilder, instances: Sequence[Engine]) -> Engine:
    """The engine of ESP's multi-master group over `instances` (one device set each): it decodes the requests
    whose KV spreads over several of them, in blocks of their own pools (cluster/multi_master.py,
    sched/spread_kv.py); its context is the builder's, at most what their pools hold together."""
    runner = MultiMaster([e.runner for e in instances], builder.params, builder.buckets)
    kv = SpreadKV([e.kv for e in instances])
    engine = builder.over(runner, kv, min(builder.max_model_len, kv.capacity * kv.block_size))
    builder.adopt_cost(engine)  # after a quick start its instances measure the step profile while idle
    return engine


def build_cluster(builder: EngineBuilder, progress: bool = True) -> ClusterEngine:
    """The live cluster the builder's EngineConfig lays out (--prefill_instances > 0), its decode instances made
    by the builder, its pool model in the kept profile. Like one engine, serve compiles everything first (with a
    quick start: while idle), generate as steps need it; across processes always first (a transfer's communicator
    is set up there, which every process must reach within a deadline)."""
    cfg, model = builder.cfg, builder.model
    layout, key_block = cfg.parallel, cfg.cache.key_block
    path = (
        pathlib.Path(cfg.startup.prefill_profile)
        if cfg.startup.prefill_profile
        else pool_profile.default_path(
            model.name,
            model.dtype_name,
            f"{layout.cluster_policy}-{layout.pool_attention}",
            layout.prefill_instances,
            layout.node_size,
            layout.tp,
            builder.max_model_len,
            key_block,
        )
    )
    # an ESP instance serves alone the requests that fit its own pool; its group, those that spread
    instance_context = min(builder.max_model_len, builder.kv_tokens) if layout.cluster_policy == "esp" else None
    local = not builder.across_processes
    cluster = build(
        model.config,
        builder.params,
        layout,
        lambda ds, tp: builder.engine(ds, progress, tp=tp, max_model_len=instance_context),
        path,
        capacity=builder.max_model_len,
        store_tokens=builder.kv_tokens,
        dtype=model.dtype,
        key_block=key_block,
        progress=progress,
        new=builder.new,
        make_group=functools.partial(spread_engine, builder) if local else None,
        kv_cache_dtype=cfg.cache.kv_cache_dtype,
        predictor_file=default_path(model.name, model.dtype_name),
        defer=cfg.startup.quick_start and local,
    )
    if builder.quick_start:
        cluster.defer(Compiling(warmup_steps(cluster, builder.max_model_len)), first=True)
    elif cfg.startup.warmup or not local:
        warmup(cluster, builder.max_model_len, progress)
    logging.info(
        "the cluster is built; this process's peak memory so far: %.1f GiB",
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    )  # KiB on Linux
    return cluster
