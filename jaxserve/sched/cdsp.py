"""Tetris CDSP prefill planning (Section 5.1, Algorithms 1-3): how to cut a prompt into chunks and which group of
prefill instances runs each, given how long every instance is already booked.

- Single-chunk allocation (Algorithm 2): for each SP size, extend the previous chunks' group (node-aware: fill
  the nodes already in use, then whole nodes, then the node whose s-th shortest queue is shortest), estimate
  TTFT = the group's longest queue + Eq. (1); a larger SP size wins only if it cuts TTFT by more than the
  improvement rate (which keeps a loaded cluster from spending many instances on small gains).
- Chunking (Algorithm 1): for SP pairs (current < next) up to the single-chunk size, the current chunk runs on
  the current group for exactly as long as the next group's extra instances stay busy (Algorithm 3: Eq. (1) is
  a quadratic in the chunk size for a fixed history, solved in closed form), Eq. (2) books the group until
  then, and the rest continues on a group that extends this one. The recursion over pairs is evaluated as a
  dynamic programme over nested groups (see _chains), so planning stays well under a millisecond.

Times are relative to now; queues are per-instance seconds until free. Pure Python + numpy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from jaxserve.sched.cost_models import TetrisPrefill


@dataclasses.dataclass(frozen=True)
class Chunk:
    tokens: int
    history: int  # prompt tokens before this chunk
    group: tuple[int, ...]  # instance ids, previous chunks' instances first (the ring order)
    start: float
    end: float

    @property
    def sp(self) -> int:
        return len(self.group)


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    chunks: tuple[Chunk, ...]

    @property
    def ttft(self) -> float:
        return self.chunks[-1].end

    def commit(self, queues: np.ndarray) -> np.ndarray:
        """Queues after this plan's chunks are booked (Eq. 2 for each)."""
        out = np.array(queues, np.float64)
        for c in self.chunks:
            out[list(c.group)] = c.end
        return out


@dataclasses.dataclass(frozen=True)
class Pool:
    """Prefill instances, `per_node` to a node: instance i lives on node i // per_node."""

    nodes: int
    per_node: int

    @property
    def size(self) -> int:
        return self.nodes * self.per_node


class CDSPPlanner:
    def __init__(self, model: TetrisPrefill, pool: Pool, improvement_rate: float = 0.1,
                 sizes: Sequence[int] | None = None, min_chunk: int = 1024, chunking: bool = True):
        """sizes: candidate SP sizes (default: the fitted powers of two that fit the pool); min_chunk: a chunk
        smaller than this is not worth its own step; chunking=False gives request-level SP (Algorithm 2 only)."""
        self.pool, self.improvement_rate, self.min_chunk, self.chunking = pool, improvement_rate, min_chunk, chunking
        self.sizes = sorted(sizes or [s for s in model.coefficients if s <= pool.size])
        if not self.sizes or self.sizes[-1] > pool.size:
            raise ValueError(f"SP sizes {self.sizes} do not fit a pool of {pool.size} instances")
        self._coef = {s: tuple(float(c) for c in model.coef(s)) for s in self.sizes}

    def latency(self, sp: int, n: int, h: int) -> float:
        c0, c1, c2, c3 = self._coef[sp]
        return c0 + c1 * n + c2 * n * h + c3 * n * n

    def chunk_for(self, sp: int, budget: float, h: int) -> int:
        """Largest chunk that runs within `budget` seconds after h history tokens: the positive root of
        c3*n^2 + (c1 + c2*h)*n + (c0 - budget) = 0 (Algorithm 3's Newton iteration converges to it)."""
        c0, c1, c2, c3 = self._coef[sp]
        a, b, c = c3, c1 + c2 * h, c0 - budget
        if c >= 0:
            return 0
        root = (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a) if a > 0 else -c / b
        return int(root)

    # -- groups ----------------------------------------------------------------------------------------------
    def extend(self, prev: tuple[int, ...], sp: int, queues: Sequence[float]) -> tuple[int, ...] | None:
        """A group of `sp` instances holding `prev`: first the free instances on prev's nodes, then whole nodes
        with the shortest queues, then the node whose needed-th shortest queue is shortest (its shortest ones)."""
        return _Booking(self.pool, np.asarray(queues, np.float64)).extend(prev, sp)

    # -- Algorithm 2 -----------------------------------------------------------------------------------------
    def single_chunk(self, tokens: int, book: "_Booking") -> Chunk:
        best: Chunk | None = None
        for sp in self.sizes:  # every size fits the pool (checked at construction)
            group = book.extend((), sp)
            start = book.ready(group)
            chunk = Chunk(tokens, 0, group, start, start + self.latency(sp, tokens, 0))
            if best is None or chunk.end < best.end * (1 - self.improvement_rate):
                best = chunk
        return best

    # -- Algorithm 1 -----------------------------------------------------------------------------------------
    def plan(self, tokens: int, queues: Sequence[float]) -> ChunkPlan:
        if tokens < 1:
            raise ValueError(f"a prompt needs at least one token, got {tokens}")
        q = np.asarray(queues, np.float64)
        if q.shape != (self.pool.size,):
            raise ValueError(f"need one queue time per instance ({self.pool.size}), got shape {q.shape}")
        book = _Booking(self.pool, np.maximum(q, 0.0))
        single = self.single_chunk(tokens, book)
        best = ChunkPlan((single,))
        if not self.chunking:
            return best
        sizes = [s for s in self.sizes if s <= single.sp]
        for first in range(len(sizes) - 1):
            chained = self._chains(tokens, sizes[first:], book)
            if chained is not None and chained.ttft < best.ttft:
                best = chained
        return best

    def _chains(self, tokens: int, sizes: list[int], book: "_Booking") -> ChunkPlan | None:
        """The best plan whose chunks run on nested groups G_1 < G_2 < ... built by extending from sizes[0].
        Algorithm 1's recursion over (current, next) SP pairs, evaluated as a dynamic programme: a chunk on G_j
        runs from when G_j is ready until a larger G_i is (Eq. 2 books G_j exactly that long), so reaching G_i
        with more of the prompt done is never worse (the chunk solved for a budget shrinks by less than the
        history grows, and the rest's latency falls with history). Keeping the most progress per group makes
        the search O(sizes^2) instead of exponential."""
        groups: list[tuple[int, tuple[int, ...], float]] = []
        group: tuple[int, ...] = ()
        for sp in sizes:
            group = book.extend(group, sp)
            if group is None:
                break
            groups.append((sp, group, book.ready(group)))
        done: list[int | None] = [0] + [None] * (len(groups) - 1)  # most prompt tokens done when G_i is ready
        trail: list[tuple[Chunk, ...]] = [()] * len(groups)
        best: ChunkPlan | None = None
        for j, (sp, group, ready) in enumerate(groups):
            h = done[j]
            if h is None:
                continue
            if trail[j]:  # finish the prompt on G_j
                end = ready + self.latency(sp, tokens - h, h)
                if best is None or end < best.ttft:
                    best = ChunkPlan(trail[j] + (Chunk(tokens - h, h, group, ready, end),))
            for i in range(j + 1, len(groups)):
                n = self.chunk_for(sp, groups[i][2] - ready, h)  # until G_i's extra instances free up
                if n < self.min_chunk or h + n >= tokens or (done[i] is not None and h + n <= done[i]):
                    continue
                done[i] = h + n
                trail[i] = trail[j] + (Chunk(n, h, group, ready, ready + self.latency(sp, n, h)),)
        return best


