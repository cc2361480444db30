"""Discrete-event cluster simulator: replicas, each driven by the real ReplicaScheduler, execute its Plans with a
cost model instead of devices. Events are arrivals, pipeline-stage frees and batch completions; the clock jumps
from one to the next. Deterministic: no randomness beyond the workload's seed.

A replica is `tp * stages * kvp` devices. With pipeline stages (Medha's stream pipeline parallelism) a new batch
starts whenever the first stage frees up, so up to `stages` batches are in flight: a long prompt's next chunk
enters the first stage while its previous one is still further down, and decodes wait for their token. Each
stage gets iteration_budget / stages, so the time between tokens stays near iteration_budget.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from typing import Callable

from tqdm.auto import tqdm

from jaxserve.config import SimConfig
from jaxserve.sched.batch_cost import BatchCost
from jaxserve.sched.kv_manager import KVCacheManager
from jaxserve.sched.build import packer_config, replica_scheduler
from jaxserve.sched.packer import PackerConfig, PrefillTimeCache
from jaxserve.sched.plan import Outcome, Phase, Plan
from jaxserve.sched.profiles import PROFILES, ProfileBatchCost, kv_capacity, model_shape, network
from jaxserve.sched.request import Request
from jaxserve.sched.scheduler import ReplicaScheduler
from jaxserve.sim.metrics import Results
from jaxserve.sim.workload import Workload

PLACEHOLDER_TOKEN = 0  # the simulator produces token counts, not text


def replica_kv_capacity(config: SimConfig) -> int:
    """KV tokens a replica holds: the config's, or what its GPUs' memory holds beside the weights."""
    if config.kv_capacity is not None:
        return config.kv_capacity
    shape = config.instance
    return shape.kvp * kv_capacity(config.profile, config.tp * shape.stages, config.memory_utilization)


def stage_packer(config: SimConfig, cost: BatchCost) -> PackerConfig:
    """A token passes every stage once per iteration: each stage gets 1/stages of the iteration budget, so time
    between tokens stays near the budget however deep the pipeline."""
    return packer_config(
        config.scheduler,
        cost,
        chunk_align=config.chunk_align,
        max_prefills=config.max_prefills,
        long_threshold=config.long_threshold,
        stages=config.instance.stages,
    )


def step_seconds(cost: BatchCost, plan: Plan) -> float:
    """A Plan's time on the cost model: a burst of decode steps, or one step of chunks and decodes."""
    if plan.steps > 1:
        return cost.burst_time([(i.start, i.tokens) for i in plan.items], plan.steps)
    return cost.batch_time(
        [(i.tokens, i.history) for i in plan.items if i.phase is Phase.PREFILL],
        [i.history for i in plan.items if i.phase is Phase.DECODE],
    )


def step_tokens(scheduler: ReplicaScheduler, plan: Plan) -> dict[str, tuple[int, ...]]:
    """The tokens a Plan's items yield (placeholders: the simulator counts tokens)."""
    return {
        i.request_id: (PLACEHOLDER_TOKEN,) * (i.tokens if i.phase is Phase.DECODE else 1)
        for i in plan.items
        if scheduler.yields_token(i)
    }


class Replica:
    def __init__(self, index: int, config: SimConfig, cost: BatchCost, packer: PackerConfig, cache: PrefillTimeCache):
        sjf = config.scheduler.policy in ("sjf", "ljf")
        group = tuple(range(index * config.gpus_per_replica, (index + 1) * config.gpus_per_replica))
        kv = KVCacheManager.for_tokens(replica_kv_capacity(config), config.block_size, enable_prefix_caching=False)
        self.scheduler = replica_scheduler(
            config.scheduler,
            cost,
            kv,
            packer,
            group=group,
            prefill_cache=cache,
            **({"batch": config.sjf_batch} if sjf else {}),
        )
        self.cost, self.stages, self.time_scale = cost, config.instance.stages, config.time_scale
        self.stage_free_at = 0.0
        # between stages (a node each) a batch's activations cross the inter-node link, each TP rank sending its
        # share; the link runs beside the next batch's compute, so it adds latency, not stage time
        gpu, shape = PROFILES[config.profile][0], model_shape(config.profile)
        self._link, self._activation_bytes = network(gpu), 2.0 * shape.hidden / config.tp

    def hop(self, tokens: int) -> float:
        """Seconds for a batch of `tokens` tokens to pass from one pipeline stage to the next."""
        return self._link.predict("inter_node", tokens * self._activation_bytes)

    def execute(self, plan: Plan, start: float) -> tuple[float, Outcome]:
        """Charge a Plan on the cost model: per-stage time, ready again after one stage, done after all."""
        stage_time = step_seconds(self.cost, plan) * self.time_scale
        hops = (self.stages - 1) * self.hop(sum(i.tokens for i in plan.items)) if self.stages > 1 else 0.0
        end = start + stage_time * self.stages + hops
        per_item = tuple(end - start for _ in plan.items)
        self.stage_free_at = start + stage_time
        return self.stage_free_at, Outcome(end, per_item, step_tokens(self.scheduler, plan))


