"""Penalties, logit_bias, allowed_token_ids, bad_words, skip_special_tokens, min_tokens, logprobs, n and best_of
through the engine on the real model: logprobs against transformers' (the fixtures), penalties and allowed tokens
against a numpy replay over the scoring pass's logits, samples against the same requests one at a time."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import SamplingParams

# float32 logits of magnitude up to ~30 through two different programs: 1e-4 is the bar, and ~100 ulps
TOL = 1e-4
PROMPT_TEXT = "The capital of France is"


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_logprobs_equal_transformers(llm, reference):
    """The first generated token's logprob and top 20 after each fixture position equal the log-softmax of
    transformers' logits there."""
    cases = [
        (p["ids"][: pos + 1], logits)
        for p, all_logits in zip(reference["prefill"], reference["logits"])
        for pos, logits in zip(p["positions"], all_logits)
    ]
    outs = llm.generate([ids for ids, _ in cases], SamplingParams(max_tokens=1, logprobs=20, ignore_eos=True))
    for (ids, logits), out in zip(cases, outs):
        want = log_softmax(logits)
        (got,) = out.logprobs
        assert got.token == out.token_ids[0] == int(np.argmax(logits))
        assert abs(got.logprob - want[got.token]) < TOL
        top_ids, top = zip(*got.top)
        np.testing.assert_allclose(top, want[list(top_ids)], rtol=0, atol=TOL)
        # the 20 best, best first (ties at float32 resolution may swap places)
        assert np.all(np.diff(top) <= 0)
        assert min(top) >= np.sort(want)[-20] - TOL


def _penalized(logits, prompt, out, p: SamplingParams) -> np.ndarray:
    """vLLM's logit_bias, repetition, frequency and presence penalties in float64."""
    x = np.asarray(logits, np.float64).copy()
    for t, b in p.logit_bias:
        x[t] += b
    counts = np.bincount(np.asarray(out, np.int64), minlength=len(x)).astype(np.float64)
    seen = counts > 0
    seen[list(prompt)] = True
    r = p.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=1.6),
        SamplingParams(max_tokens=10, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.7),
        SamplingParams(max_tokens=10, ignore_eos=True, presence_penalty=-1.0, logit_bias={11: 3.0, 28: -5.0}),
    ],
)
def test_greedy_penalties_follow_a_numpy_replay(llm, params):
    """Each greedy token is the argmax of the penalized logits of its position (the scoring pass's logits, the
    penalties applied in numpy over the prompt and the tokens before it), and the penalties change the output."""
    prompt = llm.tokenizer.encode("Repeat after me: the cat, the cat, the cat, the cat")
    out = llm.generate(prompt, params)[0].token_ids
    plain = llm.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    assert out != plain
    logits = llm.prompt_logits(prompt + out[:-1])
    for i, token in enumerate(out):
        x = _penalized(logits[len(prompt) - 1 + i], prompt, out[:i], params)
        best = np.sort(x)[-2:]
        if best[1] - best[0] > 1e-3:  # not a near-tie, which float32 could break either way
            assert token == int(np.argmax(x)), i


def test_logit_bias_forces_and_forbids_tokens(llm):
    prompt = "The capital of France is"
    plain = llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    forbidden = llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True, logit_bias={plain[0]: -100}))[
        0
    ].token_ids
    assert forbidden[0] != plain[0] and plain[0] not in forbidden
    forced = llm.generate(
        prompt, SamplingParams(max_tokens=4, ignore_eos=True, temperature=1.0, seed=0, logit_bias={42: 100})
    )[0].token_ids
    assert forced == [42] * 4


def test_allowed_token_ids_confine_draws_and_greedy_picks_the_best_allowed(llm):
    prompt = llm.tokenizer.encode("The capital of France is")
    plain = llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    allowed = sorted({*plain[1:], 11, 28, 42, 1000})  # not the greedy first token
    drawn = llm.generate(
        prompt, SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=3, allowed_token_ids=allowed)
    )[0].token_ids
    assert set(drawn) <= set(allowed)
    greedy = llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True, allowed_token_ids=allowed))[0]
    logits = llm.prompt_logits(prompt + greedy.token_ids[:-1])
    for i, token in enumerate(greedy.token_ids):
        x = logits[len(prompt) - 1 + i][allowed]
        best = np.sort(x)[-2:]
        if best[1] - best[0] > 1e-3:  # not a near-tie
            assert token == allowed[int(np.argmax(x))], i
    with pytest.raises(ValueError, match="allowed_token_ids is empty"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match=r"allowed_token_ids must be in \[0, "):
        llm.generate(prompt, SamplingParams(allowed_token_ids=[llm.engine.runner.cfg.vocab_size]))


def _contains(seq: list[int], sub: tuple[int, ...]) -> int:
    """Where sub first starts in seq (-1: nowhere)."""
    return next((i for i in range(len(seq) - len(sub) + 1) if tuple(seq[i : i + len(sub)]) == sub), -1)


