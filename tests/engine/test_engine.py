"""Paged KV cache, chunked prefill, continuous batching, preemption, prefix caching, sampling and stopping on the
real model, driven by the scheduler's Plans."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc

import jax
import numpy as np
import pytest

import jaxserve
from jaxserve import SamplingParams
from jaxserve.engine.interface import ServingEngine
from jaxserve.sched.request import Request as SchedRequest

PROMPTS = [
    "The capital of France is",
    "Write a short poem about autumn leaves falling on a quiet street.",
    "List three prime numbers:",
    "Explain photosynthesis in one sentence. Be precise and use simple words for a child of ten years old.",
    "def fibonacci(n):",
    "Translate to French: good morning",
    "Q: What is 12 times 11?\nA:",
    "Once upon a time",
]

MIXED = [
    SamplingParams(max_tokens=12),
    SamplingParams(max_tokens=20, ignore_eos=True),
    SamplingParams(max_tokens=7, temperature=0.8, seed=3, presence_penalty=1.5, logprobs=3),
    SamplingParams(max_tokens=16, temperature=1.0, top_k=20, seed=11, frequency_penalty=0.8, min_p=0.05),
    SamplingParams(max_tokens=18, temperature=0.7, top_p=0.9, seed=5, logprobs=0),
    SamplingParams(max_tokens=5, repetition_penalty=1.3, logit_bias={13: 5.0, 28: -100.0}, min_tokens=4),
    SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.2, top_k=50, top_p=0.95, seed=99),
    SamplingParams(max_tokens=10, stop=("\n",), repetition_penalty=1.2, logprobs=5),
]  # penalties, min_p, logit_bias, min_tokens and logprobs among them: their slots and outputs are checked alike


def assert_same_logprobs(got, want) -> None:
    """Equal tokens, logprobs equal to float32 rounding (batch shapes change the sums' order): log-softmax values
    of magnitude up to ~30 (SmolLM2's logits), a few ulps of that."""
    assert (got is None) == (want is None)
    if want is None:
        return
    assert [x.token for x in got] == [x.token for x in want]
    assert [[t for t, _ in x.top] for x in got] == [[t for t, _ in x.top] for x in want]
    flat = lambda lps: np.array([[x.logprob, *(v for _, v in x.top)] for x in lps])  # noqa: E731
    np.testing.assert_allclose(flat(got), flat(want), rtol=0, atol=64 * np.finfo(np.float32).eps * 30)


@contextlib.contextmanager
def step_tokens(llm, tokens: int, enable_prefix_caching: bool = True):
    """At most `tokens` tokens per step (prefill chunks of a few tokens), optionally without prefix caching."""
    sched = llm.engine.scheduler
    packer, caching = sched.packer, sched.kv.enable_prefix_caching
    sched.packer = dataclasses.replace(
        packer, max_num_batched_tokens=tokens, chunk_align=min(tokens, packer.chunk_align)
    )
    sched.kv.enable_prefix_caching = enable_prefix_caching
    try:
        yield
    finally:
        sched.packer, sched.kv.enable_prefix_caching = packer, caching


@contextlib.contextmanager
def bursts(llm, steps: int):
    """Plan multi-step decodes of up to `steps` steps (the runner has programs for up to 8)."""
    sched = llm.engine.scheduler
    before, sched.num_scheduler_steps = sched.num_scheduler_steps, steps
    try:
        yield
    finally:
        sched.num_scheduler_steps = before


@pytest.fixture(scope="module")
def one_at_a_time(llm):
    with step_tokens(llm, 512, enable_prefix_caching=False):
        return [llm.generate(p, sp)[0] for p, sp in zip(PROMPTS, MIXED)]


@pytest.mark.parametrize("chunk, enable_prefix_caching", [(24, False), (32, True), (512, True)])
def test_batched_chunked_equals_one_at_a_time(llm, one_at_a_time, chunk, enable_prefix_caching):
    """Several prompts' chunks per step, decodes beside them, prefix hits (the prompts ran before): greedy and
    seeded outputs are those of each request alone."""
    free_before = llm.engine.kv.num_free
    with step_tokens(llm, chunk, enable_prefix_caching):
        if enable_prefix_caching:  # cache the prompts' full blocks, so the batched run starts from hits
            llm.generate(PROMPTS[3])
        hits = llm.engine.kv.stats.hit_tokens
        batched = llm.generate(PROMPTS, MIXED)
    for ref, got in zip(one_at_a_time, batched):
        assert got.token_ids == ref.token_ids, got.prompt
        assert got.text == ref.text and got.finish_reason == ref.finish_reason
        assert_same_logprobs(got.logprobs, ref.logprobs)
    assert llm.engine.kv.num_free == free_before
    assert (llm.engine.kv.stats.hit_tokens > hits) == enable_prefix_caching


def test_the_engine_is_the_serving_interface_the_front_ends_drive(llm):
    assert isinstance(llm.engine, ServingEngine)


def test_requests_join_and_leave_between_steps(llm, one_at_a_time):
    """Requests arrive while others decode; every output is still the one-at-a-time output."""
    engine = llm.engine
    ids = {}
    tokens: dict[str, list[int]] = {}
    pending = list(range(len(PROMPTS)))
    steps = 0
    with step_tokens(llm, 24):
        while pending or engine.has_unfinished():
            if pending and steps % 3 == 0:  # one new arrival every third step
                i = pending.pop(0)
                ids[engine.add_request(llm.tokenizer.encode(PROMPTS[i]), MIXED[i])] = i
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            steps += 1
    for rid, i in ids.items():
        assert tokens[rid] == one_at_a_time[i].token_ids


def test_preemption_under_memory_pressure_keeps_outputs():
    """A KV pool far smaller than the batch needs: requests are preempted, recomputed, and outputs unchanged;
    also with multi-step decodes between the preemptions (a burst never preempts: it runs when the blocks are
    free)."""
    small = jaxserve.LLM(
        max_model_len=96,
        kv_cache_tokens=160,
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        num_scheduler_steps=4,
    )
    params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=t, seed=7) for t in (0.0, 0.9, 0.0, 0.9)]
    # two that read their history from a slot set again after each preemption
    params[2] = dataclasses.replace(params[2], repetition_penalty=1.4, frequency_penalty=0.5)
    params[3] = dataclasses.replace(params[3], presence_penalty=1.0, logit_bias={13: 2.0})
    with bursts(small, 1):
        alone = [small.generate(p, sp)[0].token_ids for p, sp in zip(PROMPTS[:4], params)]
    free = small.engine.kv.num_free
    # the next step dispatched before the last one's tokens are read, or not; bursts of up to 4 steps, or not
    for overlap, steps in ((True, 1), (False, 1), (True, 4)):
        small.engine.overlap = overlap
        preemptions = small.engine.num_preemptions
        with bursts(small, steps):
            together = small.generate(PROMPTS[:4], params)
        assert [c.token_ids for c in together] == alone
        assert small.engine.num_preemptions > preemptions
        assert small.engine.kv.num_free == free


