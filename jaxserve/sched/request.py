"""A request as the scheduler sees it: sizes, deadlines, progress and status. Progress moves only in
Scheduler.apply(), from an Outcome, so the live engine and the simulator advance it the same way.

A request's life (RequestStatus), and where each move happens:

    WAITING --admit--> PREFILLING --last chunk--> DECODING --stop or length--> FINISHED_*
       ^                    |                        |
       +--- unadmit         +------ preempt ---------+--> PREEMPTED --admit--> PREFILLING (recompute)
    AWAITING_KV (blocks reserved; prefilled elsewhere) --its KV lands--> DECODING
    any unfinished state --abort--> FINISHED_ABORTED
"""

from __future__ import annotations

import dataclasses
import enum
import math


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holding no KV
    PREFILLING = "prefilling"  # holds KV; its prompt (or a recompute) is being computed
    DECODING = "decoding"  # one token a step
    PREEMPTED = "preempted"  # its KV was taken back: queued to recompute
    AWAITING_KV = "awaiting_kv"  # holds reserved blocks; its prompt's KV is computed elsewhere (disaggregation)
    FINISHED_STOPPED = "finished_stopped"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "finished_length"  # its output_len tokens
    FINISHED_ABORTED = "finished_aborted"  # ended by its client, or by an error of its own

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclasses.dataclass(eq=False)
class Request:
    id: str
    arrival: float
    prompt_len: int
    output_len: int  # tokens to generate: the trace's count in simulation, max_tokens on the engine
    ttft_deadline: float = math.inf  # absolute time by which the first token is due
    tpot_slo: float = math.inf  # seconds per output token after the first
    token_ids: list[int] | None = None  # prompt then generated ids (the engine's; None in simulation): prefix hashes
    single_step: bool = False  # each token waits for the host's word (a grammar's mask): never in a multi-step decode
    status: RequestStatus = RequestStatus.WAITING
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
        return self.status.finished

    def finish(self, status: RequestStatus, now: float) -> None:
        """End it for the reason `status` gives, at `now` (a second reason does not replace the first)."""
        if not self.finished:
            self.status, self.finished_at = status, now

    @property
    def kv_len(self) -> int:
        """Tokens whose KV is cached: the prefill so far, then the prompt plus generated tokens already fed back."""
        return self.prefilled if self.in_prefill else self.prompt_len + max(self.generated - 1, 0)

    def preempt(self) -> None:
        """Its KV is gone: recompute everything but the last generated token (fed by the next decode)."""
        self.prefill_target = self.prompt_len + max(self.generated - 1, 0)
        self.planned = self.prefilled = 0
        self.preemptions += 1
        self.status = RequestStatus.PREEMPTED

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
            self.finish(RequestStatus.FINISHED_LENGTH, now)
