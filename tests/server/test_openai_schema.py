"""Nothing of OpenAI's request schemas is silently ignored: every field the installed openai package sends to
/v1/completions and /v1/chat/completions is honoured, informational (changes no output), or refused by name
unless it holds its "off" value. A field a newer openai package adds fails here until it is placed."""

from __future__ import annotations

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from jaxserve.server.openai_protocol import ChatCompletionRequest, CompletionRequest

HONOURED = {
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "echo",
    "n",
    "best_of",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
}
INFORMATIONAL = {"user", "metadata", "safety_identifier", "prompt_cache_key"}
# a value each refused field may hold that asks for what jaxserve does not do
PROBES = {
    "suffix": "}",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "high",
    "verbosity": "low",
    "web_search_options": {"search_context_size": "low"},
    "moderation": {"model": "m"},
    "store": True,
    "service_tier": "flex",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": 60},
}
REQUESTS = [
    (CompletionRequest, completion_create_params.CompletionCreateParamsBase, {"prompt": "hi"}),
    (
        ChatCompletionRequest,
        chat_create_params.CompletionCreateParamsBase,
        {"messages": [{"role": "user", "content": "hi"}]},
    ),
]


def schema_fields(params: type) -> set[str]:
    return set(params.__annotations__) | {"stream"}  # stream: in the streaming / non-streaming subclasses


@pytest.mark.parametrize("model, params, base", REQUESTS, ids=["completions", "chat"])
def test_every_schema_field_is_placed(model, params, base):
    fields = schema_fields(params)
    assert fields <= set(model.model_fields), fields - set(model.model_fields)
    refused = fields - HONOURED - INFORMATIONAL
    assert refused <= set(PROBES), refused - set(PROBES)


@pytest.mark.parametrize("model, params, base", REQUESTS, ids=["completions", "chat"])
def test_each_unimplemented_field_is_refused_by_name_and_accepted_when_off(model, params, base):
    body = {"model": "m", **base}
    model(**body).sampling()
    fields = schema_fields(params)
    for name in sorted(fields - HONOURED - INFORMATIONAL):
        probe = PROBES[name]
        with pytest.raises(ValueError, match=f"^{name}=.* is not supported by jaxserve"):
            model(**body, **{name: probe}).sampling()
        off = model.model_fields[name].default
        model(**body, **{name: off}).sampling()  # its default, sent explicitly
    for name in fields & INFORMATIONAL:
        model(**body, **{name: {"k": "v"} if name == "metadata" else "someone"}).sampling()


@pytest.mark.parametrize("model, params, base", REQUESTS, ids=["completions", "chat"])
def test_honoured_sampling_fields_reach_the_sampling_params(model, params, base):
    body = {
        "model": "m",
        **base,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logit_bias": {"42": 5.0},
        "repetition_penalty": 1.2,
        "min_p": 0.1,
        "min_tokens": 4,
        "n": 2,
    }
    body |= {"logprobs": 3} if model is CompletionRequest else {"logprobs": True, "top_logprobs": 3}
    got = model(**body).sampling()
    assert {
        k: got[k]
        for k in (
            "presence_penalty",
            "frequency_penalty",
            "logit_bias",
            "repetition_penalty",
            "min_p",
            "min_tokens",
            "logprobs",
            "n",
        )
    } == {
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logit_bias": {42: 5.0},
        "repetition_penalty": 1.2,
        "min_p": 0.1,
        "min_tokens": 4,
        "logprobs": 3,
        "n": 2,
    }
    with pytest.raises(ValueError, match=r"logit_bias keys must be token ids, got \['x', 'y'\]"):
        model(**{**body, "logit_bias": {"x": 1.0, "7": 1.0, "y": 2.0}}).sampling()


def test_chat_logprobs_need_logprobs_true_for_top_logprobs():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest(**chat, logprobs=True).sampling()["logprobs"] == 0
    assert ChatCompletionRequest(**chat).sampling()["logprobs"] is None
    with pytest.raises(ValueError, match="top_logprobs needs logprobs=true"):
        ChatCompletionRequest(**chat, top_logprobs=2).sampling()


def test_best_of_cannot_stream():
    body = {"model": "m", "prompt": "hi", "n": 2, "best_of": 3}
    assert CompletionRequest(**body).sampling()["best_of"] == 3
    with pytest.raises(ValueError, match="best_of > n cannot stream"):
        CompletionRequest(**body, stream=True).sampling()


