"""Prefill requests waiting or part-way through, held in parallel numpy arrays so that a policy can rank
thousands of them in tens of microseconds (a Python key per request would cost a millisecond)."""

from __future__ import annotations

import numpy as np

from jaxserve.sched.request import Request


class PrefillQueue:
    def __init__(self, capacity: int = 256):
        self.requests: list[Request] = []
        self._slot: dict[str, int] = {}
        self._next_seq = 0
        self._arrays = {
            name: np.zeros(capacity)
            for name in ("seq", "deadline", "prompt_len", "left", "total_work", "remaining_work", "admitted")
        }

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, request: Request) -> bool:
        return request.id in self._slot

    def index(self, request: Request) -> int:
        return self._slot[request.id]

    def column(self, name: str) -> np.ndarray:
        return self._arrays[name][: len(self.requests)]

    def add(
        self, request: Request, total_work: float, remaining_work: float | None = None, seq: int | None = None
    ) -> int:
        """Queue a request; seq: its place in arrival order (a preempted request keeps its own). Returns seq."""
        if request.id in self._slot:
            raise ValueError(f"request {request.id} is already queued")
        i = len(self.requests)
        if i == len(self._arrays["seq"]):
            self._arrays = {k: np.concatenate([v, np.zeros_like(v)]) for k, v in self._arrays.items()}
        a = self._arrays
        if seq is None:
            seq = self.new_seq()
        a["seq"][i], a["deadline"][i] = seq, request.ttft_deadline
        a["prompt_len"][i], a["total_work"][i] = request.prompt_len, total_work
        a["left"][i] = request.prefill_target - request.planned  # prefill tokens not yet planned
        a["admitted"][i] = 0.0  # holds a KV reservation (the scheduler sets it)
        a["remaining_work"][i] = total_work if remaining_work is None else remaining_work
        self._slot[request.id] = i
        self.requests.append(request)
        return seq

    def new_seq(self) -> int:
        """The next place in arrival order (also for a request that skips the queue: prefilled elsewhere)."""
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        return seq

    def set_remaining(self, request: Request, remaining_work: float) -> None:
        """After more of the request's prompt was planned."""
        i = self._slot[request.id]
        self._arrays["remaining_work"][i] = remaining_work
        self._arrays["left"][i] = request.prefill_target - request.planned

    def set_admitted(self, request: Request, admitted: bool) -> None:
        """Mirrors the scheduler's running set (requests holding KV) for queued requests, so it can skip the rest
        by array mask."""
        self._arrays["admitted"][self._slot[request.id]] = admitted

    def remove(self, request: Request) -> None:
        """Swap-remove: the last entry takes the freed slot."""
        i = self._slot.pop(request.id)
        last = len(self.requests) - 1
        if i != last:
            moved = self.requests[last]
            self.requests[i] = moved
            self._slot[moved.id] = i
            for v in self._arrays.values():
                v[i] = v[last]
        self.requests.pop()
