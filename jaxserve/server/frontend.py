"""What the gRPC and HTTP interfaces share: the served model, tokenization, request checks, the API key, and
how each refusal reads in either protocol."""

from __future__ import annotations

import dataclasses
import hmac
from typing import Any, Sequence

from jaxserve.engine.sampling import SamplingParams
from jaxserve.server.async_engine import AsyncEngine, EngineFailed, QueueFull, RequestStream, ShuttingDown, \
    fit_max_tokens


class Unauthenticated(Exception):
    """The server has an API key and the request did not carry it."""


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
    QueueFull: Refusal(429, "rate_limit_error", "RESOURCE_EXHAUSTED", "queue_full"),
    ShuttingDown: Refusal(503, "service_unavailable", "UNAVAILABLE", "shutting_down"),
    EngineFailed: Refusal(500, "server_error", "INTERNAL", "engine_failed"),
}
REFUSED = tuple(_REFUSALS)  # the exceptions a handler turns into an error reply


def refusal(error: Exception) -> Refusal:
    return next(r for kind, r in _REFUSALS.items() if isinstance(error, kind))


class Frontend:
    """The served model behind both interfaces. `llm` lends its tokenizer and config; its engine is driven by
    `engine` (an AsyncEngine) only, so the LLM must not also be used directly while it is served."""

    def __init__(self, llm: Any, engine: AsyncEngine, *, model_name: str, api_key: str | None = None):
        self.llm = llm
        self.engine = engine
        self.model_name = model_name
        self._api_key = api_key

    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

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

    def check_model(self, name: str | None) -> None:
        """An empty name means the served model."""
        if name and name != self.model_name:
            raise ValueError(f"unknown model {name!r}; this server serves {self.model_name!r}")

    def encode(self, text: str) -> list[int]:
        if not text:
            raise ValueError("prompt is empty")
        return self.llm.tokenizer.encode(text)

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        if not messages:
            raise ValueError("messages is empty")
        return self.llm.chat_prompt(messages)

    def submit(self, prompt_ids: list[int], *, max_tokens: int | None, default_max_tokens: int | None,
               ttft_slo: float | None = None, **sampling: Any) -> RequestStream:
        """Queue a request. default_max_tokens applies when max_tokens is unset (None: the rest of the context);
        ttft_slo: seconds to the first token (None: the server's SLO). Raises one of REFUSED."""
        params = SamplingParams(
            max_tokens=fit_max_tokens(max_tokens, len(prompt_ids), self.max_model_len, default_max_tokens),
            **{k: v for k, v in sampling.items() if v is not None})
        return self.engine.submit(prompt_ids, params, ttft_slo)
