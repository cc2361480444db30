"""vLLM's bad_words: words a reply never contains, as token sequences whose last token is banned.

A word is tokenized as vLLM does (both at the text's start and after a space, where that gives another first token
of the same length). A one-token word is banned at every step: the device's logit bias holds -inf for it
(sampling.Slots.bias). A longer one bans its last token only where the tokens generated just before are the
word's others, which the host knows once it has read them: such a request samples one token a step, its mask
made on the host as a grammar's is (engine.py, `_sample_guided`).
"""

from __future__ import annotations

from typing import Sequence

from jaxserve.models.tokenizer import TextTokenizer

MAX_SEQUENCES = 128  # token sequences of one request's bad words (vLLM's VLLM_MAX_NUM_BAD_WORDS default)
MAX_TOKENS = 1024  # their tokens in all (vLLM's MAX_BAD_WORDS_TOTAL_TOKENS): each step compares them on the host


def sequences(words: Sequence[str], tokenizer: TextTokenizer, vocab_size: int) -> list[tuple[int, ...]]:
    """Each word's token sequences, or ValueError naming the problem."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ValueError(f"bad word {word!r} has no tokens")
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):  # a word after a space
            out.append(spaced)
    if len(out) > MAX_SEQUENCES:
        raise ValueError(f"bad_words make {len(out)} token sequences; at most {MAX_SEQUENCES}")
    if sum(map(len, out)) > MAX_TOKENS:
        raise ValueError(f"bad_words make {sum(map(len, out))} tokens; at most {MAX_TOKENS} in all")
    if any(t >= vocab_size for s in out for t in s):
        raise ValueError(f"bad_words tokenize to ids outside the model's [0, {vocab_size})")
    return out


class BadWords:
    """The longer sequences of one request, following the tokens it generates."""

    def __init__(self, longer: Sequence[tuple[int, ...]], generated: Sequence[int] = ()):
        self.longer = list(longer)
        self._keep = max(len(s) for s in self.longer) - 1
        self._tail: tuple[int, ...] = tuple(generated)[-self._keep :]

    def consume_token(self, token: int) -> None:
        self._tail = (*self._tail, token)[-self._keep :]

    def banned(self) -> list[int]:
        """Tokens the next step may not sample: each sequence's last, where the tokens generated before it are
        its others (vLLM compares the generated tokens only, never the prompt)."""
        return [
            s[-1]
            for s in self.longer
            if len(self._tail) >= len(s) - 1 and self._tail[len(self._tail) - len(s) + 1 :] == s[:-1]
        ]