def test_bad_words_never_appear_and_the_reply_is_unchanged_before_them(llm):
    """A word of several tokens from the greedy reply: the reply with it banned equals the plain one up to the
    word's last token, which it replaces, and never holds the word's tokens; a one-token word (banned on the
    device) changes the first token. A plain request batched beside them is untouched."""
    from jaxserve.engine import bad_words

    prompt = "Write one sentence about the history of Paris."
    plain = llm.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    vocab = llm.engine.runner.cfg.vocab_size
    found = [
        (w, s, at)
        for w in plain.text.split()
        for s in bad_words.sequences([w], llm.tokenizer, vocab)
        if len(s) > 1 and (at := _contains(plain.token_ids, s)) >= 0
    ]
    word, seq, at = found[0]
    single = next(
        w for w in plain.text.split() if {len(s) for s in bad_words.sequences([w], llm.tokenizer, vocab)} == {1}
    )
    other = SamplingParams(max_tokens=24, ignore_eos=True)
    banned, one, beside = llm.generate(
        [prompt, prompt, "The capital of France is"],
        [
            SamplingParams(max_tokens=24, ignore_eos=True, bad_words=[word]),
            SamplingParams(max_tokens=24, ignore_eos=True, bad_words=[single]),
            other,
        ],
    )
    cut = at + len(seq) - 1
    assert banned.token_ids[:cut] == plain.token_ids[:cut] and banned.token_ids[cut] != seq[-1]
    for reply, w in ((banned, word), (one, single)):
        assert all(_contains(reply.token_ids, s) < 0 for s in bad_words.sequences([w], llm.tokenizer, vocab))
        assert reply.token_ids != plain.token_ids
    assert beside.token_ids == llm.generate("The capital of France is", other)[0].token_ids


def test_bad_words_of_several_tokens_ban_the_last_after_the_others():
    """vLLM's rule on the generated tokens: the last token is banned only right after the word's others."""
    from jaxserve.engine.bad_words import BadWords

    guide = BadWords([(5, 6, 7), (9, 7)], generated=[1, 5])
    assert guide.banned() == []
    guide.consume_token(6)
    assert guide.banned() == [7]
    guide.consume_token(9)
    assert guide.banned() == [7]
    guide.consume_token(7)
    assert guide.banned() == []


def test_control_tokens_text_is_kept_on_request_and_a_stop_tokens_never(llm):
    """skip_special_tokens false keeps a control token's text (forced here by logit_bias); as vLLM, the token
    that stops a reply (a stop_token_ids one, EOS) is in its token ids but not its text."""
    start = llm.tokenizer.tokenizer.token_to_id("<|im_start|>")
    forced = dict(max_tokens=3, ignore_eos=True, logit_bias={start: 100})
    assert llm.generate("Hi", SamplingParams(**forced))[0].text == ""
    assert llm.generate("Hi", SamplingParams(**forced, skip_special_tokens=False))[0].text == "<|im_start|>" * 3
    ref = llm.generate(PROMPT_TEXT, SamplingParams(max_tokens=8, ignore_eos=True))[0]
    i = next(i for i in range(2, 8) if ref.token_ids[i] not in ref.token_ids[:i])  # its first time
    out = llm.generate(PROMPT_TEXT, SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[ref.token_ids[i]]))[0]
    assert out.token_ids == ref.token_ids[: i + 1] and out.finish_reason == "stop"
    assert out.text == llm.tokenizer.decode(ref.token_ids[:i])


def test_min_tokens_holds_back_eos_and_stop_tokens(llm, reference):
    """A greedy reply that ends with EOS after n tokens runs past it with min_tokens = n + 3: no stop token among
    the first n + 3, and the first n - 1 tokens unchanged (EOS was the n-th)."""
    case = next(c for c in reference["greedy"] if c["chat"] and c["tokens"][-1] in llm.tokenizer.stop_ids)
    n = len(case["tokens"])
    out = llm.generate(case["ids"], SamplingParams(max_tokens=n + 8, min_tokens=n + 3))[0]
    assert out.token_ids[: n - 1] == case["tokens"][: n - 1]
    assert len(out.token_ids) > n + 3 or out.finish_reason == "length"
    assert not set(out.token_ids[: n + 3]) & set(llm.tokenizer.stop_ids)
    stop = case["tokens"][n // 2]  # a stop token id it generates early: held back alike
    out = llm.generate(
        case["ids"], SamplingParams(max_tokens=n, min_tokens=n - 2, stop_token_ids=[stop], ignore_eos=True)
    )[0]
    assert stop not in out.token_ids[: n - 2]


def test_n_samples_prefill_the_prompt_once_and_equal_their_seeds_alone(llm):
    """n=4 with seed s: the samples of seeds s .. s + 3 alone; the 3 later ones wait for the first's prefill and
    find its full blocks in the prefix cache."""
    prompt = llm.tokenizer.encode("Write one sentence about the sea, the wind and the gulls above the waves. " * 3)
    alone = [
        llm.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=40 + i))[0].token_ids for i in range(4)
    ]
    llm.engine.kv.reset_prefix_cache()
    hits = llm.engine.kv.stats.hit_tokens
    outs = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=40, n=4))
    assert [o.token_ids for o in outs] == alone and len({tuple(a) for a in alone}) > 1
    block = llm.engine.kv.block_size
    assert llm.engine.kv.stats.hit_tokens - hits == 3 * (len(prompt) // block) * block


def test_best_of_keeps_the_samples_of_the_highest_total_logprob(llm):
    prompt = "Name a fruit:"
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=2, best_of=5)
    alone = [
        llm.generate(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=7 + i, logprobs=0))[0] for i in range(5)
    ]
    totals = [sum(x.logprob for x in c.logprobs) for c in alone]
    want = [alone[i].token_ids for i in np.argsort(totals)[::-1][:2]]
    outs = llm.generate(prompt, params)
    assert [o.token_ids for o in outs] == want and all(o.logprobs is None for o in outs)
