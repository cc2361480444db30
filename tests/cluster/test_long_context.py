"""A CDSP prefill pool whose history stores are sized by each device's KV budget, not by the context: a prompt
longer than a store holds spreads over its chunks' groups (each chunk's group holding the history evenly), and
its KV lands spread over a KV-parallel decode instance's sets; what no group could hold is refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest

import jaxserve
from conftest import eq1_model
from jaxserve.sched.cdsp import MeasuredBalancing
from jaxserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12)
PER_DEVICE = 1536  # tokens a device's KV budget holds: a store, and a decode set
PROMPT = 5000  # more than two stores, less than four (and than the decode instance's four sets)


def test_a_prompt_past_one_store_prefills_over_the_pool_and_decodes_over_the_sets(devices, tmp_path):
    """4 pool instances of 1,536 rows each and a decode instance of 4 sets of 1,536 tokens: max_model_len is
    6,144 (both hold that), and a 5,000-token prompt, which no group holds as one chunk (its bucket on 4 instances
    is 2,048 rows), runs as chunks that fill the stores (the history evened out before the second), never more
    rows a device than its store; its KV lands on all four decode sets, and the tokens are one device's. The history's
    move onto the larger group is measured and priced."""
    path = tmp_path / "eq1.json"
    eq1 = eq1_model()
    path.write_text(type(eq1)({s: c for s, c in eq1.coefficients.items() if s <= 4}).to_json())
    llm = jaxserve.LLM(
        "random:tiny-1m",
        prefill_instances=4,
        node_size=2,
        decode_instances=1,
        decode_kvp=4,
        kv_cache_tokens=PER_DEVICE,
        max_model_len=8192,
        min_chunk=256,
        max_num_batched_tokens=256,
        prefill_profile=str(path),
        quick_start=False,
        progress=False,
    )  # the moves measured now
    cluster = llm.engine
    assert llm.max_model_len == 4 * PER_DEVICE and cluster.prefill.cap == PER_DEVICE
    # the history's move onto a larger group was timed on this pool and is priced ahead of the chunk (kept beside
    # Eq. (1), read back as measured)
    moves = cluster.planner.balancing
    assert isinstance(moves, MeasuredBalancing) and not moves.hidden and moves.per_node == 2
    assert moves.move(2, 4, 3000, False) > 0 and moves.move(4, 4, 3000, False) == 0
    assert MeasuredBalancing(**json.loads((tmp_path / "eq1-moves.json").read_text())) == moves
    assert {s.k.shape[1] for s in cluster.prefill.stores.values()} == {PER_DEVICE}  # not the context's
    ids = np.random.default_rng(1).integers(10, 512, PROMPT).tolist()
    one = jaxserve.LLM("random:tiny-1m", kv_cache_tokens=8192, max_model_len=8192, progress=False)
    want = one.generate([ids], GREEDY)[0].token_ids
    fills = []
    run = cluster.prefill.run_chunk

    def watched(request_id, group, *args):  # each store's rows as each chunk starts and as it was written
        out = run(request_id, group, *args)
        fills.append([cluster.prefill.stores[i].fill for i in group])
        return out

    cluster.prefill.run_chunk = watched
    rid = cluster.add_request(ids, GREEDY)
    tokens, table = [], None
    while cluster.has_unfinished():
        for out in cluster.step():
            tokens += out.new_token_ids
            if out.new_token_ids and table is None:
                table = cluster.decoders[0].engine.kv.block_table(rid)
    assert tokens == want
    assert cluster.events["chunks"] == len(fills) >= 2 and cluster.events["rebalances"] == len(fills) - 1
    assert max(max(f) for f in fills) <= PER_DEVICE and sum(fills[-1]) == PROMPT, fills
    per_set = np.bincount([b % 4 for b in table], minlength=4) * cluster.decoders[0].engine.kv.block_size
    assert per_set.min() > 0 and per_set.max() <= PER_DEVICE and per_set.sum() >= PROMPT, per_set
    with pytest.raises(ValueError, match="context holds 6144"):
        cluster.add_request([1] * 6200, GREEDY)
