"""Structured output: the sampler's mask against numpy, then grammars through the engine. A tiny random-weight
model with SmolLM2's tokenizer draws near-uniformly among the tokens a grammar allows, so it finds whatever a
grammar lets through; the real model checks that masks leave its other requests and its steps alone."""

from __future__ import annotations

import json
import random
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

import jaxserve
from jaxserve import SamplingParams, tool_calls
from jaxserve.engine import grammar
from jaxserve.engine.sampling import Sampling, allowed, sample_step
from jaxserve.models.tokenizer import TextTokenizer
from jaxserve.sampling_params import StructuredOutput
from tiny_models import smollm2_tokenizer, write_tiny_model


def bits(mask: np.ndarray, vocab: int) -> np.ndarray:
    """The numpy reading of a bitmask: [rows, vocab] booleans."""
    ids = np.arange(vocab)
    return (mask[:, ids // 32].astype(np.int64) >> (ids % 32)) & 1 == 1


@pytest.mark.parametrize("rows, vocab", [(1, 32), (3, 100), (16, 49152)])
def test_the_mask_keeps_exactly_the_set_bits(rows, vocab):
    rng = np.random.default_rng(vocab)
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 5
    mask = rng.integers(-(2**31), 2**31, size=(rows, grammar.words(vocab)), dtype=np.int64).astype(np.int32)
    got = np.asarray(allowed(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(got, np.where(bits(mask, vocab), logits, -np.inf))
    np.testing.assert_array_equal(np.asarray(allowed(jnp.asarray(logits), grammar.everything(rows, vocab))), logits)


@pytest.mark.parametrize("kind", ["greedy", "draw", "cut"])
def test_every_sampler_draws_only_allowed_tokens(kind):
    rows, vocab = 8, 300
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(rows, vocab)).astype(np.float32) * 3)
    keep = rng.random((rows, vocab)) < 0.05
    keep[np.arange(rows), rng.integers(0, vocab, rows)] = True  # at least one a row
    mask = np.zeros((rows, grammar.words(vocab)), np.int64)
    for r, t in zip(*np.nonzero(keep)):
        mask[r, t // 32] |= 1 << (t % 32)
    mask = mask.astype(np.uint32).view(np.int32)
    z = lambda dtype, value=0: jnp.full(rows, value, dtype)  # noqa: E731
    drawn = kind != "greedy"
    p = Sampling(
        z(jnp.float32, 1.0 if drawn else 0.0),
        z(jnp.int32, 20 if kind == "cut" else 0),
        z(jnp.float32, 0.9 if kind == "cut" else 1.0),
        jnp.arange(rows),
        z(jnp.int32),
        z(jnp.float32),
        z(jnp.int32, -1),
        z(jnp.float32),
        z(jnp.float32),
        z(jnp.float32, 1.0),
        z(jnp.int32),
    )
    for counter in range(5):
        tokens, _, _ = sample_step(
            logits, p._replace(counters=z(jnp.int32, counter)), None, jnp.asarray(mask), kind=kind
        )
        assert keep[np.arange(rows), np.asarray(tokens)].all()
    greedy, _, _ = sample_step(logits, p._replace(temperature=z(jnp.float32)), None, jnp.asarray(mask), kind="greedy")
    np.testing.assert_array_equal(np.asarray(greedy), np.where(keep, np.asarray(logits), -np.inf).argmax(-1))


# ---- through the engine ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    write_tiny_model(root, smollm2_tokenizer())
    return jaxserve.LLM(
        str(root),
        max_model_len=1024,
        kv_cache_tokens=32768,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        progress=False,
    )


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random JSON schema whose every value is bounded (a uniform drawer among allowed tokens ends it)."""
    kinds = ["string", "enum", "integer", "number", "boolean", "null", "const"]
    kind = "object" if depth == 0 else rng.choice(kinds + (["object", "array", "anyOf"] if depth < 3 else []))
    word = lambda: "".join(rng.choice('abcxyz _-"\\é') for _ in range(rng.randint(1, 6)))  # noqa: E731
    if kind == "string":
        lo = rng.randint(0, 3)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 6)}
    if kind == "enum":
        return {"enum": [rng.choice([word(), rng.randint(-50, 50), True, None]) for _ in range(rng.randint(1, 4))]}
    if kind == "integer":
        lo = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 5000)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "const":
        return {"const": word()}
    if kind == "array":
        lo = rng.randint(0, 2)
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "minItems": lo,
            "maxItems": lo + rng.randint(0, 2),
        }
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(2)]}
    if kind == "object":
        names = rng.sample(["id", "name", "a", "b_c", "value", "tags", "x y", "ok", "ünï"], rng.randint(1, 4))
        return {
            "type": "object",
            "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": rng.sample(names, rng.randint(0, len(names))),
            "additionalProperties": False,
        }
    return {"type": kind}


def test_a_thousand_random_schemas_all_parse_and_validate(tiny):
    """Drawn at temperature 1 from a random model, every output parses and validates against its schema, and
    ends because the grammar did (finish_reason stop), never by running out of tokens."""
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(1000)]
    params = [
        SamplingParams(
            max_tokens=400,
            temperature=1.0,
            seed=i,
            structured_output=StructuredOutput(json=s, disable_any_whitespace=True),
        )
        for i, s in enumerate(schemas)
    ]
    outs = tiny.generate([f"item {i}:" for i in range(len(schemas))], params)
    for schema, out in zip(schemas, outs):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_json_with_any_whitespace_regex_choice_and_lark_hold(tiny):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    specs = [
        StructuredOutput(json=schema),
        StructuredOutput(regex=r"[a-f]{2,5}-[0-9]{3}"),
        StructuredOutput(choice=("red", "green", "blue")),
        StructuredOutput(grammar='start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'),
    ]
    outs = tiny.generate(
        ["go"] * 40,
        [SamplingParams(max_tokens=600, temperature=1.0, seed=i, structured_output=specs[i % 4]) for i in range(40)],
    )
    for i, out in enumerate(outs):
        assert out.finish_reason == "stop", out.text
        spec = specs[i % 4]
        if spec.json:
            jsonschema.validate(json.loads(out.text), schema)
        elif spec.regex:
            assert re.fullmatch(spec.regex, out.text)
        elif spec.choice:
            assert out.text in spec.choice
        else:
            assert re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", out.text)


def test_bad_grammars_are_refused_by_name(tiny):
    for bad, words in [
        ({"json": {"type": "objectx"}}, "objectx"),
        ({"regex": "[a-"}, "regex"),
        ({"grammar": "start: nothing"}, "nothing"),
        ({"json": "{"}, "not JSON"),
        ({"json": "{}", "regex": "a"}, "exactly one"),
    ]:
        with pytest.raises(ValueError, match=words):
            tiny.generate("x", SamplingParams(structured_output=bad))


def test_a_word_tokenizer_cannot_drive_a_grammar():
    llm = jaxserve.LLM("random:tiny", max_model_len=64, kv_cache_tokens=256, progress=False)
    with pytest.raises(ValueError, match="cannot drive a grammar"):
        llm.generate("<1>", SamplingParams(structured_output={"regex": "a+"}))


# Different batches round float32 differently (~1e-6 in a logprob): a greedy choice between two tokens closer than
# this is a tie either may win, after which the outputs part ways.
TIE = 1e-3


def assert_same_until_a_tie(a, b) -> None:
    """a and b (outputs with logprobs) are the same tokens, or the same up to a token where both chose one of a
    tie (its logprob in each run within TIE of the other's choice)."""
    for i, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
        if x.token != y.token:
            assert abs(x.logprob - y.logprob) < TIE, (i, a.text, b.text, x, y)
            return
    assert a.token_ids == b.token_ids


def test_guided_rows_leave_their_neighbours_and_the_overlap_alone(llm):
    """Greedy on the real model: guided and plain requests in one batch give what each gives alone, with the
    next step dispatched before the last one's tokens are read (overlap) or not."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "people": {"type": "integer", "minimum": 0}},
        "required": ["city", "people"],
        "additionalProperties": False,
    }
    prompts = ["Describe a city as JSON:", "Write a haiku about rain.", "Name a colour:", "Count to five:"]
    guides = [{"json": schema}, None, {"choice": ["red", "green"]}, {"regex": r"(\d, ){4}\d"}]
    params = [SamplingParams(max_tokens=40, logprobs=1, structured_output=g) for g in guides]
    alone = [llm.generate(p, sp)[0] for p, sp in zip(prompts, params)]
    together = llm.generate(prompts, params)
    llm.engine.overlap = False
    try:
        in_step = llm.generate(prompts, params)
    finally:
        llm.engine.overlap = True
    for a, t, s in zip(alone, together, in_step):
        assert_same_until_a_tie(a, t)
        assert_same_until_a_tie(a, s)
    for out, g in zip(together, guides):
        assert out.finish_reason == "stop" or g is None
    json.loads(together[0].text)
    assert together[2].text in ("red", "green") and re.fullmatch(r"(\d, ){4}\d", together[3].text)


def test_required_tool_calls_parse_and_validate_in_every_format(tiny):
    """tool_choice required and a named function, drawn at temperature 1: the call reads back, naming an offered
    tool, its arguments valid against that tool's schema."""
    from test_tool_calls import HERMES, LLAMA3, TIME, WEATHER

    weather = json.loads(json.dumps(WEATHER))
    params = weather["function"]["parameters"]
    params["properties"]["city"]["maxLength"], params["additionalProperties"] = 12, False  # a drawer's JSON ends
    time_ = {
        "type": "function",
        "function": {
            **TIME["function"],
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    }
    tools = tool_calls.parse_tools([weather, time_])
    schemas = {t.name: t.parameters for t in tools}
    for template, fmt in [(HERMES, "hermes"), (LLAMA3, "llama3_json"), (None, "generic")]:
        for choice in ("required", tools[0]):
            # one call a reply: a drawer would go on calling (several calls read back: tests/test_tool_calls.py)
            plan = tool_calls.plan([{"role": "user", "content": "hi"}], tools, choice, template, parallel=False)
            assert plan.format == fmt
            # compact JSON: a drawer among every whitespace token the JSON allows would write little else
            compact = (
                {**plan.structured_output, "disable_any_whitespace": True}
                if fmt != "hermes"
                else {
                    "grammar": plan.structured_output["grammar"].replace(
                        "%json {", '%json {"x-guidance": {"whitespace_flexible": false}, '
                    )
                }
            )
            outs = tiny.generate(
                ["call:"] * 20,
                [SamplingParams(max_tokens=400, temperature=1.0, seed=i, structured_output=compact) for i in range(20)],
            )
            for out in outs:
                assert out.finish_reason == "stop", out.text
                reader = tool_calls.Reader(fmt)
                reader.feed(out.text)
                _, calls = reader.finish()
                assert len(calls) == 1 and calls[0].name in schemas, out.text
                assert choice == "required" or [c.name for c in calls] == ["get_weather"]
                for c in calls:
                    jsonschema.validate(json.loads(c.arguments), schemas[c.name])


def test_guided_requests_survive_preemption_unchanged(tiny, tmp_path_factory):
    """With a KV pool too small for the batch, requests are preempted and recompute; their grammars' state stays
    with their kept tokens, so each output (drawn at temperature 1, seeded) equals the one from a pool that
    preempts nobody."""
    rng = random.Random(7)
    schemas = [random_schema(rng) for _ in range(48)]
    params = [
        SamplingParams(
            max_tokens=100,
            temperature=1.0,
            seed=i,
            structured_output=StructuredOutput(json=s, disable_any_whitespace=True),
        )
        for i, s in enumerate(schemas)
    ]
    prompts = [f"item {i}:" for i in range(len(schemas))]
    roomy = [o.text for o in tiny.generate(prompts, params)]
    small = jaxserve.LLM(
        str(tiny.engine_config.model.model),
        max_model_len=128,
        kv_cache_tokens=256,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        progress=False,
    )
    tight = small.generate(prompts, params)
    assert small.engine.num_preemptions > 0
    assert [o.text for o in tight] == roomy
    for schema, out in zip(schemas, tight):
        jsonschema.validate(json.loads(out.text), schema)


def test_every_stop_token_may_end_a_grammar():
    """A grammar that is complete allows each of the model's stop tokens (a chat model ends its turn with
    <|im_end|> or <|eot_id|>, not the tokenizer's first EOS)."""
    base = smollm2_tokenizer()
    tok = TextTokenizer(
        base.tokenizer,
        bos_id=None,
        stop_ids=[0, 2],
        add_bos=False,
        chat_template=None,
        special_tokens=base.special_tokens,
    )
    grammars = grammar.Grammars(tok, tok.vocab_size)
    m = grammars.matcher(StructuredOutput(regex="[0-9]+"))
    assert m.consume_tokens(tok.encode("42", add_special_tokens=False))
    allowed = bits(grammars.masks([m]), tok.vocab_size)[0]
    assert allowed[0] and allowed[2]


@pytest.mark.parametrize(
    "spec, unicode_digit",
    [
        (StructuredOutput(regex=r"\d+"), True),
        (StructuredOutput(json={"type": "string", "pattern": r"^\d+$"}), False),
    ],
)
def test_a_regex_digit_is_unicode_a_json_schema_pattern_digit_ascii(spec, unicode_digit):
    """README's rule: `\\d` in a regex is Unicode's (as Rust's and Python's re), in a JSON schema's pattern ASCII
    (JSON Schema's ECMA-262 regexes). Both admit 7; only the regex admits the Arabic-Indic three."""
    tok = smollm2_tokenizer()
    grammars = grammar.Grammars(tok, tok.vocab_size)
    quote = '"' if spec.json else ""
    assert grammars.matcher(spec).consume_tokens(tok.encode(quote + "7", add_special_tokens=False))
    other = tok.encode(quote + "\u0663", add_special_tokens=False)
    assert grammars.matcher(spec).consume_tokens(other) is unicode_digit
