"""Engine bookkeeping under random workloads, with a checking fake step runner instead of the model (fast).

The fake runner keeps the cache's contents (slot -> token) and asserts, at every step, that each row's history
is exactly the tokens its request fed at those positions: a block shared by two requests, a slot computed
wrongly or a block freed while in use shows up there. Its "sampled" token depends only on (seed, counter),
like the real sampler, so every request's output is known in advance.
"""

from __future__ import annotations

import functools
import random
import types

import numpy as np
import pytest

from jaxserve.engine.batch import BadRow, Row
from jaxserve.engine.engine import Engine
from jaxserve.sampling_params import SamplingParams
from jaxserve.sched.batch_cost import EngineStepCost
from jaxserve.sched.kv_manager import KVCacheManager
from jaxserve.sched.packer import PackerConfig
from jaxserve.sched.policies import make_policy
from jaxserve.sched.scheduler import ReplicaScheduler
from jaxserve.sched.step_shapes import StepShapes

VOCAB = 40
EOS = 0


def fake_token(seed: int, counter: int) -> int:
    return (seed * 1_000_003 + counter * 7_919 + (seed ^ counter) * 31) % VOCAB


class FakeTokenizer:
    stop_ids = frozenset({EOS})

    def decode(self, ids, skip_special_tokens=True):
        return "".join("abcdefghijklmnopqrstuvwxyz0123456789.,;:"[t] for t in ids if t != EOS)


