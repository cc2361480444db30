"""Incremental detokenization gives exactly the full decode, multi-byte characters included."""

from __future__ import annotations

import pytest

from jaxserve.engine.detokenizer import IncrementalDetokenizer


@pytest.mark.parametrize(
    "text",
    [
        "Unicode: café, naïve, 東京, emoji 🙂🎉 and ümlauts.",
        "def f(x):\n    return x ** 2  # square",
        "<|im_start|>assistant\nHello<|im_end|> after",
        "   spaces   and\ttabs\n\n",
    ],
)
@pytest.mark.parametrize("prompt", ["", "Some prompt context:"])
def test_deltas_concatenate_to_the_full_decode(llm, text, prompt):
    prompt_ids = llm.tokenizer.encode(prompt)
    ids = llm.tokenizer.encode(text)
    detok = IncrementalDetokenizer(llm.tokenizer, prompt_ids)
    deltas = [detok.push(t) for t in ids]
    assert "".join(deltas) + detok.flush() == llm.tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_flush_returns_an_unfinished_character(llm):
    emoji = llm.tokenizer.encode("🙂")
    assert len(emoji) > 1  # byte-level pieces
    detok = IncrementalDetokenizer(llm.tokenizer, [])
    assert detok.push(emoji[0]) == ""
    assert detok.flush() == llm.tokenizer.decode(emoji[:1])