def test_multi_step_decode_settings_are_checked():
    with pytest.raises(ValueError, match="num_scheduler_steps must be a positive integer"):
        jaxserve.LLM(num_scheduler_steps=0)
    with pytest.raises(ValueError, match="serves one engine"):
        jaxserve.LLM(num_scheduler_steps=4, prefill_instances=2)


def _run(engine, requests, tag: str) -> tuple[dict, collections.Counter, collections.Counter]:
    """Every request's outputs, stepping until nothing is in flight; how many decode tokens each had computed,
    and in how many bursts."""
    rows, in_bursts, row = collections.Counter(), collections.Counter(), engine._row

    def counted(item, feeds, burst):
        if item.phase == "decode":
            rows[item.request_id] += item.tokens
            in_bursts[item.request_id] += burst
        return row(item, feeds, burst)

    engine._row = counted
    try:
        rids = [engine.add_request(ids, sp, f"{tag}-{i}") for i, (ids, sp) in enumerate(requests)]
        outs = collections.defaultdict(list)
        while engine.has_work:
            for out in engine.step():
                outs[out.request_id].append(out)
    finally:
        del engine._row
    return {i: outs[rid] for i, rid in enumerate(rids)}, rows, in_bursts


def test_overlapped_steps_and_bursts_match_one_step_at_a_time(llm, reference):
    """With the next step dispatched before the last one's tokens are read, and with multi-step decodes (bursts
    of up to 8 steps, also dispatched ahead), every output is the one of one step at a time: EOS, a stop string
    mid-output (mid-burst), max_tokens, seeded sampling, prefix-cache hits. A request that stops ran one decode
    more than it shows (its surplus token dropped), in a burst the rest of its burst; one that reaches
    max_tokens did not."""
    eos = next(c for c in reference["greedy"] if c["chat"] and c["tokens"][-1] in llm.tokenizer.stop_ids)
    long = " ".join(PROMPTS)  # several KV blocks: its prefix is cached after the first run
    text = llm.generate(long, SamplingParams(max_tokens=24, ignore_eos=True))[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    requests = [
        (eos["ids"], SamplingParams(max_tokens=64)),
        (long, SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,))),
        (long, SamplingParams(max_tokens=9, ignore_eos=True)),
        *zip(PROMPTS[2:7], MIXED[2:7]),
    ]
    requests = [(llm.tokenizer.encode(p) if isinstance(p, str) else p, sp) for p, sp in requests]
    engine = llm.engine
    runs = {}
    for overlap, steps in ((False, 1), (True, 1), (True, 8)):
        engine.overlap = overlap
        hits = engine.kv.stats.hit_tokens
        with bursts(llm, steps):
            runs[overlap, steps] = _run(engine, requests, f"overlap{overlap}-{steps}")
        assert engine.kv.stats.hit_tokens > hits
    engine.overlap = True
    (sync, sync_rows, _), (lagged, lagged_rows, _) = runs[False, 1], runs[True, 1]
    burst, burst_rows, in_bursts = runs[True, 8]
    for run in (lagged, burst):
        for i in sync:
            assert [t for o in run[i] for t in o.new_token_ids] == [t for o in sync[i] for t in o.new_token_ids]
            assert_same_logprobs(
                *(
                    [x for o in r[i] for x in o.logprobs or ()] if requests[i][1].logprobs is not None else None
                    for r in (run, sync)
                )
            )
            assert "".join(o.new_text for o in run[i]) == "".join(o.new_text for o in sync[i])
            assert run[i][-1].finish_reason == sync[i][-1].finish_reason and run[i][-1].finished
            assert all(not o.finished for o in run[i][:-1])
    assert [sync[0][-1].finish_reason, sync[1][-1].finish_reason, sync[2][-1].finish_reason] == [
        "stop",
        "stop",
        "length",
    ]
    assert "".join(o.new_text for o in sync[1]) == text[: text.find(stop)]
    tokens = {i: sum(len(o.new_token_ids) for o in sync[i]) for i in sync}
    for i, rid in ((0, "0"), (1, "1"), (2, "2")):  # one token comes from the prefill, the others from decodes
        assert sync_rows[f"overlapFalse-1-{rid}"] == tokens[i] - 1
        assert lagged_rows[f"overlapTrue-1-{rid}"] == tokens[i] - (i == 2)
        assert in_bursts[f"overlapTrue-8-{rid}"] > 0
    assert burst_rows["overlapTrue-8-1"] > tokens[1]  # the stop string's burst ran on past it
    assert burst_rows["overlapTrue-8-2"] == tokens[2] - 1  # bursts stop at max_tokens
    assert max(len(o.new_token_ids) for outs in burst.values() for o in outs) > 1  # a burst's tokens at once