class CheckingRunner:
    """Stands in for ModelRunner. `expected[seed]` is a request's whole token sequence (prompt + output), known
    in advance: every row must read exactly that at every position it attends, whichever request wrote the block
    (a prefix-cache hit reads another request's blocks)."""

    def __init__(self, block_size: int):
        self.cfg = types.SimpleNamespace(vocab_size=VOCAB)
        self.block_size = block_size
        self.max_rows = 64  # sampling slots; these workloads' params take none
        self.cache: dict[int, int] = {}
        self.expected: dict[int, list[int]] = {}
        self.caches_lost = False
        self.previous = np.zeros(0, np.int64)  # the last step's sampled tokens

    def start(self, rows: list[Row], steps: int = 1, guided: bool = False) -> types.SimpleNamespace:
        """Run the step at once; its tokens as the engine reads them later. A row whose token was in flight
        (feed) takes it from the previous step's sampled tokens, as the device does. A burst (steps > 1) runs
        its steps one after another, each row until its share or a stop token, as the device's loop does."""
        bs = self.block_size
        fed = [[self.previous[r.feed]] if r.feed >= 0 else list(r.tokens) for r in rows]
        live = [r.steps > 0 and tokens[-1] not in r.stop_ids for r, tokens in zip(rows, fed)]
        out = np.zeros((steps, len(rows)), np.int64)
        for j in range(steps):
            for r, tokens, on in zip(rows, fed, live):
                for i, tok in enumerate(tokens if on else ()):
                    pos = r.start + j + i
                    assert self.expected[r.seed][pos] == tok, "a position was fed the wrong token"
                    self.cache[r.block_table[pos // bs] * bs + pos % bs] = tok
            for r, tokens, on in zip(rows, fed, live):  # after all writes: every row sees exactly its own history
                for pos in range(r.start + j + len(tokens) if on else 0):
                    assert self.cache[r.block_table[pos // bs] * bs + pos % bs] == self.expected[r.seed][pos]
            for n, r in enumerate(rows):
                out[j, n] = fake_token(r.seed, r.counter + j) if live[n] else out[j - 1, n]
                fed[n] = [out[j, n]]
                live[n] = live[n] and j + 1 < r.steps and out[j, n] not in r.stop_ids
        tokens, self.previous = (out if steps > 1 else out[0]), out[-1]
        return types.SimpleNamespace(value=lambda: tokens, logprobs_value=lambda: None)


def make_engine(
    runner,
    *,
    num_blocks: int,
    max_model_len: int,
    max_num_seqs: int = 4,
    step_tokens: int = 64,
    policy: str = "fcfs",
    enable_prefix_caching: bool = True,
    overlap: bool = True,
    num_scheduler_steps: int = 1,
) -> Engine:
    cost = EngineStepCost(
        StepShapes((16, 1 << 20), (4,), 32, 4, (1, 2, 4, 8)),
        256,
        [[0.01], [0.02]],
        [0.005] * 4,
        1e-7,
        1e-7,
        1e-7,
        1e-7,
        1e-7,
    )
    packer = PackerConfig(iteration_budget=1.0, chunk_align=min(8, step_tokens), max_num_batched_tokens=step_tokens)
    kv = KVCacheManager(num_blocks, runner.block_size, enable_prefix_caching=enable_prefix_caching)
    scheduler = ReplicaScheduler(
        make_policy(policy), cost, packer, kv, max_num_seqs=max_num_seqs, num_scheduler_steps=num_scheduler_steps
    )
    return Engine(runner, scheduler, FakeTokenizer(), max_model_len=max_model_len, overlap=overlap)


def expected_output(prompt: list[int], sp: SamplingParams, max_model_len: int) -> list[int]:
    out = []
    while True:
        tok = fake_token(sp.seed, len(out))
        out.append(tok)
        if tok == EOS or len(out) >= sp.max_tokens or len(prompt) + len(out) >= max_model_len:
            return out


@pytest.mark.parametrize("overlap, steps", [(True, 1), (False, 1), (True, 4), (False, 4)])
@pytest.mark.parametrize("trial", range(40))
def test_random_workload_keeps_every_invariant(trial, overlap, steps):
    """With the next step dispatched before the last one's tokens are read (overlap), or one step at a time;
    with multi-step decodes of up to `steps` steps or none."""
    random_workload(trial, overlap, steps)


def test_random_workloads_preempt_and_hit_the_prefix_cache():
    """The workloads above are not vacuous: memory pressure preempts, shared prefixes hit, bursts run and
    requests stop inside them."""
    engines = [random_workload(trial, True, 1) for trial in range(40)]
    assert sum(e.num_preemptions for e in engines) > 20
    assert sum(e.kv.stats.hit_tokens for e in engines) > 0.1 * sum(e.kv.stats.query_tokens for e in engines)
    bursting = [random_workload(trial, True, 4) for trial in range(40)]
    assert sum(e.bursts for e in bursting) > 100 and sum(e.stopped_mid_burst for e in bursting) >= 3
    assert sum(e.num_preemptions for e in bursting) > 20


@functools.cache
def random_workload(trial: int, overlap: bool, steps: int) -> Engine:
    """A workload's engine once it has run (every invariant checked on the way), run once per session: the
    test above and the one that reads the workloads' statistics share it."""
    return run_random_workload(trial, overlap, steps)


def run_random_workload(trial: int, overlap: bool, steps: int = 1) -> Engine:
    rng = random.Random(trial)
    bs = rng.choice([1, 2, 4, 16])
    max_model_len = rng.choice([16, 40, 100])
    capacity_tokens = max_model_len + rng.choice([0, 7, 60, 400])
    runner = CheckingRunner(bs)
    max_num_seqs = rng.choice([1, 3, 8])
    engine = make_engine(
        runner,
        num_blocks=-(-capacity_tokens // bs) + 1,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        step_tokens=rng.choice([8, 16, 64]) + max_num_seqs,
        policy=rng.choice(["fcfs", "lars", "edf", "sjf"]),
        enable_prefix_caching=rng.random() < 0.8,
        overlap=overlap,
        num_scheduler_steps=steps,
    )
    engine.bursts = engine.stopped_mid_burst = 0
    start = runner.start

    def counted(rows, steps=1, guided=False):  # bursts run, and rows that sample EOS in one
        engine.bursts += steps > 1
        pending = start(rows, steps, guided)
        engine.stopped_mid_burst += steps > 1 and sum(EOS in pending.value()[: r.steps, n] for n, r in enumerate(rows))
        return pending

    runner.start = counted
    kv = engine.kv
    free = kv.num_free
    # a few shared prefixes, so prefix-cache hits (and blocks shared between requests) happen
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, max_model_len))] for _ in range(3)]
    requests, aborted, finished, outputs = {}, set(), set(), {}
    arrivals = sorted(rng.randrange(60) for _ in range(rng.randrange(1, 14)))
    for step in range(5000):
        while arrivals and arrivals[0] <= step:
            arrivals.pop(0)
            prompt = rng.choice(prefixes)[: rng.randrange(0, max_model_len)]
            prompt = prompt + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, max_model_len))]
            prompt = prompt[: rng.randrange(1, max_model_len)]
            sp = SamplingParams(max_tokens=rng.randrange(1, 30), seed=len(requests) + 100 * trial)
            runner.expected[sp.seed] = prompt + expected_output(prompt, sp, max_model_len)
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
    assert kv.num_free == free and not engine.scheduler.requests
    return engine