class Simulator:
    def __init__(self, config: SimConfig = SimConfig(), cost: BatchCost | None = None):
        """cost: the iteration cost model of one pipeline stage; defaults to the config's built-in profile."""
        self.config = config
        shape = config.instance
        self.cost = cost or ProfileBatchCost(config.profile, config.tp, shape.stages, shape.kvp, shape.kvp_tokens)
        # chunks of one prompt stream through the stages back to back: a prompt costs the sum of its chunks'
        # stage times (plus a pipeline fill, left out)
        self.packer = stage_packer(config, self.cost)
        self.cache = PrefillTimeCache.for_packer(self.cost, self.packer)

    def run(self, workload: Workload, progress: bool = True, max_time: float | None = None) -> Results:
        """Replay a workload; deadlines come from the config's SLO."""
        requests = [
            Request(str(i), float(t), int(p), int(o))
            for i, (t, p, o) in enumerate(zip(workload.arrivals, workload.prompt_lens, workload.output_lens))
        ]
        return self.run_requests(requests, workload.name, progress, max_time)

    def run_requests(
        self, requests: list[Request], name: str = "requests", progress: bool = True, max_time: float | None = None
    ) -> Results:
        """Replay requests as given (a request with a finite ttft_deadline keeps it)."""
        cfg = self.config
        replicas = [Replica(i, cfg, self.cost, self.packer, self.cache) for i in range(cfg.replicas)]
        requests = sorted(requests, key=lambda r: r.arrival)
        # at equal times: completions first (they free requests and memory), then stage frees, then arrivals
        events: list[tuple[float, int, int, str, object]] = []
        seq = itertools.count()
        for r in requests:
            events.append((r.arrival, 2, next(seq), "arrive", r))
        heapq.heapify(events)
        rejected, accepted, rr = [], [], itertools.cycle(range(len(replicas)))
        choose: Callable[[], Replica] = (
            (lambda: min(replicas, key=lambda x: (x.scheduler.outstanding_work(), len(x.scheduler.requests))))
            if cfg.dispatch == "least_work"
            else (lambda: replicas[next(rr)])
        )
        started = time.perf_counter()
        now = 0.0
        bar = tqdm(
            total=len(requests),
            desc=f"simulate {cfg.scheduler.policy}",
            unit="req",
            disable=not progress,
            mininterval=0.5,
        )
        ready: dict[int, Replica] = {}  # replicas to offer a batch once every event at `now` is in

        def launch(rep: Replica) -> None:
            if rep.stage_free_at > now + 1e-12:
                return
            plan = rep.scheduler.schedule(now)
            if plan is None:
                return
            free_at, outcome = rep.execute(plan, now)
            heapq.heappush(events, (free_at, 1, next(seq), "stage_free", rep))
            heapq.heappush(events, (outcome.end_time, 0, next(seq), "complete", (rep, plan, outcome)))

        while events:
            now, _, _, kind, payload = heapq.heappop(events)
            if max_time is not None and now > max_time:
                break
            if kind == "arrive":
                rep = choose()
                try:
                    rep.scheduler.add(payload)
                except ValueError:
                    rejected.append(payload)
                    bar.update()
                    continue
                accepted.append(payload)
            elif kind == "stage_free":
                rep = payload
            else:
                rep, plan, outcome = payload
                bar.update(len(rep.scheduler.apply(plan, outcome)))
            ready[id(rep)] = rep
            if not events or events[0][0] > now:  # simultaneous arrivals share one batch
                for rep in ready.values():
                    launch(rep)
                ready.clear()
        bar.close()
        first = requests[0].arrival if requests else 0.0
        last = max((r.finished_at for r in accepted if r.finished_at is not None), default=first)
        return Results(
            accepted,
            rejected,
            span=max(last - first, 1e-9),
            wall_seconds=time.perf_counter() - started,
            config=dataclasses.asdict(cfg) | {"workload": name, "requests": len(requests)},
            long_threshold=cfg.long_threshold,
        )
