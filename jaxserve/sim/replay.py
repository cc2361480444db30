"""A live cluster run replayed in the simulator with the costs that run measured: the same arrivals, prompt and
output lengths, the same policy, layout and schedulers, and every executor cost taken from the live devices.

- cdsp: sim/disagg.py's prefill pool, planned by a CDSPPlanner on the pool's measured Eq. (1).
- csps: sim/disagg.py's prefill pool, planned by CSPS's planner on the pool's measured Eq. (1) (its stores
  assumed to hold every partition, as they do when `partition_tokens` fits a store).
- tetriinfer: sim/disagg.py's TetriInfer prefill instances, each chunk priced by Eq. (1) at SP 1, measured on one
  live instance; the ClusterPlans are TetriInferPolicy's on both sides, so a burst's chunks and dispatches match
  (tests/cluster/test_tetriinfer.py).
- esp: sim/disagg.py's elastic instances, as cluster/esp.py serves requests that fit one instance (aligned
  groups, each prompt's KV gathered on one instance, which decodes it with the live ReplicaScheduler), batches
  priced by the LoongServe model measured on the pool; the ClusterPlans are ESPPolicy's on both sides, reading the
  pool alike (promised KV included), so batches, groups and decode instances match (tests/cluster/test_esp.py). A
  run with multi-master decodes is not replayed: the live group's step is not measured apart.
- Everywhere: decode steps by the engine's measured step cost (EngineStepCost), KV moves by a line fitted to the
  live run's transfers, decode-length prediction by the live cluster's predictor (ObservedLengths).

tools/bench/cluster.py records a LiveRun and sets its replay beside it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Mapping, Sequence

import numpy as np

from jaxserve.sched.batch_cost import EngineStepCost, TetrisBatchCost
from jaxserve.sched.cdsp import CDSPPlanner, MeasuredBalancing, Pool
from jaxserve.sched.cost_models import LoongServePrefill, TetrisPrefill
from jaxserve.sched.csps import CSPSPlanner, MeasuredCSPS
from jaxserve.sched.decode_dispatch import ObservedLengths
from jaxserve.sched.esp import ESPScheduler, aligned_groups
from jaxserve.sched.improvement_rate import AdaptiveCDSP, RateTable
from jaxserve.sim.disagg import Costs, DisaggConfig, DisaggSimulator
from jaxserve.sim.metrics import Results
from jaxserve.sim.workload import Workload

POLICIES = ("cdsp", "csps", "esp", "tetriinfer")


@dataclasses.dataclass(frozen=True)
class Line:
    """seconds = fixed + per_token * tokens, fitted to measured (tokens, seconds)."""

    fixed: float
    per_token: float

    @classmethod
    def fit(cls, tokens: Sequence[int], seconds: Sequence[float]) -> Line:
        if not len(tokens):
            return cls(0.0, 0.0)
        x, y = np.asarray(tokens, np.float64), np.asarray(seconds, np.float64)
        if np.ptp(x) == 0:  # one size only: no slope to see
            return cls(float(y.mean()), 0.0)
        per_token, fixed = np.polyfit(x, y, 1)
        return cls(max(float(fixed), 0.0), max(float(per_token), 0.0))

    def __call__(self, tokens: float) -> float:
        return self.fixed + self.per_token * tokens if tokens else 0.0


@dataclasses.dataclass(frozen=True)
class LiveRun:
    """What a live run was and what it measured (JSON: `to_dict` / `from_dict`)."""

    policy: str  # cdsp, csps, esp or tetriinfer
    prefill_instances: int
    decode_instances: int  # 0 under esp: the pool's instances decode
    node_size: int
    trace: list[tuple[float, int, int]]  # (arrival seconds from the first, prompt tokens, output tokens)
    prefill_model: dict  # cdsp, csps: Eq. (1) on the pool; tetriinfer: Eq. (1) at SP 1; esp: LoongServe's batch model
    step_cost: dict  # the decode engine's EngineStepCost
    transfer: Line  # one KV transfer (or gather) of a request's tokens
    kv_tokens: int  # KV one decode instance holds
    max_num_seqs: int  # sequences one decode step runs
    max_model_len: int
    # cdsp: improvement_rate, sizes, min_chunk, the improvement_rates table (RateTable's fields) if one was used, and
    # the measured cache balancing (MeasuredBalancing's fields) if it had one; csps: partition_tokens, sizes
    planner: dict = dataclasses.field(default_factory=dict)
    prefill_chunk: int = 512  # tetriinfer
    prefill_batch: int = 16
    prefill_order: str = "sjf"

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> LiveRun:
        return cls(**{**d, "trace": [tuple(t) for t in d["trace"]], "transfer": Line(**d["transfer"])})

    def workload(self) -> Workload:
        arrival, prompt, output = (np.array(col) for col in zip(*self.trace))
        return Workload(arrival.astype(np.float64), prompt.astype(np.int64), output.astype(np.int64), "live trace")


def replay(run: LiveRun, progress: bool = False) -> Results:
    """The run's trace through the simulator of its policy, with its measured costs."""
    step = EngineStepCost.from_dict(run.step_cost)
    workload = run.workload()
    costs = Costs(
        decode=step,
        prefill=None,
        transfer=lambda tokens, senders: run.transfer(tokens),
        decode_kv_capacity=run.kv_tokens,
        max_num_seqs=run.max_num_seqs,
    )
    if run.policy == "esp":  # as cluster/build.py makes it
        model = LoongServePrefill.from_json(json.dumps(run.prefill_model))
        elastic = ESPScheduler(
            model,
            1,
            ESPScheduler.served_knee(model, 1, run.max_model_len),
            None,
            0.0,
            groups=aligned_groups(run.prefill_instances),
        )
        costs = dataclasses.replace(costs, batch=lambda lengths, sp: model.predict(sp, 1, lengths))
        cfg = DisaggConfig(prefill="esp", prefill_instances=run.prefill_instances, decode_tp=1, admission="greedy")
        best = lambda tokens: min(model.predict(sp, 1, [tokens]) for sp, _ in model.coefficients)  # noqa: E731
        return DisaggSimulator(elastic, best, cfg, ObservedLengths(), costs).run(workload, progress)
    eq1 = TetrisPrefill.from_json(json.dumps(run.prefill_model))
    if run.policy == "tetriinfer":
        costs = dataclasses.replace(costs, prefill=TetrisBatchCost(eq1, 1))
        cfg = DisaggConfig(
            prefill="tetriinfer",
            prefill_instances=run.prefill_instances,
            prefill_chunk=run.prefill_chunk,
            prefill_batch=run.prefill_batch,
            prefill_order=run.prefill_order,
            decode_instances=run.decode_instances,
            decode_tp=1,
            dispatch="power_of_two",
            admission="greedy",
        )  # the live decode instances' admission
        sim = DisaggSimulator(None, eq1.fastest, cfg, ObservedLengths(), costs)
    elif run.policy == "csps":
        pool = Pool(run.prefill_instances // run.node_size, run.node_size)
        planner = CSPSPlanner(MeasuredCSPS(eq1), pool, run.planner["partition_tokens"], run.planner["sizes"])
        cfg = DisaggConfig(
            prefill_instances=run.prefill_instances,
            decode_instances=run.decode_instances,
            decode_tp=1,
            admission="greedy",
        )
        sim = DisaggSimulator(planner, planner.fastest, cfg, ObservedLengths(), costs)
    else:
        pool = Pool(run.prefill_instances // run.node_size, run.node_size)
        moves = run.planner.get("balancing")  # the live pool's measured move, if it had one
        planner = CDSPPlanner(
            eq1,
            pool,
            run.planner["improvement_rate"],
            sizes=run.planner["sizes"],
            min_chunk=run.planner["min_chunk"],
            balancing=MeasuredBalancing(**moves) if moves is not None else None,
        )
        if "improvement_rates" in run.planner:  # --improvement_rates: the load picks the rate, as live
            planner = AdaptiveCDSP(planner, RateTable(**run.planner["improvement_rates"]))
        cfg = DisaggConfig(
            prefill_instances=run.prefill_instances,
            decode_instances=run.decode_instances,
            decode_tp=1,
            admission="greedy",
        )
        sim = DisaggSimulator(planner, eq1.fastest, cfg, ObservedLengths(), costs)
    return sim.run(workload, progress)
