"""Engine bookkeeping under random workloads, with a checking fake step runner instead of the model (fast).

The fake runner keeps the cache's contents (slot -> token) and asserts, at every step, that each row's history
is exactly the tokens its request fed at those positions: a block shared by two requests, a slot computed
wrongly or a block freed while in use shows up there. Its "sampled" token depends only on (seed, counter),
like the real sampler, so every request's output is known in advance.
"""

from __future__ import annotations

import random
import types

import numpy as np
import pytest

from jaxserve.engine.engine import Engine
from jaxserve.engine.kv_cache import BlockPool
from jaxserve.engine.sampling import SamplingParams
from jaxserve.engine.steps import Row

VOCAB = 40
EOS = 0


def fake_token(seed: int, counter: int) -> int:
    return (seed * 1_000_003 + counter * 7_919 + (seed ^ counter) * 31) % VOCAB


class FakeTokenizer:
    stop_ids = frozenset({EOS})

    def decode(self, ids):
        return "".join("abcdefghijklmnopqrstuvwxyz0123456789.,;:"[t] for t in ids if t != EOS)


class CheckingRunner:
    def __init__(self, block_size: int):
        self.model = types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=VOCAB))
        self.block_size = block_size
        self.cache: dict[int, int] = {}
        self.fed: dict[int, dict[int, int]] = {}  # seed -> position -> token

    def step(self, rows: list[Row]) -> np.ndarray:
        bs = self.block_size
        for r in rows:
            fed = self.fed.setdefault(r.seed, {})
            for i, tok in enumerate(r.tokens):
                pos = r.start + i
                assert fed.get(pos, tok) == tok, "a position was fed two different tokens"
                fed[pos] = tok
                self.cache[r.block_table[pos // bs] * bs + pos % bs] = tok
        for r in rows:  # after all writes: every row still sees exactly its own history
            for pos in range(r.start + len(r.tokens)):
                assert self.cache[r.block_table[pos // bs] * bs + pos % bs] == self.fed[r.seed][pos]
        return np.array([fake_token(r.seed, r.counter) for r in rows])


def expected_output(prompt: list[int], sp: SamplingParams, max_model_len: int) -> list[int]:
    out = []
    while True:
        tok = fake_token(sp.seed, len(out))
        out.append(tok)
        if tok == EOS or len(out) >= sp.max_tokens or len(prompt) + len(out) >= max_model_len:
            return out


@pytest.mark.parametrize("trial", range(40))
def test_random_workload_keeps_every_invariant(trial):
    rng = random.Random(trial)
    bs = rng.choice([1, 2, 4, 16])
    max_model_len = rng.choice([16, 40, 100])
    capacity_tokens = max_model_len + rng.choice([0, 7, 60, 400])
    pool = BlockPool(-(-capacity_tokens // bs) + 1, bs)
    runner = CheckingRunner(bs)
    engine = Engine(runner, pool, FakeTokenizer(), max_model_len=max_model_len,
                    max_num_seqs=rng.choice([1, 3, 8]), prefill_chunk=rng.choice([1, 4, 8, 64]))
    free = pool.num_free
    requests, aborted, finished, outputs = {}, set(), set(), {}
    arrivals = sorted(rng.randrange(60) for _ in range(rng.randrange(1, 14)))
    for step in range(5000):
        while arrivals and arrivals[0] <= step:
            arrivals.pop(0)
            prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, max_model_len))]
            sp = SamplingParams(max_tokens=rng.randrange(1, 30), seed=len(requests) + 100 * trial)
            rid = engine.add_request(prompt, sp)
            requests[rid] = (prompt, sp)
            outputs[rid] = []
        if requests and rng.random() < 0.03:  # a client goes away
            rid = rng.choice(list(requests))
            if rid not in finished and engine.abort(rid):
                aborted.add(rid)
        for out in engine.step():
            assert out.request_id not in finished and out.request_id not in aborted
            outputs[out.request_id].append(out)
            if out.finished:
                finished.add(out.request_id)
        if not arrivals and not engine.has_unfinished():
            break
    else:
        pytest.fail("the engine did not finish the workload (hang)")
    assert finished | aborted == set(requests) and not finished & aborted
    for rid in finished:
        prompt, sp = requests[rid]
        tokens = [t for o in outputs[rid] for t in o.new_token_ids]
        assert tokens == expected_output(prompt, sp, max_model_len)
        assert "".join(o.new_text for o in outputs[rid]) == FakeTokenizer().decode(tokens)
    assert pool.num_free == free


def test_stop_string_held_back_then_released():
    """A tail that could start a stop string is held, then emitted once it turns out not to be one."""
    runner = CheckingRunner(4)
    engine = Engine(runner, BlockPool(20, 4), FakeTokenizer(), max_model_len=64)
    sp = SamplingParams(max_tokens=12, seed=5, ignore_eos=True)
    text = FakeTokenizer().decode(expected_output([1, 2], sp, 64))
    stop = text[3] + "#"  # starts like the output but never completes
    rid = engine.add_request([1, 2], SamplingParams(max_tokens=12, seed=5, ignore_eos=True, stop=(stop,)))
    deltas = []
    while engine.has_unfinished():
        deltas += [o.new_text for o in engine.step() if o.request_id == rid]
    assert "".join(deltas) == text
    assert deltas[3] == "" and len(deltas[4]) >= 2  # held at the 4th token, released at the 5th


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(prefill_chunk=3), "prefill_chunk"),
    (dict(max_model_len=1000), "exceeds the KV cache"),
])
def test_bad_engine_settings_are_rejected(kwargs, message):
    args = dict(max_model_len=32, max_num_seqs=4, prefill_chunk=8) | kwargs
    with pytest.raises(ValueError, match=message):
        Engine(CheckingRunner(4), BlockPool(20, 4), FakeTokenizer(), **args)
