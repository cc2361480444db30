"""Per-request SLOs: a TTFT deadline that scales with the work a prompt needs, and a TPOT target."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SLO:
    ttft_min: float = 1.0  # seconds: the deadline no prompt gets less than
    ttft_factor: float = 3.0  # deadline = max(ttft_min, factor * the prompt's prefill time alone)
    tpot: float = 0.1  # seconds per output token

    def ttft(self, prefill_seconds: float) -> float:
        return max(self.ttft_min, self.ttft_factor * prefill_seconds)
