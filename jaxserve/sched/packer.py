"""Medha's batch packer (appendix Algorithms 1-3): decodes first, then prefill chunks in priority order, each
the largest chunk that keeps the predicted iteration time within the budget (adaptive chunking: early chunks of
a long prompt are large, late ones small because attention over the history grows), with space sharing and at
most one long prefill per batch. The prefill-time cache (Algorithm 3) gives LARS its remaining-work estimates.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Callable, Iterable, Protocol, Sequence

from jaxserve.sched.batch_cost import BatchCost, BatchState, PiecewiseLinear
from jaxserve.sched.request import Request


def max_chunk(cost: BatchCost, state: BatchState, h: int, limit: int, budget: float, align: int = 1) -> int:
    """Largest n <= limit (a multiple of `align` unless n == limit) such that adding a chunk of n tokens after h
    cached ones keeps the batch within `budget` seconds; 0 if none fits. Time grows with n: exponential probe,
    then bisection."""

    def fits(n: int) -> bool:
        return cost.time(cost.add_prefill(state, n, h)) <= budget

    if limit <= 0:
        return 0
    if fits(limit):  # most short prompts fit whole: one evaluation
        return limit
    if not fits(min(align, limit)):
        return 0
    lo, hi = min(align, limit), align * 2
    while hi < limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit)
    while hi - lo > align:  # invariant: fits(lo), not fits(hi) (or hi == limit, which did not fit)
        mid = (lo + hi) // 2 // align * align
        if mid <= lo:
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


class PrefillTimeCache:
    """Algorithm 3: time to prefill l tokens alone with adaptive chunking under the budget. Chunk sizes depend
    only on the history, so one max-length prefill gives every prompt's chunks: a prompt of l tokens takes the
    whole chunks before l plus its own shorter last chunk, timed exactly (a short prompt pays a whole
    iteration's fixed cost, not a pro-rated share of the first chunk). Remaining work is a difference."""

    def __init__(
        self,
        cost: BatchCost,
        iteration_budget: float,
        max_len: int = 1 << 20,
        align: int = 1,
        max_chunk_tokens: int = 1 << 20,
    ):
        self.cost, self.max_len = cost, max_len
        self._points, self._times = [0], [0.0]  # chunk boundaries and the time to reach each
        done, elapsed = 0, 0.0
        while done < max_len:
            # a chunk that overruns the budget still runs (the scheduler does the same), at the minimum size
            limit = min(max_len - done, max_chunk_tokens)
            n = max_chunk(cost, BatchState(), done, limit, iteration_budget, align) or min(align, limit)
            elapsed += cost.batch_time([(n, done)])
            done += n
            self._points.append(done)
            self._times.append(elapsed)
        self._tail = PiecewiseLinear(self._points[-2:], self._times[-2:])  # past max_len: the last chunk's rate

    @classmethod
    def for_packer(cls, cost: BatchCost, packer: PackerConfig) -> PrefillTimeCache:
        """Prefill times under this packer's budget, chunk alignment and step size."""
        return cls(
            cost, packer.iteration_budget, align=packer.chunk_align, max_chunk_tokens=packer.max_num_batched_tokens
        )

    def __call__(self, tokens: int) -> float:
        if tokens >= self.max_len:
            return self._tail(tokens)
        k = bisect.bisect_right(self._points, tokens) - 1
        rest, history = tokens - self._points[k], self._points[k]
        if rest == 0:
            return self._times[k]
        return self._times[k] + self.cost.batch_time([(rest, history)])

    def remaining(self, total: int, processed: int) -> float:
        return self(total) - self(processed)


@dataclasses.dataclass(frozen=True)
class PackerConfig:
    iteration_budget: float  # iteration budget, seconds (from the TPOT SLO)
    long_threshold: int = 32768  # prompts this long count as long: at most one per batch
    multi_prefill: bool = True  # several prefill chunks per batch (Medha 4.2); False: one, as the baselines of Fig. 13
    space_sharing: bool = False
    max_share: float = 0.4  # rho_max: the most of the budget a long prefill yields
    chunk_align: int = 32
    max_num_batched_tokens: int = 1 << 16
    max_prefills: int | None = None  # prefill chunks per batch (the engine's programs have tiles for so many)

    def __post_init__(self):
        if self.iteration_budget <= 0:
            raise ValueError(f"iteration_budget must be > 0, got {self.iteration_budget}")
        if not 0 <= self.max_share < 1:
            raise ValueError(f"max_share must be in [0, 1), got {self.max_share}")


class Room(Protocol):
    """KV memory as the packer sees it: how many more tokens a request may compute now, and taking them."""

    def limit(self, r: Request) -> int: ...

    def take(self, r: Request, n: int) -> None: ...


def pack(
    cost: BatchCost,
    config: PackerConfig,
    decodes: Sequence[Request],
    prefills: Iterable[Request],
    relative_slack: Callable[[Request], float],
    more_waiting: Callable[[Request], bool],
    smallest_chunk: int | None = None,
    room: Room | None = None,
) -> tuple[list[tuple[Request, int]], BatchState]:
    """Algorithms 1 and 2. `prefills` come in priority order; more_waiting(r) tells whether any prefill ranks
    after r (a long prefill yields budget only when someone could use it); smallest_chunk: the fewest tokens any
    of them could take (default chunk_align), below which looking further is pointless; room: the KV memory a
    chunk must fit in (taken as each chunk is chosen), unbounded if None."""
    state = cost.add_decodes(BatchState(), [r.kv_len for r in decodes])
    chunks: list[tuple[Request, int]] = []
    has_long = False
    # no chunk is cheaper than the smallest one starting a fresh prompt: once even that does not fit, stop
    smallest = smallest_chunk or config.chunk_align
    most = config.max_prefills if config.multi_prefill else 1
    for r in prefills:
        if state.time(cost) >= config.iteration_budget or state.tokens >= config.max_num_batched_tokens:
            break
        if cost.time(cost.add_prefill(state, smallest, 0)) > config.iteration_budget:
            break
        is_long = r.prompt_len >= config.long_threshold
        if is_long and has_long:
            continue
        budget = config.iteration_budget
        if config.space_sharing and is_long and more_waiting(r):
            budget *= 1.0 - min(config.max_share, max(0.0, relative_slack(r)))
        limit = min(r.prefill_target - r.planned, config.max_num_batched_tokens - state.tokens)
        if room is not None:
            limit = min(limit, room.limit(r))
        n = max_chunk(cost, state, r.planned, limit, budget, config.chunk_align)
        if n == 0:
            continue
        if room is not None:
            room.take(r, n)
        chunks.append((r, n))
        state = cost.add_prefill(state, n, r.planned)
        has_long |= is_long
        if most is not None and len(chunks) >= most:
            break
    return chunks, state
