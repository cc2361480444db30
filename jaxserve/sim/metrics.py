"""Serving metrics from simulated (or served) requests: TTFT, TBT, TPOT, end-to-end latency percentiles, SLO
attainment and goodput, overall and per request class (short / long)."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from typing import Sequence

import numpy as np

from jaxserve.sched.request import Request

PERCENTILES = (50, 90, 99)


def met_ttft(r: Request) -> bool:
    return r.first_token_at is not None and r.first_token_at <= r.ttft_deadline + 1e-9


def met_slo(r: Request) -> bool:
    """First token by the deadline and the mean time per later token within the TPOT target."""
    return r.finished and met_ttft(r) and tpot(r) <= r.tpot_slo + 1e-12


def tpot(r: Request) -> float:
    if r.generated < 2 or r.finished_at is None:
        return 0.0
    return (r.finished_at - r.first_token_at) / (r.generated - 1)


def _percentiles(values: Sequence[float], prefix: str) -> dict[str, float]:
    if not len(values):
        return {f"{prefix}_p{p}": math.nan for p in PERCENTILES}
    arr = np.asarray(values, np.float64)
    return {f"{prefix}_p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}


def summarize(requests: Sequence[Request], span: float) -> dict[str, float]:
    """Latency percentiles over finished requests; SLO attainment over all of them (unfinished and rejected
    ones miss)."""
    done = [r for r in requests if r.finished]
    out: dict[str, float] = {"requests": len(requests), "finished": len(done)}
    out |= _percentiles([r.first_token_at - r.arrival for r in done], "ttft")
    # TTFT as a fraction of the request's own deadline: comparable across prompt lengths (Medha Fig. 13)
    out |= _percentiles(
        [
            (r.first_token_at - r.arrival) / (r.ttft_deadline - r.arrival)
            for r in done
            if math.isfinite(r.ttft_deadline) and r.ttft_deadline > r.arrival
        ],
        "ttft_norm",
    )
    out |= _percentiles([g for r in done for g in r.token_gaps], "tbt")
    out |= _percentiles([tpot(r) for r in done if r.generated > 1], "tpot")
    out |= _percentiles([r.finished_at - r.arrival for r in done], "e2e")
    good = sum(met_slo(r) for r in requests)
    out["slo_attainment"] = good / len(requests) if requests else math.nan
    out["ttft_attainment"] = sum(map(met_ttft, requests)) / len(requests) if requests else math.nan
    out["goodput_rps"] = good / span if span > 0 else math.nan
    out["throughput_tok_s"] = sum(r.generated for r in done) / span if span > 0 else math.nan
    return out


@dataclasses.dataclass
class Results:
    """One simulation run: every request with its timeline, plus what produced it."""

    requests: list[Request]
    rejected: list[Request]  # could never fit a replica's KV memory
    span: float  # simulated seconds from the first arrival to the last completion
    wall_seconds: float
    config: dict
    long_threshold: int = 32768
    # prefill work as run, for Gantt charts: (request ids, the devices or instances it ran on, start, end)
    prefills: list[tuple[tuple[str, ...], tuple[int, ...], float, float]] = dataclasses.field(default_factory=list)
    # a disaggregated cluster's dispatch: each request's decode instance
    decoders: dict[str, int] = dataclasses.field(default_factory=dict)

    def summary(self) -> dict[str, dict[str, float]]:
        everyone = self.requests + self.rejected  # a rejected request is a missed SLO, not a smaller sample
        short = [r for r in everyone if r.prompt_len < self.long_threshold]
        long = [r for r in everyone if r.prompt_len >= self.long_threshold]
        out = {"all": summarize(everyone, self.span)}
        if long:
            out |= {"short": summarize(short, self.span), "long": summarize(long, self.span)}
        out["all"]["rejected"] = len(self.rejected)
        out["all"]["sim_requests_per_wall_s"] = len(self.requests) / max(self.wall_seconds, 1e-9)
        return out

    def table(self) -> list[dict]:
        """One row per request: a notebook can hand it to pandas.DataFrame."""
        return [
            {
                "id": r.id,
                "arrival": r.arrival,
                "prompt_len": r.prompt_len,
                "output_len": r.output_len,
                "ttft": None if r.first_token_at is None else r.first_token_at - r.arrival,
                "e2e": None if r.finished_at is None else r.finished_at - r.arrival,
                "tpot": tpot(r),
                "deadline": r.ttft_deadline - r.arrival,
                "met_slo": met_slo(r),
            }
            for r in self.requests
        ]

    def to_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"config": self.config, "summary": self.summary()}, f, indent=1, default=str)

    def to_csv(self, path: str) -> None:
        rows = self.table()
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["id"])
            writer.writeheader()
            writer.writerows(rows)
