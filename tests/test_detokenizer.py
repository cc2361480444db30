"""Incremental detokenization gives exactly the full decode, multi-byte characters included."""

from __future__ import annotations

import pytest

from jaxserve.engine.detokenizer import IncrementalDetokenizer


@pytest.mark.parametrize("text", [
    "Unicode: café, naïve, 東京, emoji 🙂🎉 and ümlauts.",
    "def f(x):\n    return x ** 2  # square",
    "<|im_start|>assistant\nHello<|im_end|> after",
    "   spaces   and\ttabs\n\n",
])
def test_deltas_concatenate_to_the_full_decode(llm, text):
    ids = llm.tokenizer.encode(text)
    detok = IncrementalDetokenizer(llm.tokenizer)
    deltas = [detok.push(ids[: i + 1]) for i in range(len(ids))]
    assert "".join(deltas) == llm.tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
