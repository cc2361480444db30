"""Incremental detokenization: text deltas for a growing list of token ids in O(1) decode work per token."""

from __future__ import annotations

from jaxserve.models.tokenizer import TextTokenizer


class IncrementalDetokenizer:
    """Decodes only a short window of recent tokens each time (the vLLM scheme).

    `ids[prefix:read]` have been turned into text already; they are decoded again with the new tokens as
    context so that merges across token boundaries come out right. A delta ending in U+FFFD is an incomplete
    UTF-8 character and waits for the next token.
    """

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.prefix = 0
        self.read = 0

    def push(self, ids: list[int]) -> str:
        """New text produced by the tokens appended to `ids` since the last call."""
        before = self.tokenizer.decode(ids[self.prefix:self.read])
        after = self.tokenizer.decode(ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(ids)
        return after[len(before):]
