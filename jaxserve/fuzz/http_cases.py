"""Hostile HTTP requests for the OpenAI-compatible API, each a whole HTTP/1.1 request as bytes: valid bodies
with fields swapped for hostile values, bodies that are not JSON (or barely), and abuse of the protocol itself
(methods, paths, headers, lengths, encodings). `http_cases(rng, n)` mixes them."""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

from jaxserve.fuzz.values import CONTROL_TEXT, NUMBERS, hostile_string, hostile_value, nested

COMPLETION_FIELDS = (
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "ttft_slo",
    "stream",
    "stream_options",
    "user",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "min_tokens",
    "echo",
    "logprobs",
    "suffix",
    "best_of",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    # vLLM's and SGLang's extensions, honoured or refused by name
    "prompt_logprobs",
    "return_token_ids",
    "return_tokens_as_token_ids",
    "truncate_prompt_tokens",
    "regex",
    "use_beam_search",
    "allowed_token_ids",
    "bad_words",
    "skip_special_tokens",
    "request_id",
)
CHAT_FIELDS = tuple(f for f in COMPLETION_FIELDS if f not in ("prompt", "echo", "suffix", "best_of")) + (
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "top_logprobs",
    "add_generation_prompt",
    "continue_final_message",
)
PROMPTS = ("The capital of France is", "def add(a, b):", "Once upon a time", "List three colors:", "2 + 2 =")


@dataclasses.dataclass(frozen=True)
class HttpCase:
    kind: str  # what it tests, for the report
    request: bytes  # the whole request, as sent
    in_app: bool = True  # reaches the application, so any error must come in OpenAI's shape
    leave_early: bool = False  # hang up after the first bytes of the reply (a client that leaves)

    def describe(self, most: int = 300) -> str:
        text = self.request.decode("latin-1")
        return text if len(text) <= most else f"{text[:most]}... ({len(text)} bytes)"


def request(
    method: str, path: str, body: bytes = b"", key: str | None = None, headers: dict[str, str | None] | None = None
) -> bytes:
    """An HTTP/1.1 request as bytes; Content-Length is the body's unless `headers` sets it (None: leave it out)."""
    h: dict[str, str | None] = {"Host": "fuzz", "Content-Type": "application/json", "Content-Length": str(len(body))}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    h.update(headers or {})
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items() if v is not None)
    head += "\r\n"
    return head.encode("latin-1") + body


def _json(obj: Any) -> bytes:
    # allow_nan: Infinity and NaN go out as the literals Python's json reads; surrogates stay \ud800 escapes
    return json.dumps(obj, allow_nan=True).encode()


def _base(rng: random.Random, chat: bool, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": rng.randint(1, 6),
        "temperature": rng.choice((0, 0.7)),
        "seed": rng.randint(0, 100),
        "stream": rng.random() < 0.3,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    else:
        body["prompt"] = rng.choice(PROMPTS)
    return body


def _mutate_prompt(rng: random.Random) -> Any:
    return rng.choice(
        (
            lambda: [rng.randint(0, 49151) for _ in range(rng.choice((1, 5, 100)))],
            lambda: [rng.choice((-1, 49152, 2**31, 2**63, True, 1.5, None, "7")) for _ in range(3)],
            lambda: [rng.choice(PROMPTS) for _ in range(rng.choice((0, 2, 41, 500)))],
            lambda: [[1, 2], [3, [4]]],
            lambda: [[], "x"],
            lambda: CONTROL_TEXT,
            lambda: hostile_string(rng),
            lambda: "word " * rng.choice((2000, 20_000)),  # more tokens than the context holds
        )
    )()


def _mutate_messages(rng: random.Random) -> Any:
    message = {"role": "user", "content": rng.choice(PROMPTS)}
    return rng.choice(
        (
            lambda: [{**message, "role": hostile_value(rng)}],
            lambda: [{**message, "content": hostile_value(rng)}],
            lambda: [{"role": "user"}],
            lambda: [{"role": r, "content": CONTROL_TEXT} for r in ("system", "developer", "user", "assistant")],
            lambda: [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}],
            lambda: [message] * rng.choice((0, 300)),
            lambda: [hostile_value(rng)],
            lambda: hostile_value(rng),
        )
    )()


def _field_case(rng: random.Random, chat: bool, model: str, key: str | None) -> HttpCase:
    body = _base(rng, chat, model)
    fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        name = rng.choice(fields)
        if op < 0.15:  # not max_tokens: without it a chat may rightly run to the end of the context (slow)
            body.pop(rng.choice(sorted(set(body) - {"max_tokens"})), None)
        elif op < 0.3:
            body[hostile_string(rng)[:100] or "_"] = hostile_value(rng)
        elif name == "prompt":
            body["prompt"] = _mutate_prompt(rng)
        elif name == "messages":
            body["messages"] = _mutate_messages(rng)
        elif name == "max_tokens":  # not null either: a chat would run to the end of the context
            body[name] = rng.choice([v for v in NUMBERS if v is not None] + ["8", True, [], {}])
        else:
            body[name] = hostile_value(rng)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return HttpCase("chat-fields" if chat else "completion-fields", request("POST", path, _json(body), key))