def test_seeded_sampling_is_reproducible_and_seed_dependent(llm):
    p = "Tell me a story about a dragon."
    a = llm.generate(p, SamplingParams(max_tokens=16, temperature=1.0, seed=1))[0]
    b = llm.generate(p, SamplingParams(max_tokens=16, temperature=1.0, seed=1))[0]
    c = llm.generate(p, SamplingParams(max_tokens=16, temperature=1.0, seed=2))[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(max_tokens=32, temperature=0.8, seed=1234, ignore_eos=True),
        SamplingParams(max_tokens=32, temperature=0.8, seed=1234, ignore_eos=True, presence_penalty=0.5),
    ],
    ids=["plain", "penalty"],
)
def test_a_seeded_request_draws_the_same_tokens_alone_and_in_any_batch(llm, sp):
    """README, `seed`: the same seeded request alone and beside 1, 3 and 15 others (greedy and sampled, other
    lengths) draws the same tokens. The logits differ in their last bits between batch shapes; the draw does not
    move with them (sampling.gumbel_max)."""
    prompt = "The old lighthouse keeper looked out over the stormy sea and"
    alone = llm.generate(prompt, sp)[0].token_ids
    rng = np.random.default_rng(0)
    for others in (1, 3, 15):
        params = [
            SamplingParams(
                max_tokens=int(rng.integers(8, 60)), ignore_eos=True, seed=i, temperature=float(rng.choice([0.0, 1.0]))
            )
            for i in range(others)
        ]
        outs = llm.generate([prompt] + [PROMPTS[i % len(PROMPTS)] for i in range(others)], [sp] + params)
        assert outs[0].token_ids == alone, f"beside {others}"


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    p = "The three primary colors are"
    greedy = llm.generate(p, SamplingParams(max_tokens=12))[0].token_ids
    assert llm.generate(p, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=4))[0].token_ids == greedy
    assert llm.generate(p, SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, seed=4))[0].token_ids == greedy


