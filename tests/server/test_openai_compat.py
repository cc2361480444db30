"""The API as OpenAI's own client and vLLM's and SGLang's tests see it (../shared/reviews/api_peers.md): each
test is one behaviour a migrating user relies on, driven through the official `openai` client where it can be."""

from __future__ import annotations

import http.client
import json
import socket

import openai
import pytest

from jaxserve import SamplingParams
from serving import KEY, MODEL, PROMPT, free_blocks, initial_blocks, post, wait_until


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ],
)
def test_stream_options_without_stream_is_refused(served, path, body):
    status, reply = post(served, path, json.dumps({**body, "stream_options": {"include_usage": True}}))
    assert status == 400 and "stream_options is only allowed with stream" in reply["error"]["message"]


def test_the_served_model_is_retrieved_and_an_unknown_one_is_not_found(oai):
    card = oai.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError, match="unknown model 'gpt-9'"):
        oai.models.retrieve("gpt-9")
    with pytest.raises(openai.NotFoundError, match="unknown model 'gpt-9'"):  # OpenAI and vLLM: 404, not 400
        oai.completions.create(model="gpt-9", prompt=PROMPT, max_tokens=2)


def test_the_echo_of_a_token_id_prompt_keeps_its_control_tokens_and_offsets_agree(llm, oai):
    """The echoed text is the ids' text as logprobs list them (control tokens included); text_offset never goes
    back and never past the text, for control tokens and for a character split over tokens."""
    ids = [0] * 5
    done = oai.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, echo=True, logprobs=1)
    choice = done.choices[0]
    spelled = llm.tokenizer.decode(ids, skip_special_tokens=False)
    assert spelled and choice.text.startswith(spelled)
    assert "".join(choice.logprobs.tokens[:5]) == spelled
    offsets = choice.logprobs.text_offset
    assert offsets == sorted(offsets) and offsets[5] == len(spelled) and offsets[-1] <= len(choice.text)

    text = "I like \U0001f355 a lot"  # the emoji is several byte-level tokens
    assert len(llm.tokenizer.encode(text)) > len(text.split())
    scored = oai.completions.create(model=MODEL, prompt=text, max_tokens=3, temperature=0, echo=True, logprobs=1)
    offsets, n = scored.choices[0].logprobs.text_offset, len(llm.tokenizer.encode(text))
    assert offsets == sorted(offsets) and all(o <= len(text) for o in offsets[:n]) and offsets[n] == len(text)


def test_a_forced_tool_call_cut_short_returns_no_content(oai):
    """tool_choice required or named, out of tokens before the call closes: finish_reason length, no content
    (never the call's unfinished text), no calls."""
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = oai.chat.completions.create(
            model=MODEL, messages=messages, tools=[weather], tool_choice=choice, max_tokens=3, temperature=0
        ).choices[0]
        assert reply.finish_reason == "length"
        assert reply.message.content is None and not reply.message.tool_calls


def test_any_64_bit_seed_is_taken_and_draws_as_the_python_api(llm, oai):
    for seed in (2**40, -7, 2**63 - 1):
        (ref,) = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=seed))
        done = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=seed)
        assert done.choices[0].text == ref.text
    # seeds 2**32 apart draw apart (the 64 bits are mixed into the draws' 32); in [0, 2**32) as given
    assert SamplingParams(seed=5).draw_seed() == 5
    assert SamplingParams(seed=2**40).draw_seed() != SamplingParams(seed=2**40 + 2**32).draw_seed()
    with pytest.raises(openai.BadRequestError, match="seed must be a 64-bit signed integer"):
        oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, seed=2**63)


def test_a_client_that_leaves_a_whole_reply_is_no_server_error(served):
    """A non-streamed request whose client times out: the request is aborted, its blocks come back, and the
    server records no error of its own (it answered 500 and logged InvalidStateError before)."""
    internal = served.server.engine.metrics.errors.labels("internal")
    before = internal._value.get()
    conn = http.client.HTTPConnection("127.0.0.1", served.server.http_port, timeout=1.0)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps(body),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    with pytest.raises(socket.timeout):
        conn.getresponse()
    conn.close()
    wait_until(lambda: free_blocks(served) == initial_blocks(served), timeout=60)
    assert internal._value.get() == before
    status, reply = post(served, "/v1/completions", json.dumps({**body, "max_tokens": 2}))
    assert status == 200 and reply["choices"][0]["finish_reason"] == "length"


