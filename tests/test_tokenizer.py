"""Pre-tokenizer splits for the llama.cpp pre-tokenizer types the GGUF loader supports."""

from __future__ import annotations

import pytest

from jaxserve.models.tokenizer import _gguf_pre_tokenizer

TEXT = "Hello 12345 world's\n\n  end"


@pytest.mark.parametrize("pre, pieces", [
    # SmolLM: every digit alone, then GPT-2's byte-level regex.
    ("smollm", ["Hello", "Ġ", "1", "2", "3", "4", "5", "Ġworld", "'s", "ĊĊĠ", "Ġend"]),
    # Llama 3: digits in groups of up to three, newlines kept together.
    ("llama3", ["Hello", "Ġ", "123", "45", "Ġworld", "'s", "ĊĊ", "Ġ", "Ġend"]),
    # Plain GPT-2.
    ("gpt2", ["Hello", "Ġ12345", "Ġworld", "'s", "ĊĊĠ", "Ġend"]),
])
def test_pre_tokenizer_splits(pre, pieces):
    assert [p for p, _ in _gguf_pre_tokenizer(pre).pre_tokenize_str(TEXT)] == pieces
