"""A request as the scheduler sees it: sizes, deadlines and progress. Progress moves only in Scheduler.apply(),
from an Outcome, so the live engine and the simulator advance it the same way."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(eq=False)
class Request:
    id: str
    arrival: float
    prompt_len: int
    output_len: int  # tokens to generate: the trace's count in simulation, max_tokens on the engine
    ttft_deadline: float = math.inf  # absolute time by which the first token is due
    tpot_slo: float = math.inf  # seconds per output token after the first
    token_ids: list[int] | None = None  # prompt then generated ids (the engine's; None in simulation): prefix hashes
    # progress
    prefill_target: int = 0  # tokens to prefill: the prompt, or after a preemption everything but the last token
    planned: int = 0  # prefill tokens handed to executors (ahead of `prefilled` while chunks are in flight)
    prefilled: int = 0  # prefill tokens whose KV is computed
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    preemptions: int = 0
    generated: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    token_gaps: list[float] = dataclasses.field(default_factory=list)  # time between consecutive tokens

    def __post_init__(self):
        if self.prompt_len < 1:
            raise ValueError(f"request {self.id}: prompt_len must be >= 1, got {self.prompt_len}")
        if self.output_len < 1:
            raise ValueError(f"request {self.id}: output_len must be >= 1, got {self.output_len}")
        self.prefill_target = self.prefill_target or self.prompt_len

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < self.prefill_target

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    @property
    def kv_len(self) -> int:
        """Tokens whose KV is cached: the prefill so far, then the prompt plus generated tokens already fed back."""
        return self.prefilled if self.in_prefill else self.prompt_len + max(self.generated - 1, 0)

    def preempt(self) -> None:
        """Its KV is gone: recompute everything but the last generated token (fed by the next decode)."""
        self.prefill_target = self.prompt_len + max(self.generated - 1, 0)
        self.planned = self.prefilled = 0
        self.preemptions += 1

    def add_tokens(self, count: int, now: float) -> None:
        """Record `count` new output tokens produced at `now` (prefill's last chunk yields the first)."""
        for _ in range(count):
            if self.first_token_at is None:
                self.first_token_at = now
            else:
                self.token_gaps.append(now - self.last_token_at)
            self.last_token_at = now
            self.generated += 1
        if self.generated >= self.output_len:
            self.finished_at = now