def test_stop_string_truncates_and_stream_matches(llm):
    p = "Count: 1, 2, 3, 4,"
    full = llm.generate(p, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    out = llm.generate(p, SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.find(stop)]
    streamed = list(llm.stream(p, SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,))))
    assert "".join(o.new_text for o in streamed) == out.text
    assert [t for o in streamed for t in o.new_token_ids] == out.token_ids
    assert streamed[-1].finished and all(not o.finished for o in streamed[:-1])


def test_eos_and_max_tokens_finish_reasons(llm, reference):
    greedy = next(c for c in reference["greedy"] if c["chat"] and c["tokens"][-1] in llm.tokenizer.stop_ids)
    out = llm.generate(greedy["ids"], SamplingParams(max_tokens=64))[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy["tokens"]
    out = llm.generate(greedy["ids"], SamplingParams(max_tokens=3))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_abandoned_stream_frees_its_blocks(llm):
    free = llm.engine.kv.num_free
    stream = llm.stream("Tell me everything about the ocean.", SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    next(stream)
    assert llm.engine.kv.num_free < free
    stream.close()
    assert llm.engine.kv.num_free == free and not llm.engine.has_unfinished()


def test_interleaved_streams_and_generate_lose_nothing(llm):
    """Two open streams and a generate call share the engine; each gets exactly its own tokens."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 9, 5)]
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(PROMPTS[:3], params)]
    a, b = llm.stream(PROMPTS[0], params[0]), llm.stream(PROMPTS[1], params[1])
    got_a, got_b = next(a).new_token_ids, next(b).new_token_ids
    (mid,) = llm.generate(PROMPTS[2], params[2])
    got_a += [t for o in a for t in o.new_token_ids]
    got_b += [t for o in b for t in o.new_token_ids]
    assert [got_a, got_b, mid.token_ids] == alone
    assert not llm.engine.has_unfinished() and not llm._queues


@pytest.mark.parametrize("field, value, cause", [("top_k", 2**40, "OverflowError"), ("top_p", "x", "ValueError")])
def test_a_request_that_cannot_be_packed_fails_alone(llm, field, value, cause):
    """A parameter that slipped past validation (set after the check) and does not fit the step's arrays ends
    that request with an error; its batch-mates' tokens are what they are alone, and its blocks come back."""
    engine, free = llm.engine, llm.engine.kv.num_free
    params = [SamplingParams(max_tokens=8, ignore_eos=True) for _ in range(3)]
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(PROMPTS[:3], params)]
    bad = dataclasses.replace(params[1])
    rids = [engine.add_request(llm.tokenizer.encode(p), sp) for p, sp in zip(PROMPTS[:3], (params[0], bad, params[2]))]
    object.__setattr__(bad, field, value)  # past check_request, as a validation gap would let it through
    tokens: dict[str, list[int]] = {rid: [] for rid in rids}
    ends: dict[str, object] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                ends[out.request_id] = out
    assert ends[rids[1]].finish_reason.value == "error" and tokens[rids[1]] == []
    assert "cannot be packed" in ends[rids[1]].error and cause in ends[rids[1]].error
    assert [tokens[rids[0]], tokens[rids[2]]] == [alone[0], alone[2]]
    assert engine.kv.num_free == free and not engine.has_unfinished()


def test_finished_requests_leave_nothing_behind(llm):
    """A server runs for months: once a request ends (finished or aborted), no scheduler or engine structure
    keeps it (the scheduler used to list every finished request, prompt and output ids included)."""

    def alive() -> int:
        gc.collect()
        return sum(isinstance(o, SchedRequest) for o in gc.get_objects())

    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=3))
    before = alive()
    llm.generate(PROMPTS, SamplingParams(max_tokens=3))
    stream = llm.stream(PROMPTS[0], SamplingParams(max_tokens=50))
    next(stream)
    stream.close()  # aborted
    assert alive() == before