RAW_BODIES: tuple[bytes, ...] = (
    b"",
    b"{",
    b"}",
    b"null",
    b"[]",
    b'"x"',
    b"0",
    b"{}",
    b'{"model": }',
    b'{"model": "m",}',
    b"\x00\x01\x02",
    b'{"model": "\xff\xfe", "prompt": "x"}',
    b'{"model": "m", "prompt": "\xed\xa0\x80"}',  # bad UTF-8, CESU-8
    b"\xef\xbb\xbf{}",
    nested(100_000).encode(),
    nested(100_000, '{"a":', "}").encode()[:300_000],
    b'{"model": "m", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"model": "m", "prompt": "x", "temperature": 1e999999}',
    b'{"model": "m", "model": 1, "prompt": "x"}',
    b'{"model": "m", /* comment */ "prompt": "x"}',
    b"model=m&prompt=x",
    b"\x1f\x8b\x08\x00garbage",
    b'{"prompt": "' + b"a" * 3_000_000 + b'"}',  # a body far beyond any context
)


def _raw_body_case(rng: random.Random, key: str | None) -> HttpCase:
    path = rng.choice(("/v1/completions", "/v1/chat/completions"))
    return HttpCase("raw-body", request("POST", path, rng.choice(RAW_BODIES), key))


def _protocol_case(rng: random.Random, model: str, key: str | None) -> HttpCase:
    good = _json({"model": model, "prompt": "hi", "max_tokens": 2})
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(good), good)
    cases = (
        (True, request("GET", "/v1/completions", b"", key)),
        (True, request("DELETE", "/v1/models", b"", key)),
        (True, request("OPTIONS", "/v1/chat/completions", b"", key)),
        (True, request("GET", "/" + "a" * 4000, b"", key)),
        (True, request("GET", "/../../etc/passwd", b"", key)),
        (True, request("GET", "/v1/models?x=" + "%ff" * 100, b"", key)),
        (True, request("POST", "/v1/completions", good, None)),
        (True, request("POST", "/v1/completions", good, "wrong")),
        (True, request("POST", "/v1/completions", good, None, {"Authorization": "Bearer"})),
        (True, request("POST", "/v1/completions", good, None, {"Authorization": "Basic " + "A" * 5000})),
        (True, request("POST", "/v1/completions", good, key, {"Content-Type": "text/plain"})),
        (True, request("POST", "/v1/completions", good, key, {"Content-Length": str(10**12)})),
        (False, request("POST", "/v1/completions", good, key, {"Content-Length": "-5"})),
        (False, request("POST", "/v1/completions", good, key, {"Content-Length": "abc"})),
        (True, request("POST", "/v1/completions", good, key, {"Content-Length": str(len(good) - 3)})),
        (
            True,
            request("POST", "/v1/completions", chunked, key, {"Content-Length": None, "Transfer-Encoding": "chunked"}),
        ),
        (False, request("POST", "/v1/completions", chunked, key, {"Transfer-Encoding": "chunked"})),
        (True, request("POST", "/v1/completions", good, key, {"Expect": "100-continue"})),
        (True, request("GET", "/health", b"") + request("GET", "/v1/models", b"", key)),  # pipelined
        (False, b"GARBAGE\r\n\r\n"),
        (False, b"GET / HTTP/9.9\r\n\r\n"),
        (False, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64)),  # a TLS hello
        (False, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
        (False, request("GET", "/health", b"", None, {"X-Big": "v" * 70_000})),
        (False, b"GET /health HTTP/1.1\r\nHost: fuzz\r\nBad Header\r\n\r\n"),
        (True, b"GET /health HTTP/1.0\r\n\r\n"),
    )
    in_app, raw = rng.choice(cases)
    return HttpCase("protocol", raw, in_app=in_app)


def _valid_case(rng: random.Random, model: str, key: str | None) -> HttpCase:
    chat = rng.random() < 0.5
    body = _base(rng, chat, model)
    body["stream"] = rng.random() < 0.6
    leave = body["stream"] and rng.random() < 0.5
    if leave:
        body["max_tokens"] = 64
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return HttpCase("valid", request("POST", path, _json(body), key), leave_early=leave)


def http_cases(rng: random.Random, n: int, model: str, key: str | None) -> list[HttpCase]:
    """n cases: about 35% hostile completion fields, 25% hostile chat fields, 15% raw bodies, 15% protocol
    abuse and 10% valid requests (some left early)."""
    out = []
    for _ in range(n):
        u = rng.random()
        if u < 0.35:
            out.append(_field_case(rng, False, model, key))
        elif u < 0.6:
            out.append(_field_case(rng, True, model, key))
        elif u < 0.75:
            out.append(_raw_body_case(rng, key))
        elif u < 0.9:
            out.append(_protocol_case(rng, model, key))
        else:
            out.append(_valid_case(rng, model, key))
    return out