@pytest.mark.parametrize("model, params, base", REQUESTS, ids=["completions", "chat"])
def test_response_format_and_vllms_guided_fields_set_the_grammar(model, params, base):
    body = {"model": "m", **base}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
            {"json": schema},
        ),
        ({"guided_json": schema}, {"json": schema}),
        ({"guided_regex": "a+"}, {"regex": "a+"}),
        ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
        ({"guided_grammar": 'start: "a"'}, {"grammar": 'start: "a"'}),
        (
            {"structured_outputs": {"regex": "b", "disable_any_whitespace": True}},
            {"regex": "b", "disable_any_whitespace": True},
        ),
    ]
    for extra, want in cases:
        assert model(**body, **extra).sampling()["structured_output"] == want
    for extra, words in [
        ({"response_format": {"type": "xml"}}, "type must be text, json_object or json_schema"),
        ({"response_format": {"type": "json_schema"}}, "needs json_schema.schema"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "at most one of"),
    ]:
        with pytest.raises(ValueError, match=words):
            model(**body, **extra).sampling()


# vLLM's and SGLang's fields not implemented: a value each may hold that asks for what jaxserve does not do
PEER_PROBES = {
    "use_beam_search": True,
    "length_penalty": 0.5,
    "include_stop_str_in_output": True,
    "spaces_between_special_tokens": False,
    "logprob_token_ids": [3],
    "truncation_side": "right",
    "priority": 1,
    "kv_transfer_params": {"k": 1},
    "vllm_xargs": {"k": 1},
    "structural_tag": "t",
    "chat_template": "{{ x }}",
    "chat_template_kwargs": {"k": 1},
    "documents": [{"k": "v"}],
    "mm_processor_kwargs": {"k": 1},
    "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ",
    "return_hidden_states": True,
    "stop_regex": "a+",
    "ebnf": "root ::= 'a'",
    "json_schema": "{}",
    "no_stop_trim": True,
    "lora_path": "x",
    "session_params": {"id": 1},
    "custom_logit_processor": "x",
    "custom_params": {"k": 1},
    "return_text_in_logprobs": True,
}
CHAT_PEER_PROBES = {"add_special_tokens": True}


@pytest.mark.parametrize("model, params, base", REQUESTS, ids=["completions", "chat"])
def test_vllm_and_sglang_fields_not_implemented_are_refused_by_name(model, params, base):
    from jaxserve.server.openai_protocol import PEER_FIELDS_OFF

    assert set(PEER_PROBES) == set(PEER_FIELDS_OFF)
    body = {"model": "m", **base}
    probes = PEER_PROBES | (CHAT_PEER_PROBES if model is ChatCompletionRequest else {"add_special_tokens": False})
    for name, probe in probes.items():
        with pytest.raises(ValueError, match=f"^{name}=.* is not supported by jaxserve"):
            model(**body, **{name: probe}).sampling()
        model(**body, **{name: model.model_fields[name].default}).sampling()


def test_vllm_and_sglang_fields_that_are_honoured_reach_the_reply():
    from jaxserve.server.openai_protocol import ReplyOptions

    body = {
        "model": "m",
        "prompt": "hi",
        "stream": True,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "logprobs": 2,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    assert CompletionRequest(**body).reply_options() == ReplyOptions(True, True, 2, True, True)
    assert CompletionRequest(model="m", prompt="hi", regex="a|b").sampling()["structured_output"] == {"regex": "a|b"}
    ids = list(range(10))
    assert CompletionRequest(model="m", prompt="hi", truncate_prompt_tokens=3).truncated(ids, 8) == [7, 8, 9]
    assert CompletionRequest(model="m", prompt="hi", truncate_prompt_tokens=-1).truncated(ids, 8) == ids[2:]
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1 or an integer >= 1"):
        CompletionRequest(model="m", prompt="hi", truncate_prompt_tokens=0).truncated(ids, 8)
    with pytest.raises(ValueError, match="stream_options is only allowed with stream: true"):
        CompletionRequest(model="m", prompt="hi", stream_options={"include_usage": True}).sampling()


@pytest.mark.parametrize("key", ["clé", " key", "", "a\tb"])
def test_an_api_key_no_client_could_send_alike_on_both_interfaces_is_refused_at_start(key):
    """HTTP headers reach the server as bytes read as latin-1, gRPC metadata is printable ASCII only: any other
    key could never match on one of them."""
    from jaxserve.server.frontend import Frontend

    with pytest.raises(ValueError, match="API key must be printable ASCII"):
        Frontend(None, None, model_name="m", api_key=key)
    Frontend(None, None, model_name="m", api_key="sk-Good_key.123")
