"""The disaggregated cluster: CDSP prefill pool, chunk-wise KV transfer through scarce receive backends, decode
instances dispatched by freeness with virtual usage, decoding on the real ReplicaScheduler."""

from __future__ import annotations

import pytest

from jaxserve.sched import cost_models as cm
from jaxserve.sched.cdsp import CDSPPlanner, Pool
from jaxserve.sched.request import Request
from jaxserve.sim.disagg import DisaggConfig, DisaggSimulator
from jaxserve.sim.workload import long_context

from test_sched_cost_models import table1_samples

MODEL = cm.TetrisPrefill.fit(table1_samples())
POOL = Pool(nodes=2, per_node=8)


def best(tokens):
    return min(MODEL.predict(sp, tokens) for sp in MODEL.coefficients)


def run(config=DisaggConfig(), n=120, rate=1.0):
    return DisaggSimulator(CDSPPlanner(MODEL, POOL, 0.2), best, config).run(
        long_context("medium", n, rate, seed=0), progress=False)


def test_every_request_prefills_transfers_and_decodes():
    res = run()
    assert len(res.requests) == 120 and not res.rejected
    for r in res.requests:
        assert r.finished and r.generated == r.output_len
        # the first decode token comes after the prefill's first token plus at least one KV transfer
        assert r.token_gaps[0] > 0
    s = res.summary()["all"]
    assert s["tbt_p50"] < 0.05  # TP-4 decode of an 8B model: milliseconds per token


def test_dispatch_spreads_requests_over_decode_instances():
    sim = DisaggSimulator(CDSPPlanner(MODEL, POOL, 0.2), best, DisaggConfig(decode_instances=4))
    res = sim.run(long_context("short", 200, 2.0, seed=1), progress=False)
    served = [len(d.scheduler.finished) for d in sim.decoders]
    assert sum(served) == sum(r.output_len > 1 for r in res.requests)
    assert min(served) > 0.15 * sum(served)  # freeness keeps every instance in use


def test_scarce_receive_backends_delay_decoding_but_lose_nothing():
    plenty = run(DisaggConfig(recv_backends=8), n=80, rate=3.0)
    scarce = run(DisaggConfig(recv_backends=1), n=80, rate=3.0)
    assert all(r.finished for r in scarce.requests)
    first_gap = lambda res: sum(r.token_gaps[0] for r in res.requests)  # noqa: E731
    assert first_gap(scarce) > first_gap(plenty)


def test_add_prefilled_checks_memory_and_state():
    from jaxserve.sched.policies import make_policy
    from jaxserve.sched.packer import PackerConfig
    from jaxserve.sched.profiles import ProfileBatchCost
    from jaxserve.sched.scheduler import ReplicaScheduler

    sched = ReplicaScheduler(make_policy("fcfs"), ProfileBatchCost(tp=4), PackerConfig(t_target=0.05), 1000)
    r = Request("a", 0.0, 500, 10)
    with pytest.raises(ValueError, match="first token"):
        sched.add_prefilled(r)
    r.add_tokens(1, 0.5)
    sched.add_prefilled(r)
    assert r.prefilled == 500 and "a" in sched.decoding and sched.kv_reserved == 510
    big = Request("b", 0.0, 600, 10)
    big.add_tokens(1, 0.5)
    with pytest.raises(ValueError, match="are free"):
        sched.add_prefilled(big)
