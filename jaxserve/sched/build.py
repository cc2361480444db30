"""The replica scheduler from a SchedulerConfig: one builder for the engine, the simulator and the benchmarks."""

from __future__ import annotations

import math

from jaxserve.config import ParallelConfig, SchedulerConfig
from jaxserve.sched.batch_cost import BatchCost
from jaxserve.sched.cdsp import Stores
from jaxserve.sched.kv_manager import KVCacheManager
from jaxserve.sched.packer import PackerConfig, PrefillTimeCache
from jaxserve.sched.policies import make_policy
from jaxserve.sched.scheduler import ReplicaScheduler

MIN_LOCAL = 64  # a prefill pool's smallest per-instance chunk bucket


def full_step_time(cost: BatchCost, config: SchedulerConfig, max_model_len: int) -> float:
    """The default iteration budget: a full step, max_num_batched_tokens in max_num_seqs rows, all but one of them
    decodes at the longest context and the rest a fresh prompt's chunk. A budget of the token bucket's time
    alone would leave no room for attention: once a decode ran, no step could use the largest bucket. So the
    budget binds only where attention is dear (late chunks of a long prompt: adaptive chunking)."""
    decodes = config.max_num_seqs - 1
    return cost.batch_time([(max(config.max_num_batched_tokens - decodes, 1), 0)], [max_model_len] * decodes)


def packer_config(
    config: SchedulerConfig,
    cost: BatchCost,
    *,
    max_model_len: int | None = None,
    chunk_align: int = 32,
    max_prefills: int | None = None,
    measured: bool = True,
    long_threshold: int | None = None,
    stages: int = 1,
) -> PackerConfig:
    """The packer's settings. Without a measured cost model and without an iteration_budget, the token budget
    alone bounds a step (as in vLLM). Each of `stages` pipeline stages gets its share of the budget, so the time
    between tokens stays near the budget however deep the pipeline. A prompt of long_threshold tokens or more
    is long (default: a quarter of max_model_len, which the default budget needs too)."""
    budget = config.iteration_budget
    if budget is None:
        budget = full_step_time(cost, config, max_model_len) if measured else math.inf
    return PackerConfig(
        iteration_budget=budget / stages,
        multi_prefill=config.multi_prefill,
        space_sharing=config.space_sharing,
        chunk_align=chunk_align,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_prefills=max_prefills,
        long_threshold=long_threshold or max(max_model_len // 4, 2 * chunk_align),
    )


def replica_scheduler(
    config: SchedulerConfig,
    cost: BatchCost,
    kv: KVCacheManager,
    packer: PackerConfig,
    *,
    group: tuple[int, ...] = (0,),
    prefill_cache: PrefillTimeCache | None = None,
    num_scheduler_steps: int | None = None,
    admission: str = "greedy",
    **policy_args,
) -> ReplicaScheduler:
    """A replica's scheduler: the config's policy, SLO and batch limits over this cost model and KV pool.
    num_scheduler_steps: the bursts the executor can run (default: the config's, else 1). admission: of requests
    prefilled elsewhere (a cluster's decode instance)."""
    steps = (config.num_scheduler_steps or 1) if num_scheduler_steps is None else num_scheduler_steps
    return ReplicaScheduler(
        make_policy(config.policy, **policy_args),
        cost,
        packer,
        kv,
        group,
        config.slo,
        max_num_seqs=config.max_num_seqs,
        prefill_cache=prefill_cache,
        num_scheduler_steps=steps,
        admission=admission,
    )


def pool_context(layout: ParallelConfig, store_tokens: int, key_block: int) -> int | None:
    """The longest prompt a CDSP or CSPS pool's history stores of store_tokens each hold together, spread over its
    instances (None for the other policies, whose stores hold a whole prompt)."""
    if layout.cluster_policy not in ("cdsp", "csps"):
        return None
    return Stores(-(-store_tokens // key_block) * key_block, MIN_LOCAL).longest(layout.prefill_instances)
