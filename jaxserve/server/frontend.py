"""What the gRPC and HTTP interfaces share: the served model, tokenization, request checks, the API key, and
how each refusal reads in either protocol."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
from typing import Any, Sequence

from jaxserve.sampling_params import SamplingParams, excerpt
from jaxserve.server.async_engine import (
    AsyncEngine,
    EngineFailed,
    ProcessGone,
    QueueFull,
    RequestStream,
    ShuttingDown,
    fit_max_tokens,
)
from jaxserve.server.model import ServedModel


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class Unauthenticated(Exception):
    """The server has an API key and the request did not carry it."""


class NotFound(Exception):
    """The request names a model (or another thing) this server does not have."""


class TooLarge(Exception):
    """The request body is over the server's limit."""


class ReadTimeout(Exception):
    """The client did not send its request body in time."""


@dataclasses.dataclass(frozen=True)
class Refusal:
    """How an error reaches a client: HTTP status and OpenAI error type, gRPC status code name, metric label."""

    http_status: int
    error_type: str
    grpc_code: str
    reason: str


_REFUSALS: dict[type[Exception], Refusal] = {
    ValueError: Refusal(400, "invalid_request_error", "INVALID_ARGUMENT", "invalid"),
    Unauthenticated: Refusal(401, "authentication_error", "UNAUTHENTICATED", "unauthenticated"),
    NotFound: Refusal(404, "invalid_request_error", "NOT_FOUND", "not_found"),
    TooLarge: Refusal(413, "invalid_request_error", "INVALID_ARGUMENT", "too_large"),
    ReadTimeout: Refusal(408, "invalid_request_error", "DEADLINE_EXCEEDED", "read_timeout"),
    QueueFull: Refusal(429, "rate_limit_error", "RESOURCE_EXHAUSTED", "queue_full"),
    ShuttingDown: Refusal(503, "service_unavailable", "UNAVAILABLE", "shutting_down"),
    EngineFailed: Refusal(500, "server_error", "INTERNAL", "engine_failed"),
    ProcessGone: Refusal(503, "service_unavailable", "UNAVAILABLE", "process_lost"),
}
REFUSED = tuple(_REFUSALS)  # the exceptions a handler turns into an error reply


def refusal(error: Exception) -> Refusal:
    return next(r for kind, r in _REFUSALS.items() if isinstance(error, kind))


