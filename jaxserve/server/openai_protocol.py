"""OpenAI-compatible request bodies (pydantic) and the sampling options they map to.

Every field of OpenAI's request schemas is declared here: honoured, informational (it changes no output: who
asked, how to log it), or not implemented, and then refused with a message unless it holds the value that means
"off" (tests/server/test_openai_schema.py walks the installed openai package's schemas). vLLM's sampling
extensions (top_k, repetition_penalty, min_p, min_tokens, stop_token_ids, ignore_eos) are honoured too, and its
structured output fields (structured_outputs, and the older guided_json, guided_regex, guided_choice,
guided_grammar) beside OpenAI's response_format. Fields it
does not know at all are ignored, as OpenAI-compatible servers do, so that clients and load tools that send extras
still work.
The tokenize and detokenize bodies, jaxserve's own, refuse unknown fields.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from jaxserve import tool_calls
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
    user: str | None = None  # informational (who asked): changes no output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string, JSON's keys) -> bias
    min_tokens: int = 0  # vLLM's extension
    repetition_penalty: float = 1.0  # vLLM's extension
    min_p: float = 0.0  # vLLM's extension
    n: int = 1  # samples per prompt: choices n x i .. n x i + n - 1 are prompt i's
    # structured output: OpenAI's, or vLLM's (at most one of them)
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    structured_outputs: dict[str, Any] | None = None  # sampling_params.StructuredOutput's fields
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling(self) -> dict[str, Any]:
        """Keyword arguments for Frontend.submit; ValueError names an option jaxserve does not implement."""
        for name, off in self._off_values().items():
            value = getattr(self, name)
            if value not in (None, {}, []) and value not in off:
                raise ValueError(f"{name}={excerpt(value)} is not supported by jaxserve")
        return dict(max_tokens=self._max_tokens(), temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                    ignore_eos=self.ignore_eos, ttft_slo=self.ttft_slo, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                    min_p=self.min_p, min_tokens=self.min_tokens, logit_bias=self._logit_bias(),
                    logprobs=self._logprobs(), n=self.n, best_of=self._best_of(),
                    structured_output=self._structured_output())

    def _off_values(self) -> dict[str, Any]:
        """Options jaxserve does not implement, with the values that mean "off"."""
        return {}

    def _structured_output(self) -> dict[str, Any] | None:
        """The grammar asked for, as StructuredOutput's fields (None: free text)."""
        given = {name: value for name, value in (
            ("response_format", self._response_format()), ("structured_outputs", self.structured_outputs),
            ("guided_json", None if self.guided_json is None else {"json": self.guided_json}),
            ("guided_regex", None if self.guided_regex is None else {"regex": self.guided_regex}),
            ("guided_choice", None if self.guided_choice is None else {"choice": self.guided_choice}),
            ("guided_grammar", None if self.guided_grammar is None else {"grammar": self.guided_grammar}))
            if value is not None}
        if len(given) > 1:
            raise ValueError(f"give at most one of {sorted(given)}: each sets the output's grammar")
        return next(iter(given.values()), None)

    def _response_format(self) -> dict[str, Any] | None:
        rf = self.response_format
        if rf is None or rf.get("type") == "text":
            return None
        if rf.get("type") == "json_object":
            return {"json_object": True}
        if rf.get("type") == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError("response_format json_schema needs json_schema.schema, a JSON schema object")
            return {"json": spec["schema"]}
        raise ValueError(f"response_format type must be text, json_object or json_schema, got "
                         f"{excerpt(rf.get('type'))}")

    def _best_of(self) -> int | None:
        return None

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {excerpt(key)}")
            bias[int(key)] = value
        return bias

    def _logprobs(self) -> int | None:
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. prompt: text, token ids, or a list of either (one choice per prompt)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False  # the prompt before the completion (and its logprobs, with logprobs)
    logprobs: int | None = None  # each token's logprob and the `logprobs` most likely
    best_of: int | None = None  # samples drawn per prompt, of which the n of the highest total logprob return
    # not implemented (see _off_values)
    suffix: str | None = None

    def _off_values(self) -> dict[str, Any]:
        return {**super()._off_values(), "suffix": ()}

    def _best_of(self) -> int | None:
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise ValueError("best_of > n cannot stream: the best are known only at the end")
        return self.best_of

    def _logprobs(self) -> int | None:
        return self.logprobs

    def scores_only(self) -> bool:
        """max_tokens 0 with echo: the prompt and its logprobs, nothing generated (how evaluation harnesses
        score a text); max_tokens 0 without echo asks for nothing."""
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 generates nothing: it is only meaningful with echo")
        if self.max_tokens == 0 and self.stream:
            raise ValueError("max_tokens=0 with echo answers at once: send it without stream")
        return self.max_tokens == 0

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


class ToolCallFunction(_Strict):
    name: str
    arguments: str  # JSON text


class ToolCallMessage(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: str  # checked by the frontend, for gRPC alike
    content: str | list[TextPart] | None = None
    name: str | None = None  # informational: who speaks
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def as_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        m: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            m["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name of max_tokens
    # informational (who asked, how to log or group it): change no output. The prefix cache needs no key: every
    # prompt's blocks are shared
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    logprobs: bool = False  # each generated token's logprob
    top_logprobs: int | None = None  # and the top_logprobs most likely (needs logprobs)
    tools: list[Any] | None = None  # functions the model may call (tool_calls.py)
    tool_choice: Any = None  # none, auto (the default with tools), required, or a named function
    parallel_tool_calls: bool = True  # false: at most one call a reply
    # not implemented (see _off_values)
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: Any = None
    moderation: Any = None
    store: bool | None = None  # OpenAI keeps the completion; jaxserve keeps nothing
    service_tier: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None

    def _off_values(self) -> dict[str, Any]:
        return {**super()._off_values(), "functions": (), "function_call": ("none",),
                "audio": (), "modalities": (["text"],), "prediction": (),
                "reasoning_effort": (), "verbosity": (), "web_search_options": (), "moderation": (),
                "store": (False,), "service_tier": ("auto", "default"), "prompt_cache_retention": ("in_memory",),
                "prompt_cache_options": ()}

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def tool_plan(self, template: str | None) -> tool_calls.Plan | None:
        """The tools' prompt, grammar and reader (None without tools or a tool_choice); ValueError names a bad
        one, or a grammar asked for twice (response_format and a required call)."""
        if self.tools is None and self.tool_choice is None:
            return None
        tools = tool_calls.parse_tools(self.tools or [])
        choice = tool_calls.parse_choice(self.tool_choice, tools)
        plan = tool_calls.plan([m.as_dict() for m in self.messages], tools, choice, template,
                               self.parallel_tool_calls)
        if plan.structured_output is not None and self._structured_output() is not None:
            raise ValueError("tools hold the output to their calls: give no response_format or guided fields "
                             "with them (or tool_choice none)")
        return plan

    def _logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None


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
