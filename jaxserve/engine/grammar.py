"""Structured output on the host: a request's grammar as the mask of tokens its next step may sample.

llguidance (docs/BENCHMARKS.md says why this library) compiles a JSON schema, regex, choice or Lark grammar
against the model's tokenizer and fills each step's masks for all guided rows at once, in its own threads. A
mask is a bitmask, one int32 word per 32 tokens: token i is allowed when bit i % 32 of word i // 32 is set. The
sampler on the device applies it (sampling.allowed). A request's matcher follows every token it keeps.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Sequence

import llguidance
import llguidance.numpy as llnp
import numpy as np
from jaxtyping import Int

from jaxserve.models.tokenizer import TextTokenizer
from jaxserve.sampling_params import StructuredOutput, grammar_error

COMPILED = 256  # grammars kept compiled (a request copies its grammar's compiled matcher)


def words(vocab_size: int) -> int:
    """int32 words of one row's mask."""
    return -(-vocab_size // 32)


def everything(rows: int, vocab_size: int) -> Int[np.ndarray, "r w"]:
    """Masks that allow every token."""
    return np.full((rows, words(vocab_size)), -1, np.int32)


class Grammars:
    """The model's grammars: matchers for requests, masks for steps."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int):
        self.vocab_size = vocab_size
        self._tokenizer, self._lltok, self._lltok_error = tokenizer, None, None
        self._executor = llguidance.LLExecutor(num_threads=max(os.cpu_count() or 1, 1))
        self._compiled: collections.OrderedDict[StructuredOutput, llguidance.LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()  # requests are checked in the server's threads, matched in the engine's

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        """The tokenizer as llguidance reads it (built at first use: a tenth of a second for 49K tokens)."""
        if self._lltok is None and self._lltok_error is None:
            eos = sorted(self._tokenizer.stop_ids)  # all of them: a grammar may end with the turn's end (<|im_end|>)
            try:
                self._lltok = llguidance.LLTokenizer(
                    self._tokenizer.tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=eos or None
                )
            except Exception as e:  # noqa: BLE001 - e.g. the random models' word tokenizer
                self._lltok_error = f"this model's tokenizer cannot drive a grammar ({e})"
        if self._lltok is None:
            raise ValueError(self._lltok_error)
        return self._lltok

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for one request, or ValueError naming what is wrong with the grammar."""
        return self.compiled(spec).deep_copy()

    def compiled(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """The grammar compiled (kept for the next request with it), or ValueError naming what is wrong with it.
        A new grammar compiles outside the lock: a long one does not hold up the engine's matchers meanwhile."""
        with self._lock:
            compiled = self._compiled.get(spec)
            tokenizer = self._llguidance_tokenizer()
        if compiled is None:
            compiled = llguidance.LLMatcher(tokenizer, spec.grammar_text(), log_level=0)
            if compiled.is_error():
                raise ValueError(grammar_error(compiled.get_error()))
        with self._lock:
            self._compiled[spec] = compiled
            self._compiled.move_to_end(spec)
            if len(self._compiled) > COMPILED:
                self._compiled.popitem(last=False)
        return compiled

    def masks(
        self, matchers: Sequence[llguidance.LLMatcher | None], banned: Sequence[Sequence[int]] = ()
    ) -> Int[np.ndarray, "r w"]:
        """A step's masks: row i's from matchers[i], every token where it has none or its matcher is done (a
        stopped request's surplus row); then the tokens of banned[i] cleared."""
        mask = everything(len(matchers), self.vocab_size)
        live = [(m, i) for i, m in enumerate(matchers) if m is not None and not (m.is_stopped() or m.is_error())]
        if live:
            llnp.fill_next_token_bitmask_par(self._executor, live, mask)
        bits = mask.view(np.uint32)  # bit 31 is the sign of an int32 word
        for i, tokens in enumerate(banned):
            for t in tokens:
                bits[i, t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
        return mask
