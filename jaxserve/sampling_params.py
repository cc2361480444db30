"""Per-request sampling parameters, as a client gives them (vLLM's SamplingParams). Plain Python: the
command line, the servers and the scheduler's callers use it without starting JAX."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any, Sequence

import llguidance


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output must follow (vLLM's StructuredOutputsParams): exactly one of a JSON schema (`json`:
    a dict or its text), any JSON object (`json_object`), a regular expression, a choice of strings, or a Lark
    grammar (llguidance's dialect: https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md). The
    output ends when the grammar is complete. JSON may have any whitespace between its tokens, unless
    `disable_any_whitespace` (then it is compact: `{"a":1}`)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    MAX_CHARS = 1 << 20  # a grammar's text

    def __post_init__(self):
        set_ = functools.partial(object.__setattr__, self)
        if isinstance(self.json, dict):
            try:
                set_("json", json.dumps(self.json))  # in the client's order: the output's keys follow it
            except RecursionError:
                raise ValueError("structured output's json schema is nested too deeply") from None
        if isinstance(self.choice, list):
            set_("choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise ValueError(
                f"structured output takes exactly one of json, json_object, regex, choice and grammar; "
                f"got {given or 'none'}"
            )
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and 0 < len(value) <= self.MAX_CHARS):
                raise ValueError(
                    f"structured output's {name} must be a non-empty string of at most "
                    f"{self.MAX_CHARS} characters, got {excerpt(value, 40)}"
                )
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                f"disable_any_whitespace must be true or false, got {excerpt(self.disable_any_whitespace, 40)}"
            )
        if self.choice is not None and not (
            isinstance(self.choice, tuple) and self.choice and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                f"structured output's choice must be a non-empty list of non-empty strings, got "
                f"{excerpt(self.choice, 40)}"
            )
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured output's json schema is not JSON: {e}") from None
            except RecursionError:
                raise ValueError("structured output's json schema is nested too deeply") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"a JSON schema is an object, got {excerpt(schema, 40)}")
        error = llguidance.LLMatcher.validate_grammar(self.grammar_text())
        if error:
            raise ValueError(grammar_error(error))

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> StructuredOutput:
        """From its fields by name (vLLM's structured_outputs); ValueError names one it does not know."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in fields if k not in known]
        if unknown:
            raise ValueError(
                f"structured output has no field {excerpt(unknown[0], 40)}; its fields are {', '.join(sorted(known))}"
            )
        return cls(**fields)

    def grammar_text(self) -> str:
        """The grammar as llguidance takes it."""
        if self.json is not None or self.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema(
                self.json or '{"type": "object"}', overrides={"whitespace_flexible": not self.disable_any_whitespace}
            )
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return llguidance.grammar_from("lark", "start: " + " | ".join(json.dumps(c) for c in self.choice))
        return llguidance.grammar_from("lark", self.grammar)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. temperature 0 is greedy (the default)."""

    max_tokens: int = 128
    temperature: float = 0.0  # below 1e-5 counts as 0 (greedy), as in vLLM
    top_k: int = 0  # 0 or -1: no top-k cut
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh random seed per request
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # subtracted once from each token generated so far (OpenAI's, -2 to 2)
    frequency_penalty: float = 0.0  # subtracted per time each token was generated so far (OpenAI's, -2 to 2)
    repetition_penalty: float = 1.0  # divides positive logits of tokens seen in the prompt or output (> 0)
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the most likely one
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit); a dict is accepted
    min_tokens: int = 0  # EOS, stop tokens and stop strings end nothing before this many tokens
    logprobs: int | None = None  # None: none; k: each generated token's logprob and the k most likely (k <= 20)
    n: int = 1  # samples of the prompt (siblings: its prefill is shared through the prefix cache)
    best_of: int | None = None  # draw this many samples and keep the n of the highest total logprob
    structured_output: StructuredOutput | None = None  # a grammar the output follows (a dict of its fields too)
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: sample only these tokens (None: any)
    bad_words: tuple[str, ...] = ()  # vLLM's: words the output never contains (engine/bad_words.py)
    skip_special_tokens: bool = True  # vLLM's: False keeps control tokens' text in the output (a stop token's never)

    def __post_init__(self):
        # vLLM-style spellings are accepted and normalised: lists, None, top_k=-1, a single stop string.
        set_ = functools.partial(object.__setattr__, self)
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        set_("stop", tuple(stop))
        set_("stop_token_ids", tuple(self.stop_token_ids or ()))
        set_("bad_words", (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words or ()))
        if isinstance(self.allowed_token_ids, list):
            set_("allowed_token_ids", tuple(self.allowed_token_ids))
        bias = self.logit_bias or ()
        if isinstance(bias, (dict, list, tuple)):
            set_(
                "logit_bias",
                tuple(
                    tuple(e) if isinstance(e, list) else e for e in (bias.items() if isinstance(bias, dict) else bias)
                ),
            )
        if isinstance(self.structured_output, dict):
            set_("structured_output", StructuredOutput.from_dict(self.structured_output))
        if self.top_k == -1:
            set_("top_k", 0)
        if (
            isinstance(self.temperature, (int, float))
            and not isinstance(self.temperature, bool)
            and 0 <= self.temperature < 1e-5
        ):
            set_("temperature", 0.0)
        self.validate()

    MAX_STOP = 64  # stop strings (and stop token ids: MAX_STOP_TOKEN_IDS) a request may give
    MAX_STOP_CHARS = 1024
    MAX_STOP_TOKEN_IDS = 1024
    MAX_LOGIT_BIAS = 1024
    MAX_BAD_WORDS = 64  # each may tokenize twice (engine/bad_words.py: at most 128 sequences)
    MAX_LOGPROBS = 20  # engine.sampling.MAX_LOGPROBS
    MAX_N = 64  # samples of one prompt (n, best_of)

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        def integer(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def number(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        need(integer(self.max_tokens), f"max_tokens must be an integer, got {excerpt(self.max_tokens, 40)}")
        need(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        need(
            number(self.temperature) and self.temperature >= 0,
            f"temperature must be a finite number >= 0, got {excerpt(self.temperature, 40)}",
        )
        need(
            integer(self.top_k) and 0 <= self.top_k < 2**31,
            f"top_k must be -1, 0 (no cut) or an integer < 2**31, got {excerpt(self.top_k, 40)}",
        )
        need(number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {excerpt(self.top_p, 40)}")
        need(
            self.seed is None or (integer(self.seed) and -(2**63) <= self.seed < 2**63),
            f"seed must be a 64-bit signed integer, got {excerpt(self.seed, 40)}",
        )
        need(len(self.stop) <= self.MAX_STOP, f"at most {self.MAX_STOP} stop strings, got {len(self.stop)}")
        need(
            all(isinstance(s, str) and 0 < len(s) <= self.MAX_STOP_CHARS for s in self.stop),
            f"stop must be non-empty strings of at most {self.MAX_STOP_CHARS} characters",
        )
        need(
            len(self.stop_token_ids) <= self.MAX_STOP_TOKEN_IDS,
            f"at most {self.MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}",
        )
        need(
            all(integer(t) and 0 <= t < 2**31 for t in self.stop_token_ids),
            "stop_token_ids must be token ids (integers >= 0)",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            need(number(value) and -2 <= value <= 2, f"{name} must be a number in [-2, 2], got {excerpt(value, 40)}")
        need(
            number(self.repetition_penalty) and 0 < self.repetition_penalty <= 100,
            f"repetition_penalty must be a number in (0, 100], got {excerpt(self.repetition_penalty, 40)}",
        )
        need(number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {excerpt(self.min_p, 40)}")
        need(
            isinstance(self.logit_bias, tuple),
            f"logit_bias must map token ids to numbers, got {excerpt(self.logit_bias, 40)}",
        )
        need(
            len(self.logit_bias) <= self.MAX_LOGIT_BIAS,
            f"at most {self.MAX_LOGIT_BIAS} logit_bias entries, got {len(self.logit_bias)}",
        )
        need(
            all(
                isinstance(e, tuple)
                and len(e) == 2
                and integer(e[0])
                and 0 <= e[0] < 2**31
                and number(e[1])
                and -100 <= e[1] <= 100
                for e in self.logit_bias
            ),
            "logit_bias maps token ids (integers >= 0) to numbers in [-100, 100]",
        )
        need(len({t for t, _ in self.logit_bias}) == len(self.logit_bias), "logit_bias names a token twice")
        need(
            integer(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {excerpt(self.min_tokens, 40)}",
        )
        need(
            self.logprobs is None or (integer(self.logprobs) and 0 <= self.logprobs <= self.MAX_LOGPROBS),
            f"logprobs must be an integer in [0, {self.MAX_LOGPROBS}], got {excerpt(self.logprobs, 40)}",
        )
        need(
            integer(self.n) and 1 <= self.n <= self.MAX_N,
            f"n must be an integer in [1, {self.MAX_N}], got {excerpt(self.n, 40)}",
        )
        need(
            self.best_of is None or (integer(self.best_of) and self.n <= self.best_of <= self.MAX_N),
            f"best_of must be an integer in [n={self.n}, {self.MAX_N}], got {excerpt(self.best_of, 40)}",
        )
        need(
            self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
            f"structured_output must be a StructuredOutput, got {excerpt(self.structured_output, 40)}",
        )
        need(
            self.allowed_token_ids is None
            or (
                isinstance(self.allowed_token_ids, tuple)
                and all(integer(t) and 0 <= t < 2**31 for t in self.allowed_token_ids)
            ),
            f"allowed_token_ids must be token ids (integers >= 0), got {excerpt(self.allowed_token_ids, 40)}",
        )
        need(self.allowed_token_ids != (), "allowed_token_ids is empty: no token could be sampled")
        need(
            isinstance(self.skip_special_tokens, bool),
            f"skip_special_tokens must be true or false, got {excerpt(self.skip_special_tokens, 40)}",
        )
        need(
            len(self.bad_words) <= self.MAX_BAD_WORDS,
            f"at most {self.MAX_BAD_WORDS} bad_words, got {len(self.bad_words)}",
        )
        need(
            all(isinstance(w, str) and w.strip() and len(w) <= self.MAX_STOP_CHARS for w in self.bad_words),
            f"bad_words must be non-blank strings of at most {self.MAX_STOP_CHARS} characters",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def siblings(self) -> list[SamplingParams]:
        """One request's params per sample: best_of (or n) of them, each n=1, seeded seed, seed + 1, ... (or each
        at random). With best_of > n each keeps at least its chosen tokens' logprobs, which rank them (`best`)."""
        k = self.best_of or self.n
        logprobs = 0 if k > self.n and self.logprobs is None else self.logprobs
        return [
            dataclasses.replace(
                self,
                n=1,
                best_of=None,
                logprobs=logprobs,
                seed=None if self.seed is None else (self.seed + i + 2**63) % 2**64 - 2**63,
            )
            for i in range(k)
        ]

    def draw_seed(self) -> int | None:
        """The 32-bit seed of the draws: a seed in [0, 2**32) as given, any other 64-bit one mixed down from all
        its bits (splitmix64's finalizer), so that seeds apart by 2**32 draw apart."""
        if self.seed is None or 0 <= self.seed < 2**32:
            return self.seed
        x = self.seed % 2**64
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB % 2**64
        return (x ^ (x >> 31)) >> 32

    def kept(self, samples: Sequence[Sequence[Any]]) -> list[int]:
        """Which of the siblings' samples to return, given each one's token logprobs (entries with a `logprob`):
        all n in order, or with best_of the n of the highest total logprob, best first."""
        if self.best_of is None:
            return list(range(self.n))
        totals = [sum(x.logprob for x in sample) for sample in samples]
        return sorted(range(len(totals)), key=lambda i: -totals[i])[: self.n]

    @property
    def uses_history(self) -> bool:
        """Whether sampling reads the request's own history or bias: it holds a slot on the device."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
            or bool(self.logit_bias)
            or self.min_tokens > 0
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
        )


def grammar_error(message: str, limit: int = 300) -> str:
    """llguidance's message about a bad grammar, cut short: it quotes the grammar's lines, which may be long."""
    first = message.strip().splitlines()[0] if message.strip() else "invalid grammar"
    return "structured output: " + (first if len(first) <= limit else f"{first[:limit]}...")


def excerpt(value: object, limit: int = 64) -> str:
    """repr of a client's value for an error message, cut short: input is never echoed at length."""
    r = repr(value)
    return r if len(r) <= limit else f"{r[:limit]}... ({len(r)} characters)"