def test_context_limit_finishes_with_length():
    tiny = jaxserve.LLM(max_model_len=32, kv_cache_tokens=64)
    prompt = list(range(100, 120))
    out = tiny.generate(prompt, SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == 32


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda llm: llm.generate(""), "prompt is empty"),
        (lambda llm: llm.generate([[]]), "prompt is empty"),
        (lambda llm: llm.generate(list(range(3000))), "context"),
        (lambda llm: llm.generate([1, 2, 10**6]), "token ids"),
        (lambda llm: llm.generate(["fine", list(range(3000))]), "context"),  # nothing of it stays queued
        (lambda llm: llm.generate([[1, 2.5]]), "integer token ids"),
        (lambda llm: llm.prompt_logits([10**6]), "token ids"),
        (lambda llm: llm.stream(""), "prompt is empty"),
        (lambda llm: llm.generate("hi", SamplingParams(max_tokens=-1)), "max_tokens"),
        (lambda llm: llm.generate("hi", SamplingParams(top_p=0.0)), "top_p"),
        (lambda llm: llm.generate("hi", SamplingParams(top_p=1.5)), "top_p"),
        (lambda llm: llm.generate("hi", SamplingParams(temperature=-1)), "temperature"),
        (lambda llm: llm.chat([{"role": "user"}]), "content"),
        (lambda llm: jaxserve.LLM("no-such-model"), "unknown model"),
        (lambda llm: jaxserve.LLM("/no/such/path.gguf"), "unknown model"),
        (lambda llm: jaxserve.LLM(block_size=0), "block_size"),
        (lambda llm: jaxserve.LLM(max_num_seqs=0, kv_cache_tokens=64, max_model_len=32), "max_num_seqs"),
        (lambda llm: jaxserve.LLM(policy="nope", kv_cache_tokens=64, max_model_len=32), "unknown policy"),
    ],
)
def test_bad_input_gets_a_clear_error(llm, make, message):
    free = llm.engine.kv.num_free
    with pytest.raises(ValueError, match=message):
        make(llm)
    assert llm.engine.kv.num_free == free and not llm.engine.has_unfinished() and not llm._queues
    assert llm.generate("Hello", SamplingParams(max_tokens=2))[0].token_ids  # still serving


def test_prompt_logits_predict_what_greedy_generation_takes(llm):
    """The scoring pass and the serving path agree: the argmax of the last prompt position's logits is the first
    greedy token, and appending it, the next position's argmax is the second."""
    ids = llm.tokenizer.encode("A quick test of the scoring pass")
    first, second = llm.generate(ids, SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids
    logits = llm.prompt_logits(ids + [first])
    assert logits.shape == (len(ids) + 1, llm.config.vocab_size)
    assert logits[-2].argmax() == first and logits[-1].argmax() == second


def test_no_compiles_while_serving_after_warm_up():
    """64 varied requests (prompt lengths 1-900, greedy and sampled, top-k/top-p, penalties, logprobs, chunked and
    batched) after the start-up warm-up (serve's; small buckets, to compile few programs): XLA compiles nothing."""
    llm = jaxserve.LLM(
        max_model_len=1024, kv_cache_tokens=4096, max_num_seqs=4, max_num_batched_tokens=64, warmup=True, progress=False
    )
    llm.engine.runner.warmup(progress=False)  # returns once the quick start's background compiles are done too
    compiles = []

    def listener(event, duration, **kw):
        if "backend_compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(1, llm.config.vocab_size, int(n)).tolist()
        for n in np.concatenate([rng.integers(1, 40, 48), rng.integers(40, 900, 16)])
    ]
    params = [
        SamplingParams(
            max_tokens=int(rng.integers(1, 4)),
            ignore_eos=True,
            temperature=float(rng.choice([0.0, 0.8])),
            top_k=int(rng.choice([0, 5])),
            top_p=float(rng.choice([1.0, 0.9])),
            seed=i,
            # a third with penalties, logprobs or both: the extra samplers
            repetition_penalty=1.2 if i % 6 == 1 else 1.0,
            logprobs=2 if i % 6 in (2, 3) else None,
            min_p=0.1 if i % 6 == 3 else 0.0,
        )
        for i in range(len(prompts))
    ]
    try:
        outs = llm.generate(prompts, params)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert all(o.finish_reason == "length" for o in outs)
    assert compiles == []


def test_build_engine_serves_one_replica_as_llm_does(reference):
    """engine/build.py's build_engine: one replica from an EngineConfig alone, driven through the ServingEngine
    interface, generates transformers' greedy tokens (every reference prompt, batched)."""
    from jaxserve.config import CacheConfig, EngineConfig, ModelConfig, StartupConfig
    from jaxserve.engine.build import build_engine

    cfg = EngineConfig(
        model=ModelConfig(max_model_len=2048),
        cache=CacheConfig(kv_cache_tokens=8192),
        startup=StartupConfig(warmup=False),
    )
    engine = build_engine(cfg, progress=False)
    assert isinstance(engine, ServingEngine) and engine.max_model_len == 2048
    cases = reference["greedy"]
    rids = {
        engine.add_request(c["ids"], SamplingParams(max_tokens=len(c["tokens"]), ignore_eos=True)): c for c in cases
    }
    tokens = collections.defaultdict(list)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert all(tokens[rid] == c["tokens"] for rid, c in rids.items())
