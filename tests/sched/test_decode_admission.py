"""A decode instance's admission of requests prefilled elsewhere (ReplicaScheduler.reserve; TetriInfer 3.4): greedy
preempts and recomputes when memory runs out, reserving avoids it, reserve-dynamic admits earlier than
reserve-static; the same scheduler the live decode instances and the simulated ones run."""

from __future__ import annotations


import numpy as np
import pytest

from jaxserve.config import DECODE_ADMISSION, SchedulerConfig
from jaxserve.sched.batch_cost import TetrisBatchCost
from jaxserve.sched.build import packer_config, replica_scheduler
from jaxserve.sched.cost_models import TetrisPrefill
from jaxserve.sched.kv_manager import KVCacheManager
from jaxserve.sched.plan import Outcome
from jaxserve.sched.request import Request
from jaxserve.sched.scheduler import ReplicaScheduler

COST = TetrisBatchCost(TetrisPrefill({1: np.array([0.004, 6.5e-5, 1.0e-9, 1.2e-9])}))


def decode_instance(tokens: int, admission: str) -> ReplicaScheduler:
    config = SchedulerConfig(policy="fcfs", max_num_seqs=64)  # the default budget: a full step
    kv = KVCacheManager.for_tokens(tokens, 16, enable_prefix_caching=False)
    return replica_scheduler(config, COST, kv, packer_config(config, COST, max_model_len=tokens), admission=admission)


def prefilled(rid: str, prompt: int, output: int) -> Request:
    r = Request(rid, 0.0, prompt, output)
    r.add_tokens(1, 0.0)  # the prefill's first token
    return r


def drive(
    sched: ReplicaScheduler, requests: list[Request], predicted: dict[str, int | None], steps: int = 10_000
) -> int:
    """An executor of a decode instance: requests land in arrival order once reserve admits them, then every Plan
    runs. Returns the preemptions."""
    waiting, preempted, now = list(requests), 0, 0.0
    for _ in range(steps):
        while waiting and sched.reserve(waiting[0], predicted[waiting[0].id]) is not None:
            sched.add_prefilled(waiting.pop(0))
        plan = sched.schedule(now)
        if plan is None:
            assert not waiting, "nothing runs, yet requests wait"
            return preempted
        assert sched.kv.num_free >= 0
        preempted += len(plan.preempted)
        now += 0.01
        sched.apply(plan, Outcome(now, (), {i.request_id: (0,) for i in plan.items if sched.yields_token(i)}))
    raise AssertionError("did not drain")


@pytest.mark.parametrize("admission", DECODE_ADMISSION)
def test_every_admission_policy_drains_within_memory(admission):
    sched = decode_instance(3000, admission)
    reqs = [prefilled(str(i), 400, 50 + 40 * i) for i in range(12)]
    drive(sched, reqs, {r.id: r.output_len // 2 for r in reqs})  # predictions too short: preemptions recompute
    assert all(r.finished and r.generated == r.output_len for r in reqs)
    assert not sched.running and not sched.requests


def test_greedy_preempts_when_memory_runs_out_and_reserving_avoids_it():
    def preemptions(admission: str, predicted: int | None) -> int:
        reqs = [prefilled(str(i), 300, 300) for i in range(6)]
        return drive(decode_instance(2000, admission), reqs, {r.id: predicted for r in reqs})

    assert preemptions("greedy", None) > 0
    assert preemptions("reserve_static", 300) == 0 and preemptions("reserve_static", None) == 0  # None: max_tokens
    assert preemptions("reserve_dynamic", 300) == 0


def test_reserve_dynamic_admits_earlier_than_static():
    def admitted(admission: str) -> set[str]:
        sched = decode_instance(2000, admission)
        for r, predicted in (
            (prefilled("a", 600, 400), 400),
            (prefilled("b", 600, 20), 20),
            (prefilled("c", 600, 100), 100),
        ):
            if sched.reserve(r, predicted) is not None:
                sched.add_prefilled(r)
        return set(sched.running)

    assert admitted("reserve_static") == {"a", "b"}  # 1000 + 620 reserved; c's 700 does not fit
    assert admitted("reserve_dynamic") == {"a", "b", "c"}  # in the ~19 steps until b ends, all three fit
    assert admitted("greedy") == {"a", "b", "c"}  # its prompt's blocks are free


def test_bad_requests_and_policies_are_refused():
    sched = decode_instance(1000, "reserve_static")
    with pytest.raises(ValueError, match="needs 1099 KV tokens"):
        sched.reserve(prefilled("y", 1000, 100))
    with pytest.raises(ValueError, match="admission must be"):
        decode_instance(100, "lazy")