def test_every_reply_carries_a_request_id_and_the_version_is_served(served, oai):
    raw = oai.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert len(raw.headers["x-request-id"]) == 32
    mine = oai.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, extra_headers={"X-Request-Id": "trace-42"}
    )
    assert mine.headers["x-request-id"] == "trace-42"
    conn = http.client.HTTPConnection("127.0.0.1", served.server.http_port, timeout=30)
    conn.request("GET", "/version", headers={"Authorization": f"Bearer {KEY}"})
    reply = conn.getresponse()
    assert reply.status == 200 and reply.getheader("x-request-id")
    assert json.loads(reply.read())["version"]
    conn.request("GET", "/v1/models", headers={"X-Request-Id": "x" * 500})  # no key: refused, with a new id
    refused = conn.getresponse()
    assert refused.status == 401 and len(refused.getheader("x-request-id")) == 32
    refused.read()
    conn.close()


def test_the_finish_reason_rides_on_the_last_tokens_chunk(llm, oai):
    """As vLLM streams: no chunk of its own for the finish reason, so a choice of max_tokens n has n chunks."""
    (ref,) = llm.generate(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))
    chunks = list(
        oai.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert len(chunks) <= 5 and "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].choices[0].text
    messages = [{"role": "user", "content": "Name a fruit."}]
    (chat_ref,) = llm.chat(messages, SamplingParams(max_tokens=6))
    chat = list(oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chat) == chat_ref.text
    last = chat[-1].choices[0]
    assert last.finish_reason == chat_ref.finish_reason and (last.delta.content or chat_ref.finish_reason == "stop")


def test_vllm_token_id_extensions_are_the_python_apis(llm, oai):
    """return_token_ids (whole and streamed, both endpoints), return_tokens_as_token_ids, truncate_prompt_tokens."""
    ids = llm.tokenizer.encode(PROMPT)
    (ref,) = llm.generate(PROMPT, SamplingParams(max_tokens=6, logprobs=1))
    done = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=1,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
    )
    choice = done.choices[0].model_dump()
    assert (choice["prompt_token_ids"], choice["token_ids"]) == (ids, ref.token_ids)
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in ref.token_ids]
    assert choice["text"] == ref.text and choice["logprobs"]["text_offset"][-1] < len(ref.text)
    chunks = [
        c.choices[0].model_dump()
        for c in oai.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True, extra_body={"return_token_ids": True}
        )
    ]
    assert chunks[0]["prompt_token_ids"] == ids and [t for c in chunks for t in c["token_ids"]] == ref.token_ids

    messages = [{"role": "user", "content": "Name a fruit."}]
    (chat_ref,) = llm.chat(messages, SamplingParams(max_tokens=6))
    chat = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
    ).model_dump()
    assert chat["prompt_token_ids"] == llm.chat_prompt(messages)
    assert chat["choices"][0]["token_ids"] == chat_ref.token_ids

    (cut,) = llm.generate(ids[-3:], SamplingParams(max_tokens=4))
    short = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, extra_body={"truncate_prompt_tokens": 3}
    )
    assert short.usage.prompt_tokens == 3 and short.choices[0].text == llm.tokenizer.decode(ids[-3:]) + cut.text


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(oai):
    chunks = list(
        oai.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
    )
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts) and counts[-1] == 5
    assert not chunks[-1].choices  # include_usage's own chunk last


def test_sglang_regex_holds_the_output_and_unbuilt_extensions_are_refused_by_name(oai):
    done = oai.completions.create(
        model=MODEL, prompt="Answer yes or no:", max_tokens=4, temperature=0, extra_body={"regex": "(yes|no)"}
    )
    assert done.choices[0].text in ("yes", "no")
    for field, value in (("use_beam_search", True), ("stop_regex", "a+")):
        with pytest.raises(openai.BadRequestError, match=f"{field}=.* is not supported by jaxserve"):
            oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={field: value})


def test_vllm_prompt_logprobs_on_both_endpoints_are_the_python_apis(llm, oai):
    """Per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}: the token's own first,
    then the k most likely; the logprobs are LLM.prompt_logprobs', the ranks 1 for the most likely."""
    ref = llm.prompt_logprobs(PROMPT, 2)
    ids = llm.tokenizer.encode(PROMPT)
    done = (
        oai.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
        )
        .choices[0]
        .model_dump()
    )
    got = done["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    logits = llm.prompt_logits(ids)  # each rank against the logits, counted here
    assert [x.rank for x in ref[1:]] == [1 + int((row > row[t]).sum()) for row, t in zip(logits[:-1], ids[1:])]
    for token, entries, want in zip(ids[1:], got[1:], ref[1:]):
        own = entries[str(token)]
        assert abs(own["logprob"] - want.logprob) <= 1e-4 * max(1.0, abs(want.logprob))
        assert own["rank"] == want.rank >= 1 and own["decoded_token"] == llm.tokenizer.tokenizer.decode([token])
        assert 1 <= len(entries) <= 3 and min(e["rank"] for e in entries.values()) == 1
    messages = [{"role": "user", "content": "Name a fruit."}]
    chat = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0}
    ).model_dump()
    assert len(chat["prompt_logprobs"]) == len(llm.chat_prompt(messages)) and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs must be an integer in"):
        oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": -1})


