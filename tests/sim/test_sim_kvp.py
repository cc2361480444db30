"""Medha's KV-cache parallelism in the cost model and the simulator: a long sequence's KV spread over worker
groups that join as it grows, attention over the largest share, one inter-node merge per layer per batch."""

from __future__ import annotations

import pytest

from jaxserve.sched.profiles import ProfileBatchCost, network
from jaxserve.sched.request import Request
from jaxserve.config import SimConfig
from jaxserve.sim.run import config_for
from jaxserve.sim.simulator import Simulator, replica_kv_capacity

K = 1 << 10


def test_a_sequence_one_worker_holds_costs_what_it_costs_without_kvp():
    plain, kvp = (
        ProfileBatchCost("a100_llama3_8b", tp=8),
        ProfileBatchCost("a100_llama3_8b", tp=8, kvp=4, kvp_tokens=256 * K),
    )
    assert kvp.workers(200 * K) == 1
    assert kvp.batch_time([(4 * K, 100 * K)], [200 * K, 3 * K]) == plain.batch_time(
        [(4 * K, 100 * K)], [200 * K, 3 * K]
    )


def test_without_kvp_the_cost_model_needs_no_kv_capacity():
    """A stage of a model whose weights one group cannot hold (Llama-2-70B on one H100) is still priced: the
    default KVP share, what a group's memory holds, is only asked for when there is KV parallelism."""
    assert ProfileBatchCost("h100_llama2_70b", tp=1).batch_time([(1024, 0)], [4096]) > 0
    with pytest.raises(ValueError, match="does not fit"):
        ProfileBatchCost("h100_llama2_70b", tp=1, kvp=2)


def test_a_split_decode_costs_its_largest_share_plus_one_merge_per_layer():
    plain = ProfileBatchCost("a100_llama3_8b", tp=8)
    kvp = ProfileBatchCost("a100_llama3_8b", tp=8, kvp=4, kvp_tokens=256 * K)
    assert kvp.workers(600 * K) == 3  # progressive: two full workers, the third holds the rest
    merge = kvp.layers * network("a100").predict("inter_node", kvp._exchange_bytes)
    assert kvp.batch_time([], [600 * K]) == pytest.approx(plain.batch_time([], [256 * K]) + merge, rel=1e-12)
    # every worker has joined: the last one takes what is left
    assert kvp.batch_time([], [1200 * K]) == pytest.approx(plain.batch_time([], [432 * K]) + merge, rel=1e-12)


def test_the_merge_is_one_message_per_layer_for_the_whole_batch():
    kvp = ProfileBatchCost("a100_llama3_8b", tp=8, kvp=2, kvp_tokens=256 * K)
    one = kvp.batch_time([], [300 * K]) - kvp.batch_time([], [256 * K])
    two = kvp.batch_time([], [300 * K, 300 * K]) - kvp.batch_time([], [256 * K, 256 * K])
    assert 0 < two < 2 * one  # the per-message latency is paid once per layer, not once per row


def test_a_chunk_costs_its_busiest_worker():
    plain = ProfileBatchCost("a100_llama3_8b", tp=8)
    kvp = ProfileBatchCost("a100_llama3_8b", tp=8, kvp=2, kvp_tokens=256 * K)
    n = 8 * K
    # history 400K: the first worker's full 256K outweigh the newest one's 144K + the chunk
    assert kvp.prefill_attention(n, 400 * K) == pytest.approx(plain.prefill_attention(n, 256 * K - (n + 1) / 2))
    # history 700K, both workers joined: the newest holds 444K of history and the chunk
    assert kvp.prefill_attention(n, 700 * K) == plain.prefill_attention(n, 444 * K)


def _long_decode(kvp: int, kvp_tokens: int | None = None):
    cfg = config_for(
        profile="h100_llama2_70b",
        tp=8,
        kvp=kvp,
        kvp_tokens=kvp_tokens,
        iteration_budget=0.2,
        long_threshold=1 << 30,
        space_sharing=False,
    )
    r = Request("long", 0.0, prompt_len=1_500_000, output_len=32)
    return Simulator(cfg).run_requests([r], progress=False)


def test_a_prompt_one_node_cannot_hold_runs_on_two_kvp_workers_and_decodes_faster_than_one_could():
    """Llama-2-70B on one TP8 H100 node holds ~1.3M KV tokens: a 1.5M-token prompt is refused there, and served
    with two KVP workers; spreading its KV further (four workers of 400K) cuts the time per output token."""
    assert replica_kv_capacity(SimConfig(profile="h100_llama2_70b", tp=8)) < 1_500_000
    alone = _long_decode(kvp=1)
    assert alone.rejected and not alone.requests
    two, four = _long_decode(kvp=2), _long_decode(kvp=4, kvp_tokens=400_000)
    assert not two.rejected and two.requests[0].finished
    tpot2, tpot4 = (res.summary()["all"]["tpot_p50"] for res in (two, four))
    assert tpot4 < 0.8 * tpot2
