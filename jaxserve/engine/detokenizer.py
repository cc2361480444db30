"""Incremental detokenization: text deltas for a growing output in O(1) decode work per token."""

from __future__ import annotations

from typing import Sequence

from jaxserve.models.tokenizer import TextTokenizer

_PROMPT_CONTEXT = 6  # prompt tokens decoded as context, so a first output token keeps its leading space


class IncrementalDetokenizer:
    """Decodes only a short window of recent tokens each time (the vLLM scheme).

    `ids[prefix:read]` have been turned into text already; they are decoded again with the new tokens as
    context so that merges across token boundaries come out right. A delta ending in U+FFFD is an incomplete
    UTF-8 character and waits for the next token (or for `flush` at the end).
    """

    def __init__(self, tokenizer: TextTokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids = list(prompt_ids[-_PROMPT_CONTEXT:])
        self.prefix = 0
        self.read = len(self.ids)

    def _pending(self) -> tuple[str, str]:
        skip = self.skip_special_tokens
        return (
            self.tokenizer.decode(self.ids[self.prefix : self.read], skip_special_tokens=skip),
            self.tokenizer.decode(self.ids[self.prefix :], skip_special_tokens=skip),
        )

    def push(self, token: int) -> str:
        """The text that `token` completes ('' while a character is still incomplete)."""
        self.ids.append(token)
        before, after = self._pending()
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD), at the end of a request."""
        before, after = self._pending()
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]