def test_a_prefilled_assistant_reply_continues_and_echo_returns_it(llm, oai):
    """vLLM's continue_final_message (with add_generation_prompt false): the prompt ends inside the assistant's
    message, the model continues it; chat echo puts that message's content before the reply's."""
    messages = [{"role": "user", "content": "List three colors."}, {"role": "assistant", "content": "Red, green"}]
    ids = llm.chat_prompt(messages, add_generation_prompt=False, continue_final_message=True)
    assert llm.tokenizer.decode(ids).endswith("Red, green")
    (ref,) = llm.generate(ids, SamplingParams(max_tokens=6))
    flags = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    done = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body=flags)
    assert done.choices[0].message.content == "Red, green" + ref.text
    assert done.usage.prompt_tokens == len(ids)
    chunks = list(
        oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True, extra_body=flags
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Red, green" + ref.text
    with pytest.raises(openai.BadRequestError, match="continue_final_message continues the last message"):
        oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, extra_body={"continue_final_message": True}
        )


def test_tokenize_takes_vllms_options(llm, served):
    status, plain = post(served, "/tokenize", json.dumps({"prompt": PROMPT, "return_token_strs": True}))
    assert status == 200 and plain["tokens"] == llm.tokenizer.encode(PROMPT)
    assert plain["token_strs"] == [llm.tokenizer.tokenizer.decode([t]) for t in plain["tokens"]]
    _, bare = post(served, "/tokenize", json.dumps({"prompt": PROMPT, "add_special_tokens": False}))
    assert bare["tokens"] == llm.tokenizer.encode(PROMPT, add_special_tokens=False)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    _, cont = post(
        served,
        "/tokenize",
        json.dumps({"messages": messages, "add_generation_prompt": False, "continue_final_message": True}),
    )
    assert cont["tokens"] == llm.chat_prompt(messages, add_generation_prompt=False, continue_final_message=True)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    _, tooled = post(served, "/tokenize", json.dumps({"messages": messages[:1], "tools": [weather]}))
    _, untooled = post(served, "/tokenize", json.dumps({"messages": messages[:1]}))
    assert len(tooled["tokens"]) > len(untooled["tokens"])  # the tools are offered in the prompt


def test_matched_stop_names_what_ended_each_choice(llm, oai):
    """SGLang's matched_stop: the stop string, the stop token (EOS too), or null for a length finish."""
    (ref,) = llm.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    word = ref.text.split()[1]  # a word the greedy text is sure to reach
    done = (
        oai.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[word], extra_body={"ignore_eos": True}
        )
        .choices[0]
        .model_dump()
    )
    assert done["finish_reason"] == "stop" and done["matched_stop"] == word
    by_token = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [ref.token_ids[2]], "ignore_eos": True},
    )
    assert by_token.choices[0].model_dump()["matched_stop"] == ref.token_ids[2]
    long = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    last = list(long)[-1].choices[0].model_dump()
    assert last["finish_reason"] == "length" and last["matched_stop"] is None


def test_vllm_allowed_token_ids_and_bad_words_on_both_endpoints_and_grpc(llm, oai, grpc_client):
    """The HTTP fields and gRPC's reach the sampler: a draw over allowed_token_ids keeps to them; a bad word of
    the greedy reply is gone from it; an empty or out-of-vocabulary list is a 400 naming the field."""
    allowed = [11, 28, 42, 1000, 2000]
    drawn = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=1.0,
        seed=5,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True, "return_token_ids": True},
    )
    assert set(drawn.choices[0].token_ids) <= set(allowed)
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=6,
        temperature=0,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
    )
    assert set(chat.choices[0].token_ids) <= set(allowed)
    assert set(
        grpc_client.generate(PROMPT, max_tokens=6, temperature=1.0, seed=5, allowed_token_ids=allowed).token_ids
    ) <= set(allowed)

    plain = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    word = max(plain.split(), key=len)
    for reply in (
        oai.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"bad_words": [word]}
        )
        .choices[0]
        .text,
        grpc_client.generate(PROMPT, max_tokens=12, bad_words=[word]).text,
    ):
        assert word not in reply.split() and reply != plain
    for extra, field in (
        ({"allowed_token_ids": []}, "allowed_token_ids is empty"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids must be in"),
        ({"bad_words": [" "]}, "bad_words must be non-blank"),
    ):
        with pytest.raises(openai.BadRequestError, match=field):
            oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=extra)