def test_stop_string_held_back_then_released():
    """A tail that could start a stop string is held, then emitted once it turns out not to be one."""
    runner = CheckingRunner(4)
    engine = make_engine(runner, num_blocks=20, max_model_len=64)
    sp = SamplingParams(max_tokens=12, seed=5, ignore_eos=True)
    runner.expected[5] = [1, 2] + expected_output([1, 2], sp, 64)
    text = FakeTokenizer().decode(expected_output([1, 2], sp, 64))
    stop = text[3] + "#"  # starts like the output but never completes
    rid = engine.add_request([1, 2], SamplingParams(max_tokens=12, seed=5, ignore_eos=True, stop=(stop,)))
    deltas = []
    while engine.has_unfinished():
        deltas += [o.new_text for o in engine.step() if o.request_id == rid]
    assert "".join(deltas) == text
    assert deltas[3] == "" and len(deltas[4]) >= 2  # held at the 4th token, released at the 5th


def test_max_model_len_beyond_the_kv_cache_is_rejected():
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        make_engine(CheckingRunner(4), num_blocks=20, max_model_len=1000)


def _collect(engine, outputs: dict) -> None:
    for out in engine.step():
        outputs.setdefault(out.request_id, []).append(out)


def test_a_row_that_fails_in_a_step_planned_ahead_is_told_at_once():
    """A request whose row cannot be packed in the step dispatched ahead gets its error in that call's outputs,
    even when it was the last request (nothing would step the engine again to deliver it)."""
    runner = CheckingRunner(4)
    real = runner.start

    def start(rows, steps=1, guided=False):
        for i, r in enumerate(rows):
            if r.seed == 9:
                raise BadRow(i, ValueError("injected"))
        return real(rows, steps, guided)

    runner.start = start
    engine = make_engine(runner, num_blocks=20, max_model_len=64)
    sp = SamplingParams(max_tokens=3, seed=1, ignore_eos=True)
    runner.expected[1] = [1, 2] + expected_output([1, 2], sp, 64)
    outputs: dict = {}
    a = engine.add_request([1, 2], sp)
    _collect(engine, outputs)
    _collect(engine, outputs)  # a's second token; its third is in flight
    b = engine.add_request([3, 4], SamplingParams(max_tokens=3, seed=9))
    _collect(engine, outputs)  # reads a's last token, dispatches b's prefill ahead: b fails there
    assert not engine.has_unfinished()
    assert [t for o in outputs[a] for t in o.new_token_ids] == runner.expected[1][2:]
    assert outputs[b][-1].finish_reason == "error" and "injected" in outputs[b][-1].error


def test_a_cache_lost_while_a_step_is_in_flight_is_recomputed():
    """The cache is lost (a failed KV landing) while a step is in flight: that step is dropped, its requests
    recompute, and every output is still the expected one."""
    runner = CheckingRunner(4)
    engine = make_engine(runner, num_blocks=40, max_model_len=64)
    outputs: dict = {}
    rids = {}
    for seed in (1, 2):
        sp = SamplingParams(max_tokens=8, seed=seed, ignore_eos=True)
        runner.expected[seed] = [1, 2, seed] + expected_output([1, 2, seed], sp, 64)
        rids[engine.add_request([1, 2, seed], sp)] = seed
    for _ in range(3):
        _collect(engine, outputs)
    assert engine._pending is not None
    runner.caches_lost = True

    def recover():
        runner.cache.clear()
        runner.caches_lost = False

    runner.recover = recover
    while engine.has_unfinished():
        _collect(engine, outputs)
    for rid, seed in rids.items():
        assert [t for o in outputs[rid] for t in o.new_token_ids] == runner.expected[seed][3:]
    assert engine.kv.num_free == engine.kv.capacity
    while engine.has_work:  # a surplus step left in flight
        engine.step()
    assert engine.step() == [] and engine.last_predicted is None  # no Plan ran
