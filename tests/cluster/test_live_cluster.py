"""The live cluster against the single-device engine: a ~3K-token prompt chunked over prefill groups of 2 -> 4 ->
8 devices, its KV streamed chunk by chunk to a decode instance on other devices, gives the same greedy tokens;
nothing compiles after warm-up; and the receive-buffer handshake orders transfers and decode starts."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import busy, make_cluster, run
from jaxserve.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=24)


def prompt(llm, n: int, seed: int) -> list[int]:
    """n tokens of real text (the tokenizer's encoding of varied English), so greedy decoding is not degenerate."""
    words = "the of and to in is was for on that with as by at from his her it an were are which this be".split()
    rng = np.random.default_rng(seed)
    ids = llm.tokenizer.encode(" ".join(rng.choice(words, 2 * n)))
    return ids[:n]


@pytest.fixture(scope="module")
def cluster(llm, devices):
    return make_cluster(llm, devices, decode_instances=2)


def test_prefill_over_growing_groups_then_decode_elsewhere_equals_one_device(llm, cluster):
    ids = prompt(llm, 3000, 0)
    (want,) = [c.token_ids for c in llm.generate([ids], GREEDY)]
    busy(cluster, {2: 0.2, 3: 0.2} | {i: 0.3 for i in range(4, 8)})
    (got,) = run(cluster, [(ids, GREEDY)])
    rid = next(reversed(cluster.plans))
    sizes = [len(r.group) for r in cluster.records if r.request_id == rid]
    assert sizes == [2, 4, 8]
    assert got == want
    # the history was rebalanced before each larger group; the transfers came chunk by chunk
    assert len([t for _, t in cluster.transfers if t.request_id == rid]) == 3


def test_no_compilation_after_warmup_across_twenty_requests(llm, cluster):
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration"
        else None)
    rng = np.random.default_rng(1)
    requests = [(prompt(llm, int(n), i), SamplingParams(max_tokens=4))
                for i, n in enumerate(rng.integers(100, 3000, 20))]
    for k, (ids, params) in enumerate(requests):  # varied queues: every group size gets chunks
        busy(cluster, {i: float(rng.uniform(0, 0.4)) for i in range(8)})
        run(cluster, [(ids, params)])
    assert compiles == []
    assert {len(r.group) for r in cluster.records} == {2, 4, 8}