class _Booking:
    """Instance queue times with what group extension needs precomputed (each node's instances in queue order),
    and group extensions memoised: one per plan."""

    def __init__(self, pool: Pool, q: np.ndarray):
        self.pool, self.q = pool, q
        self.queue = q.tolist()
        k = pool.per_node
        order = np.argsort(q.reshape(pool.nodes, k), axis=1, kind="stable") + (np.arange(pool.nodes) * k)[:, None]
        self.by_queue = order.tolist()  # node -> its instances, shortest queue first
        self._memo: dict[tuple[tuple[int, ...], int], tuple[int, ...] | None] = {}

    def ready(self, group: Sequence[int]) -> float:
        queue = self.queue
        return max(queue[i] for i in group)

    def extend(self, prev: tuple[int, ...], sp: int) -> tuple[int, ...] | None:
        key = (prev, sp)
        if key not in self._memo:
            self._memo[key] = self._extend(prev, sp)
        return self._memo[key]

    def _extend(self, prev: tuple[int, ...], sp: int) -> tuple[int, ...] | None:
        need = sp - len(prev)
        if need < 0 or sp > self.pool.size:
            return None
        if need == 0:
            return prev
        k, queue, by_queue = self.pool.per_node, self.queue, self.by_queue
        group = list(prev)
        prev_nodes = {i // k for i in prev}
        if prev:
            taken = set(prev)
            near = sorted((i for nd in prev_nodes for i in by_queue[nd] if i not in taken), key=queue.__getitem__)
            group += near[:need]
            need -= len(near[:need])
        free_nodes = [nd for nd in range(self.pool.nodes) if nd not in prev_nodes]
        whole, rest = divmod(need, k)
        if whole > len(free_nodes) or (whole == len(free_nodes) and rest):
            return None
        # a whole node is ready when its last instance is; among equals, the least loaded node goes first
        free_nodes.sort(key=lambda nd: queue[by_queue[nd][-1]])
        for nd in free_nodes[:whole]:
            group += by_queue[nd]
        if rest:
            nd = min(free_nodes[whole:], key=lambda nd: queue[by_queue[nd][rest - 1]])
            group += by_queue[nd][:rest]
        return tuple(group)


class FixedSPPlanner:
    """Baseline (Tetris 7.1): the pool split into independent groups of `sp` co-located instances; a request
    goes whole to the group that frees up first."""

    def __init__(self, model: TetrisPrefill, pool: Pool, sp: int):
        if pool.size % sp:
            raise ValueError(f"a pool of {pool.size} instances does not split into groups of {sp}")
        self.model, self.pool, self.sp = model, pool, sp
        self.groups = [tuple(range(g, g + sp)) for g in range(0, pool.size, sp)]

    def plan(self, tokens: int, queues: Sequence[float]) -> ChunkPlan:
        q = np.maximum(np.asarray(queues, np.float64), 0.0)
        group = min(self.groups, key=lambda g: q[list(g)].max())
        start = float(q[list(group)].max())
        return ChunkPlan((Chunk(tokens, 0, group, start, start + self.model.predict(self.sp, tokens)),))
