"""OpenAI-compatible request bodies (pydantic) and the sampling options they map to.

Every field of OpenAI's request schemas is declared here: honoured, informational (it changes no output: who
asked, how to log it), or not implemented, and then refused with a message unless it holds the value that means
"off" (tests/server/test_openai_schema.py walks the installed openai package's schemas). vLLM's sampling
extensions (top_k, repetition_penalty, min_p, min_tokens, stop_token_ids, ignore_eos, return_token_ids,
return_tokens_as_token_ids, truncate_prompt_tokens, allowed_token_ids, bad_words, skip_special_tokens,
stream_options.continuous_usage_stats) are honoured too, and
its structured output fields (structured_outputs, and the older guided_json, guided_regex, guided_choice,
guided_grammar; SGLang's regex) beside OpenAI's response_format. vLLM's and SGLang's other fields are declared
and refused by name unless off (PEER_FIELDS_OFF). Fields of none of these schemas are ignored, as
OpenAI-compatible servers do, so that clients and load tools that send extras still work.
The tokenize and detokenize bodies, jaxserve's own, refuse unknown fields.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict

from jaxserve import tool_calls
from jaxserve.sampling_params import SamplingParams, excerpt

MAX_LOGPROBS = SamplingParams.MAX_LOGPROBS


class _Strict(BaseModel):
    # JSON types as sent: no booleans as numbers, no numbers as strings, integers where integers are meant,
    # no Infinity/NaN (Python's JSON reads those literals)
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: usage so far in every chunk


class ReplyOptions(NamedTuple):
    """What a reply shows beside the text, as the request asked."""

    include_usage: bool  # streamed: a last chunk with the usage
    continuous_usage: bool  # streamed: the usage so far in every chunk (vLLM's continuous_usage_stats)
    logprobs: int | None  # each token's logprob and this many most likely (None: no logprobs)
    token_ids: bool  # vLLM's return_token_ids: the prompt's and the completion's token ids
    tokens_as_ids: bool  # vLLM's return_tokens_as_token_ids: logprobs name tokens as "token_id:N"


# vLLM's and SGLang's request fields that jaxserve does not implement, with the values that mean "off": refused by
# name when set otherwise, never ignored (the rest of their fields are honoured, see _SamplingRequest)
PEER_FIELDS_OFF: dict[str, tuple] = {
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "include_stop_str_in_output": (False,),
    "spaces_between_special_tokens": (True,),
    "logprob_token_ids": (),
    "truncation_side": ("left",),
    "priority": (0,),
    "kv_transfer_params": (),
    "vllm_xargs": (),
    "structural_tag": (),
    "chat_template": (),
    "chat_template_kwargs": (),
    "documents": (),
    "mm_processor_kwargs": (),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "return_hidden_states": (False,),
    "stop_regex": (),
    "ebnf": (),
    "json_schema": (),
    "no_stop_trim": (False,),
    "lora_path": (),
    "session_params": (),
    "custom_logit_processor": (),
    "custom_params": (),
    "return_text_in_logprobs": (),
}


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
    regex: str | None = None  # SGLang's name of guided_regex
    # vLLM's reply extensions
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: the context's worth)
    prompt_logprobs: int | None = None  # each prompt token's logprob and rank, and this many most likely
    # vLLM's sampling extensions
    allowed_token_ids: list[int] | None = None  # sample only these tokens
    bad_words: list[str] | None = None  # words the reply never contains
    skip_special_tokens: bool = True  # False: control tokens' text stays in the reply
    # informational (how to log or shard the cache; vLLM's and SGLang's): change no output
    request_id: str | None = None
    cache_salt: str | None = None
    rid: str | None = None
    # vLLM's and SGLang's fields not implemented (PEER_FIELDS_OFF), declared so that none is ignored
    use_beam_search: bool = False
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    logprob_token_ids: list[int] | None = None
    truncation_side: str | None = None
    priority: int = 0
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    structural_tag: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    return_hidden_states: bool = False
    stop_regex: Any = None
    ebnf: Any = None
    json_schema: Any = None
    no_stop_trim: bool = False
    lora_path: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    custom_params: Any = None
    return_text_in_logprobs: Any = None

    def sampling(self) -> dict[str, Any]:
        """Keyword arguments for Frontend.submit; ValueError names an option jaxserve does not implement."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        for name, off in self._off_values().items():
            value = getattr(self, name)
            if value not in (None, {}, []) and value not in off:
                raise ValueError(f"{name}={excerpt(value)} is not supported by jaxserve")
        return dict(
            max_tokens=self._max_tokens(),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            ttft_slo=self.ttft_slo,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_p=self.min_p,
            min_tokens=self.min_tokens,
            logit_bias=self._logit_bias(),
            logprobs=self._logprobs(),
            n=self.n,
            best_of=self._best_of(),
            structured_output=self._structured_output(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            skip_special_tokens=self.skip_special_tokens,
        )

    def _off_values(self) -> dict[str, Any]:
        """Options jaxserve does not implement, with the values that mean "off"."""
        return dict(PEER_FIELDS_OFF)

    def reply_options(self) -> ReplyOptions:
        usage = self.stream_options or StreamOptions()
        return ReplyOptions(
            usage.include_usage,
            usage.continuous_usage_stats,
            self._logprobs(),
            self.return_token_ids,
            self.return_tokens_as_token_ids,
        )

    def prompt_logprobs_k(self) -> int | None:
        """How many most likely tokens each prompt position lists (vLLM's prompt_logprobs), or None."""
        k = self.prompt_logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {k}")
        return k

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as served: with truncate_prompt_tokens k its last k tokens (-1: the context's worth)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        if k == -1:
            k = max_model_len
        if k < 1:
            raise ValueError(f"truncate_prompt_tokens must be -1 or an integer >= 1, got {k}")
        return ids[-k:]

    def _structured_output(self) -> dict[str, Any] | None:
        """The grammar asked for, as StructuredOutput's fields (None: free text)."""
        given = {
            name: value
            for name, value in (
                ("response_format", self._response_format()),
                ("structured_outputs", self.structured_outputs),
                ("guided_json", None if self.guided_json is None else {"json": self.guided_json}),
                ("guided_regex", None if self.guided_regex is None else {"regex": self.guided_regex}),
                ("regex", None if self.regex is None else {"regex": self.regex}),
                ("guided_choice", None if self.guided_choice is None else {"choice": self.guided_choice}),
                ("guided_grammar", None if self.guided_grammar is None else {"grammar": self.guided_grammar}),
            )
            if value is not None
        }
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
        raise ValueError(
            f"response_format type must be text, json_object or json_schema, got {excerpt(rf.get('type'))}"
        )

    def _best_of(self) -> int | None:
        return None

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bad = [key for key in self.logit_bias if not key.isdigit()]
        if bad:  # every one named
            raise ValueError(f"logit_bias keys must be token ids, got {excerpt(bad)}")
        return {int(key): value for key, value in self.logit_bias.items()}

    def _logprobs(self) -> int | None:
        return None

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

    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS before a text prompt

    def _off_values(self) -> dict[str, Any]:
        return {**super()._off_values(), "suffix": (), "add_special_tokens": (True,)}

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


def rendering(body: ChatCompletionRequest | TokenizeRequest) -> dict[str, bool]:
    """How the chat template renders a body's messages (LLM.chat_prompt's keywords)."""
    return dict(add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message)


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
    # vLLM's chat extensions
    add_generation_prompt: bool = True  # open the assistant's turn after the messages
    continue_final_message: bool = False  # end inside the last message: the model continues it (a prefilled reply)
    echo: bool = False  # the reply's content starts with the last message's, where that is the assistant's
    add_special_tokens: bool = False  # not implemented: the template writes the control tokens

    def _off_values(self) -> dict[str, Any]:
        return {
            **super()._off_values(),
            "functions": (),
            "function_call": ("none",),
            "audio": (),
            "modalities": (["text"],),
            "prediction": (),
            "reasoning_effort": (),
            "verbosity": (),
            "web_search_options": (),
            "moderation": (),
            "store": (False,),
            "service_tier": ("auto", "default"),
            "prompt_cache_retention": ("in_memory",),
            "prompt_cache_options": (),
            "add_special_tokens": (False,),
        }

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def echoed(self) -> str | None:
        """With echo: the text the reply's content starts with, the last message's where it is the assistant's."""
        last = self.messages[-1] if self.messages else None
        if not self.echo or last is None or last.role != "assistant":
            return None
        return last.as_dict()["content"]

    def tool_plan(self, template: str | None) -> tool_calls.ToolPlan | None:
        """The tools' prompt, grammar and reader (None without tools or a tool_choice); ValueError names a bad
        one, or a grammar asked for twice (response_format and a required call)."""
        if self.tools is None and self.tool_choice is None:
            return None
        tools = tool_calls.parse_tools(self.tools or [])
        choice = tool_calls.parse_choice(self.tool_choice, tools)
        plan = tool_calls.plan([m.as_dict() for m in self.messages], tools, choice, template, self.parallel_tool_calls)
        if plan.structured_output is not None and self._structured_output() is not None:
            raise ValueError(
                "tools hold the output to their calls: give no response_format or guided fields "
                "with them (or tool_choice none)"
            )
        return plan

    def _logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None


class _Exact(_Strict):
    # jaxserve's own endpoints (vLLM's shapes): a field they do not know is refused, never ignored
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TokenizeRequest(_Exact):
    """POST /tokenize (vLLM's shape): a prompt, or a conversation rendered by the chat template (with the tools
    it offers, as /v1/chat/completions renders them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # the tokenizer's BOS before a prompt (default: yes; never on messages)
    add_generation_prompt: bool = True  # messages: open the assistant's turn
    continue_final_message: bool = False  # messages: end inside the last one
    tools: list[Any] | None = None  # messages: the functions offered
    return_token_strs: bool = False  # each token's text beside its id

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is not None and self.add_special_tokens:
            raise ValueError(
                "add_special_tokens=true is not supported with messages: the chat template writes the control tokens"
            )
        if self.prompt is not None and (
            self.tools is not None or not self.add_generation_prompt or self.continue_final_message
        ):
            raise ValueError(
                "tools, add_generation_prompt and continue_final_message apply to messages, not to a prompt"
            )

    def tool_plan(self, template: str | None) -> tool_calls.ToolPlan | None:
        """The tools as a chat request with tool_choice auto renders them (None without tools)."""
        if self.tools is None:
            return None
        tools = tool_calls.parse_tools(self.tools)
        return tool_calls.plan([m.as_dict() for m in self.messages], tools, "auto", template)


class DetokenizeRequest(_Exact):
    """POST /detokenize (vLLM's shape): token ids back to text."""

    model: str | None = None
    tokens: list[int]