class Frontend:
    """The served model behind both interfaces. `llm` lends its tokenizer and config; its engine is driven by
    `engine` (an AsyncEngine) only, so the LLM must not also be used directly while it is served."""

    def __init__(self, llm: ServedModel, engine: AsyncEngine, *, model_name: str, api_key: str | None = None):
        self.llm = llm
        self.engine = engine
        self.model_name = model_name
        if api_key is not None and not (
            api_key and api_key.isascii() and api_key.isprintable() and api_key == api_key.strip()
        ):
            # HTTP headers carry bytes a server may read as latin-1, gRPC metadata only printable ASCII
            raise ValueError(
                "the API key must be printable ASCII, without spaces at its ends: no client could "
                "send another the same way over HTTP and gRPC"
            )
        self._api_key = api_key

    def release(self) -> None:
        """Let go of the model once the servers have stopped: FastAPI keeps the endpoint functions (and so this
        object) for the life of the process, and the model's device buffers must not stay with them."""
        self.llm = self.engine = None

    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

    @functools.cached_property
    def max_text_chars(self) -> int:
        """Longer text cannot fit the context: a token stands for at most max_token_chars characters (x4 for
        normalizers that fold several characters into one)."""
        return self.max_model_len * self.llm.tokenizer.max_token_chars * 4

    @property
    def vocab_size(self) -> int:
        return self.llm.config.vocab_size

    def authorize(self, authorization: str | None) -> None:
        """Check an `Authorization: Bearer <key>` value against the server's key (if it has one)."""
        if self._api_key is None:
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self._api_key.encode()):
            raise Unauthenticated("missing or wrong API key: send 'Authorization: Bearer <key>'")

    def check_model(self, name: str | None, required: bool = False) -> None:
        """A request's model must be the served one (NotFound); an empty name means it unless `required`."""
        if (name or required) and name != self.model_name:
            raise NotFound(f"unknown model {excerpt(name)}; this server serves {self.model_name!r}")

    def _check_text(self, text: object, what: str) -> str:
        """Text a client sent, refused before any work if it is not a string of valid Unicode or is longer than
        any text the context could hold."""
        if not isinstance(text, str):
            raise ValueError(f"{what} must be a string")
        if len(text) > self.max_text_chars:
            raise ValueError(
                f"{what} has {len(text)} characters; no text over {self.max_text_chars} fits the "
                f"context of {self.max_model_len} tokens"
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{what} is not valid Unicode: a lone surrogate at character {e.start}") from None
        return text

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a raw prompt (control-token text in it is read as the token: the client writes the
        model's input), with the tokenizer's BOS unless add_special_tokens is false. Tokenized in a worker thread,
        off the event loop."""
        if not self._check_text(text, "prompt"):
            raise ValueError("prompt is empty")
        return await asyncio.to_thread(self.llm.tokenizer.encode, text, add_special_tokens)

    async def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of token ids (control tokens left out unless asked for), each checked to be in the
        vocabulary."""
        vocab = self.llm.config.vocab_size
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise ValueError(f"tokens[{i}] = {excerpt(t)} is not a token id (0 to {vocab - 1})")
        return await asyncio.to_thread(self.llm.tokenizer.decode, ids, skip_special_tokens)

    async def encode_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None, **rendering: bool
    ) -> list[int]:
        """Token ids of a conversation, with the tools the template offers (tool_calls.plan); only the chat
        template adds control tokens. Roles are OpenAI's ("developer" is the newer name of "system").
        rendering: LLM.chat_prompt's add_generation_prompt and continue_final_message."""
        if not messages:
            raise ValueError("messages is empty")
        checked, chars = [], 0
        for i, m in enumerate(messages):
            role = m.get("role")
            if role not in ROLES:
                raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {excerpt(role)}")
            content = self._check_text(m.get("content"), f"messages[{i}].content")
            chars += len(content)
            checked.append({**m, "role": ROLES[role], "content": content})
        if chars > self.max_text_chars:
            raise ValueError(
                f"messages have {chars} characters; no text over {self.max_text_chars} fits the "
                f"context of {self.max_model_len} tokens"
            )
        return await asyncio.to_thread(functools.partial(self.llm.chat_prompt, checked, tools, **rendering))

    async def prompt_logprobs(self, ids: list[int], k: int) -> list[Any]:
        """Each prompt token's TokenLogprob (None for the first), with the k most likely: a scoring pass beside
        serving, in a worker thread."""
        return await asyncio.to_thread(self.llm.prompt_logprobs, ids, k)

    @functools.lru_cache(maxsize=1 << 16)
    def token_text(self, token: int) -> str:
        """One token's text as logprobs show it, control tokens included (a piece of a multi-byte character reads
        as U+FFFD)."""
        return self.llm.tokenizer.tokenizer.decode([token], skip_special_tokens=False)

    def check_batch(self, n: int) -> None:
        """A batch of n prompts is queued whole or not at all: one larger than the server's capacity never is."""
        if n > self.engine.capacity:
            raise ValueError(
                f"a batch of {n} prompts can never be admitted: this server holds at most "
                f"{self.engine.capacity} requests at once"
            )

    def params(
        self, prompt_ids: list[int], *, max_tokens: int | None, default_max_tokens: int | None, **sampling: Any
    ) -> SamplingParams:
        """A request's sampling params. default_max_tokens applies when max_tokens is unset (None: the rest of the
        context). ValueError names a bad one."""
        return SamplingParams(
            max_tokens=fit_max_tokens(max_tokens, len(prompt_ids), self.max_model_len, default_max_tokens),
            **{k: v for k, v in sampling.items() if v is not None},
        )

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, ttft_slo: float | None = None
    ) -> list[RequestStream]:
        """Queue a request: a stream per sample (SamplingParams.siblings; the later ones wait for the first's
        prefill, to share it), all or none. ttft_slo: seconds to the first token (None: the server's SLO).
        Raises one of REFUSED."""
        first, *rest = params.siblings()
        if len(rest) + 1 > self.engine.capacity:
            raise ValueError(
                f"{len(rest) + 1} samples of one prompt can never be admitted: this server holds at "
                f"most {self.engine.capacity} requests at once"
            )
        streams = [self.engine.submit(prompt_ids, first, ttft_slo)]
        try:
            for p in rest:
                streams.append(self.engine.submit(prompt_ids, p, ttft_slo, after=streams[0]))
        except REFUSED:
            for s in streams:
                s.close()
            raise
        return streams
