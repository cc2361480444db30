"""OpenAI-compatible request bodies (pydantic) and the sampling options they map to.

Fields jaxserve does not implement (n > 1, logprobs, penalties, ...) are refused with a message rather than
silently ignored; fields it does not know are ignored, as OpenAI-compatible servers do, so that clients and
load tools that send extras still work. The tokenize and detokenize bodies, jaxserve's own, refuse unknown fields.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from jaxserve.sampling_params import excerpt


class _Strict(BaseModel):
    # JSON types as sent: no booleans as numbers, no numbers as strings, integers where integers are meant,
    # no Infinity/NaN (Python's JSON reads those literals)
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    top_k: int | None = None  # vLLM's extension; -1 or 0: no cut
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension
    ttft_slo: float | None = None  # jaxserve's extension: seconds to the first token (the policies' deadline)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Not implemented: accepted only at the value that means "off".
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0

    def sampling(self) -> dict[str, Any]:
        """Keyword arguments for Frontend.submit; ValueError names an option jaxserve does not implement."""
        for name, off in self._off_values().items():
            value = getattr(self, name)
            if value not in (None, off, {}, []):
                raise ValueError(f"{name}={excerpt(value)} is not supported by jaxserve")
        return dict(max_tokens=self._max_tokens(), temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                    ignore_eos=self.ignore_eos, ttft_slo=self.ttft_slo)

    def _off_values(self) -> dict[str, Any]:
        """Options jaxserve does not implement, with the value that means "off"."""
        return {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None, "min_tokens": 0}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. prompt: text, token ids, or a list of either (one choice per prompt)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def _off_values(self) -> dict[str, Any]:
        return {**super()._off_values(), "echo": False, "logprobs": None, "best_of": 1, "suffix": None}

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str  # checked by the frontend, for gRPC alike
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def _off_values(self) -> dict[str, Any]:
        return {**super()._off_values(), "logprobs": False, "top_logprobs": None, "tools": None,
                "response_format": {"type": "text"}}

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class _Exact(_Strict):
    # jaxserve's own endpoints (vLLM's shapes): a field they do not know is refused, never ignored
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TokenizeRequest(_Exact):
    """POST /tokenize (vLLM's shape): a prompt, or a conversation rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")


class DetokenizeRequest(_Exact):
    """POST /detokenize (vLLM's shape): token ids back to text."""

    model: str | None = None
    tokens: list[int]
