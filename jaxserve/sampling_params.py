"""Per-request sampling parameters, as a client gives them (vLLM's SamplingParams). Plain Python: the
command line, the servers and the scheduler's callers use it without starting JAX."""

from __future__ import annotations

import dataclasses
import functools
import math


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. temperature 0 is greedy (the default)."""

    max_tokens: int = 128
    temperature: float = 0.0  # below 1e-5 counts as 0 (greedy), as in vLLM
    top_k: int = 0  # 0 or -1: no top-k cut
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh random seed per request
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        # vLLM-style spellings are accepted and normalised: lists, None, top_k=-1, a single stop string.
        set_ = functools.partial(object.__setattr__, self)
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        set_("stop", tuple(stop))
        set_("stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            set_("top_k", 0)
        if isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool) \
                and 0 <= self.temperature < 1e-5:
            set_("temperature", 0.0)
        self.validate()

    MAX_STOP = 64  # stop strings (and stop token ids: MAX_STOP_TOKEN_IDS) a request may give
    MAX_STOP_CHARS = 1024
    MAX_STOP_TOKEN_IDS = 1024

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        def integer(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def number(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        need(integer(self.max_tokens), f"max_tokens must be an integer, got {excerpt(self.max_tokens, 40)}")
        need(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        need(number(self.temperature) and self.temperature >= 0,
             f"temperature must be a finite number >= 0, got {excerpt(self.temperature, 40)}")
        need(integer(self.top_k) and 0 <= self.top_k < 2**31,
             f"top_k must be -1, 0 (no cut) or an integer < 2**31, got {excerpt(self.top_k, 40)}")
        need(number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {excerpt(self.top_p, 40)}")
        need(self.seed is None or (integer(self.seed) and 0 <= self.seed < 2**32),
             f"seed must be an integer in [0, 2**32), got {excerpt(self.seed, 40)}")
        need(len(self.stop) <= self.MAX_STOP, f"at most {self.MAX_STOP} stop strings, got {len(self.stop)}")
        need(all(isinstance(s, str) and 0 < len(s) <= self.MAX_STOP_CHARS for s in self.stop),
             f"stop must be non-empty strings of at most {self.MAX_STOP_CHARS} characters")
        need(len(self.stop_token_ids) <= self.MAX_STOP_TOKEN_IDS,
             f"at most {self.MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
        need(all(integer(t) and 0 <= t < 2**31 for t in self.stop_token_ids),
             "stop_token_ids must be token ids (integers >= 0)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def excerpt(value: object, limit: int = 64) -> str:
    """repr of a client's value for an error message, cut short: input is never echoed at length."""
    r = repr(value)
    return r if len(r) <= limit else f"{r[:limit]}... ({len(r)} characters)"
