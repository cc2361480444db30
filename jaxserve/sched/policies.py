"""Prefill ordering policies. Each ranks the prefill queue (smaller key first, ties by arrival order), and is
re-evaluated every iteration, so a policy whose keys move with time (LRS, LARS) preempts at chunk boundaries.

- FCFS: arrival order.
- SJF / LJF with a scheduling batch (TetriInfer 3.3.1): arrivals are taken in batches of `batch` requests in
  arrival order and sorted by prompt length within a batch, so no request waits behind more than one batch.
- EDF: earliest TTFT deadline.
- LRS: least remaining slack, slack = deadline - now - remaining work.
- LARS (Medha 4.1): least relative slack, slack / total work: a long request has less slack per unit of work to
  spend, so short requests preempt it only once their own relative slack drops below its.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import numpy as np

from jaxserve.sched.queue import PrefillQueue


class Policy(abc.ABC):
    name: ClassVar[str]

    @abc.abstractmethod
    def keys(self, q: PrefillQueue, now: float) -> np.ndarray:
        """Priority per queued request, in queue order; smaller runs first."""

    def order(self, q: PrefillQueue, now: float) -> np.ndarray:
        """Queue indices, highest priority first."""
        return np.lexsort((q.column("seq"), self.keys(q, now)))

    def relative_slack(self, q: PrefillQueue, now: float) -> np.ndarray:
        """Slack over total work (what space sharing reads, whatever the ordering policy)."""
        slack = q.column("deadline") - now - q.column("remaining_work")
        return slack / np.maximum(q.column("total_work"), 1e-9)


class FCFS(Policy):
    name = "fcfs"

    def keys(self, q, now):
        return q.column("seq")


class SJF(Policy):
    name = "sjf"
    sign = 1.0

    def __init__(self, batch: int = 16):
        if batch < 1:
            raise ValueError(f"scheduling batch must be >= 1, got {batch}")
        self.batch = batch

    def keys(self, q, now):
        # batch index dominates (prompt lengths are < 2**31), then length within the batch
        return np.floor(q.column("seq") / self.batch) * 2.0**32 + self.sign * q.column("prompt_len")


class LJF(SJF):
    name = "ljf"
    sign = -1.0


class EDF(Policy):
    name = "edf"

    def keys(self, q, now):
        return q.column("deadline")


class LRS(Policy):
    name = "lrs"

    def keys(self, q, now):
        return q.column("deadline") - now - q.column("remaining_work")


class LARS(Policy):
    name = "lars"

    def keys(self, q, now):
        return self.relative_slack(q, now)


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (FCFS, SJF, LJF, EDF, LRS, LARS)}


def make_policy(name: str, **kwargs) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name](**kwargs)
