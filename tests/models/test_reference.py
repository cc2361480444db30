"""jaxserve against Hugging Face transformers (float32, same GGUF file): tokens, logits, greedy generations."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import SamplingParams


def test_tokenizer_matches_reference(llm, reference):
    for case in reference["tokenizer"]:
        assert llm.tokenizer.encode(case["text"]) == case["ids"], case["text"]
        assert llm.tokenizer.decode(case["ids"]) == case["text"].replace("<|im_start|>", "").replace("<|im_end|>", "")


def test_chat_template_matches_reference(llm, reference):
    for case in reference["chat_template"]:
        assert llm.render_chat(case["messages"]) == case["text"]


def test_prefill_logits_match_reference(llm, reference):
    for case, ref in zip(reference["prefill"], reference["logits"]):
        got = llm.prompt_logits(case["ids"])[case["positions"]]
        np.testing.assert_allclose(got, ref, atol=1e-3, rtol=0)


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_greedy_generation_matches_reference(llm, reference, chat):
    cases = [c for c in reference["greedy"] if c["chat"] == chat]
    assert cases
    outs = llm.generate([c["ids"] for c in cases], SamplingParams(max_tokens=32))
    for case, out in zip(cases, outs):
        assert out.token_ids == case["tokens"], (out.text, case["text"])


def test_chat_api_renders_and_generates_reference(llm, reference):
    case = reference["chat_template"][0]
    greedy = next(c for c in reference["greedy"] if c["chat"])
    (out,) = llm.chat(case["messages"], SamplingParams(max_tokens=32))
    assert out.prompt_token_ids == greedy["ids"]
    assert out.token_ids == greedy["tokens"]
