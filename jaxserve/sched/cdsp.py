"""Tetris CDSP prefill planning (Section 5.1, Algorithms 1-3): how to cut a prompt into chunks and which group of
prefill instances runs each, given how long every instance is already booked.

- Single-chunk allocation (Algorithm 2): for each SP size, extend the previous chunks' group (node-aware: fill
  the nodes already in use, then whole nodes, then the node whose s-th shortest queue is shortest), estimate
  TTFT = the group's longest queue + Eq. (1); a larger SP size wins only if it cuts TTFT by more than the
  improvement rate (which keeps a loaded cluster from spending many instances on small gains).
- Chunking (Algorithm 1): for SP pairs (current < next) up to the single-chunk size, the current chunk runs on
  the current group for exactly as long as the next group's extra instances stay busy (Algorithm 3: Eq. (1) is
  a quadratic in the chunk size for a fixed history, solved in closed form), Eq. (2) books the group until
  then, and the rest continues on a group that extends this one, its SP size chosen afresh by Algorithm 2 for
  the rest (with its history), so it may exceed the first single-chunk choice. The recursion over pairs is
  evaluated as a dynamic programme over nested groups (see _chains), so planning stays well under a millisecond.
- Cache balancing (Section 4.1): before a chunk on a larger group, the history KV is spread evenly over it,
  overlapped layer by layer with the chunk's fully-connected layers; what they cannot hide lengthens the chunk
  (Balancing, chunk_seconds: the planner predicts with them and sim/prefill_pool.py charges with them). The live
  pool moves the history before the chunk, a program of its own that nothing hides: MeasuredBalancing prices
  that move as measured (cluster/pool_profile.py), ahead of the chunk.

Times are relative to now; queues are per-instance seconds until free. Pure Python + numpy.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

import numpy as np

from jaxserve.sched.cost_models import TetrisPrefill, LinkModel
from jaxserve.sched.profiles import PROFILES, model_shape, network


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


Coef = tuple[float, float, float, float]  # Eq. (1)'s c0..c3 for one SP size


def planner_groups(pool: Pool, sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Every group (as sorted instance ids) the CDSP planner can give a chunk: groups of a multiple of the node
    size are unions of whole nodes (its node-aware extension), others any instances of that size."""
    out = []
    for s in sizes:
        if s % pool.per_node == 0:
            for nodes in itertools.combinations(range(pool.nodes), s // pool.per_node):
                out.append(tuple(i for n in nodes for i in range(n * pool.per_node, (n + 1) * pool.per_node)))
        else:
            out += list(itertools.combinations(range(pool.size), s))
    return out


@dataclasses.dataclass(frozen=True)
class Stores:
    """Each prefill instance's history store (engine/sp_prefill.py): `rows` rows, sized by the device's KV budget.
    Before a chunk the request's history is spread evenly over the chunk's group, and the chunk writes its bucket
    of rows (a power of two per instance, at least min_local) after it; its padding rows are reclaimed after."""

    rows: int
    min_local: int = 16

    def local(self, sp: int, tokens: int) -> int:
        """Per-instance rows of a chunk of `tokens` on sp instances (its bucket)."""
        return max(self.min_local, 1 << max(-(-tokens // sp) - 1, 0).bit_length())

    def history_room(self, sp: int, tokens: int) -> int:
        """The most history tokens after which a chunk of `tokens` on sp instances still fits."""
        return sp * (self.rows - self.local(sp, tokens))

    def fits(self, sp: int, tokens: int, history: int) -> bool:
        return history <= self.history_room(sp, tokens)

    def largest(self, sp: int, history: int) -> int:
        """The most tokens a chunk on sp instances after `history` may have (0: none fits)."""
        room = self.rows - -(-history // sp)
        return sp * (1 << (room.bit_length() - 1)) if room >= self.min_local else 0

    def filling(self, sp: int, tokens: int) -> list[int]:
        """A prompt's chunks on sp instances, each as long as the room left allows, or a ValueError naming the
        numbers when the stores cannot hold it."""
        chunks, done = [], 0
        while done < tokens:
            n = min(tokens - done, self.largest(sp, done))
            if n < 1:
                raise ValueError(
                    f"a prompt of {tokens} tokens does not fit the prefill pool: {sp} instances hold "
                    f"{self.longest(sp)} tokens at most ({self.rows} history rows each)"
                )
            chunks.append(n)
            done += n
        return chunks

    def longest(self, sp: int) -> int:
        """The longest prompt sp instances hold, in chunks each filling the room left."""
        done = 0
        while n := self.largest(sp, done):
            done += n
        return done


# a chunk before its times are filled in: (group, tokens, history, the group holding the history)
Step = tuple["_Group", int, int, "_Group"]


def _latency(coef: Coef, n: int, h: int) -> float:
    c0, c1, c2, c3 = coef
    return c0 + c1 * n + c2 * n * h + c3 * n * n


def chunk_seconds(coef: Coef, n: int, h: int, balance: float = 0.0) -> float:
    """A chunk of n tokens after h history tokens: Eq. (1) plus the cache balancing its fully-connected layers do
    not hide. balance: Balancing.seconds, the move's transfer time summed over layers.

    Layer-wise overlap (Tetris 4.1, Fig. 6-b): once a layer's ring attention is done, its communicator balances the
    next layer's history while the fully-connected layers run, so each layer takes attention + max(fc, move).
    Eq. (1)'s c1*n is the fully-connected time (Section 5.1), so over all layers the chunk takes
    Eq. (1) + max(0, balance - c1*n): free when the chunk is long, the move's excess when it is short. (Not
    modelled: the first layer's move has only that layer's QKV projection to hide behind.)"""
    return _latency(coef, n, h) + max(0.0, balance - coef[1] * n)


@dataclasses.dataclass(frozen=True)
class Balancing:
    """Cache balancing's transfer time (Tetris 4.1). History of h tokens held evenly by a group of s0 instances
    is spread evenly over a larger group of s1 that extends it: each new instance receives h/s1 tokens and each
    old one sends h/s0 - h/s1, all in parallel, so a layer's move takes the larger of the two over the link it
    crosses: inter-node if an added instance is on a node that holds none of the history, else intra-node. (A
    move that mixes links is charged its largest share at the slower link's speed; exact for a doubling within
    a node or onto fresh nodes.) Every layer's move is one message: latency + bytes / bandwidth."""

    hidden = True  # the chunk's fully-connected layers hide it, layer by layer (chunk_seconds)
    link: LinkModel  # keyed "intra_node" and "inter_node" (profiles.network)
    kv_bytes_per_token: float  # K and V of one layer
    layers: int
    per_node: int  # instances per node: instance i lives on node i // per_node (as Pool)
    # each link's (latency, seconds per byte) as plain floats: LinkModel.predict's numpy costs more than planning
    _coef: dict[str, tuple[float, float]] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        coef = {
            link: (float(self.link.coef(link)[0]), float(self.link.coef(link)[1]))
            for link in ("intra_node", "inter_node")
        }
        object.__setattr__(self, "_coef", coef)

    @classmethod
    def from_profile(cls, profile: str, per_node: int, tp: int = 1) -> "Balancing":
        """From a built-in GPU profile: its send/recv timings and its model's KV size. Each GPU of a TP-`tp`
        instance moves its own shard: an instance's move is 1/tp of the bytes per link."""
        shape = model_shape(profile)
        return cls(
            network(PROFILES[profile][0]), shape.kv_bytes_per_token() / shape.layers / tp, shape.layers, per_node
        )

    def seconds(self, held: Sequence[int], group: Sequence[int], h: int) -> float:
        """Moving h history tokens from `held` onto `group`, which extends it (held's instances first), summed
        over layers; 0 when nothing moves."""
        k = self.per_node
        nodes = {i // k for i in held}
        return self.move(len(held), len(group), h, any(i // k not in nodes for i in group[len(held) :]))

    def move(self, s0: int, s1: int, h: int, inter_node: bool) -> float:
        """seconds() from the group sizes and whether the larger one reaches a node the smaller one is not on."""
        if not h or not s0 or s1 <= s0:
            return 0.0
        latency, per_byte = self._coef["inter_node" if inter_node else "intra_node"]
        tokens = h / s1 * max(1.0, s1 / s0 - 1.0)  # max(received per new instance, sent per old one)
        return self.layers * (latency + tokens * self.kv_bytes_per_token * per_byte)


@dataclasses.dataclass(frozen=True)
class MeasuredBalancing:
    """Cache balancing as the live pool runs it (engine/sp_prefill.py's rebalance): the history's excess rows move
    to the instances below their even share before the chunk starts, a move nothing hides; seconds = fixed +
    per_token * rows moved, fitted to timed moves (cluster/pool_profile.py). Spreading h tokens held evenly by s0
    instances over s1 moves h * (1 - s0 / s1) of them."""

    hidden = False
    fixed: float
    per_token: float
    per_node: int

    @classmethod
    def fit(cls, moved: Sequence[int], seconds: Sequence[float], per_node: int) -> "MeasuredBalancing":
        """The least-squares line through (rows moved, seconds), neither coefficient below zero."""
        x, y = np.asarray(moved, np.float64), np.asarray(seconds, np.float64)
        if len(x) < 2 or np.ptp(x) == 0:
            raise ValueError(f"a move's line needs two or more sizes of move, got rows {x.tolist()}")
        per_token, fixed = np.polyfit(x, y, 1)
        return cls(max(float(fixed), 0.0), max(float(per_token), 0.0), per_node)

    def move(self, s0: int, s1: int, h: int, inter_node: bool) -> float:
        """Balancing.move's signature: one link kind here (the line is what this pool measured)."""
        del inter_node
        if not h or not s0 or s1 <= s0:
            return 0.0
        return self.fixed + self.per_token * h * (1 - s0 / s1)


def _root(a: float, b: float, c: float) -> float:
    """The positive root of a*n^2 + b*n + c (a >= 0, c < 0)."""
    return (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a) if a > 0 else -c / b


def _chunks_for(coef: Coef, h: int, start: float, ends: Sequence[float], balance: float = 0.0) -> list[int]:
    """For each of `ends`, the largest chunk that runs from `start` until then after h history tokens (0 if none):
    the positive root of c3*n^2 + (c1 + c2*h)*n + (c0 - budget) = 0 (Algorithm 3's Newton iteration converges to
    it). Batched per history, with the terms that do not depend on the budget hoisted: this is the DP's inner loop.

    With balancing (chunk_seconds), below n = balance / c1 the move is exposed and the c1*n terms cancel:
    c3*n^2 + c2*h*n + (c0 + balance - budget) = 0. Both pieces increase and meet at that n, so the Eq. (1) root
    holds where it lies past it, and the other piece's root otherwise."""
    c0, c1, c2, a = coef
    b = c1 + c2 * h
    bb, a2, a4 = b * b, 2 * a, 4 * a  # b * b - 4 * a * c evaluates as bb - a4 * c: the same floats
    kink = balance / c1 if c1 > 0 else math.inf  # where the move's excess ends
    out = []
    for end in ends:
        c = c0 - (end - start)
        if c + balance >= 0:  # the budget does not even cover the fixed cost and the exposed move
            out.append(0)
            continue
        root = (-b + math.sqrt(bb - a4 * c)) / a2 if a > 0 else -c / b
        if balance > 0 and root < kink:
            root = _root(a, c2 * h, c + balance)
        # Floor with a relative slack: when the budget is itself the latency of a whole chunk (a gap left by an
        # earlier booking), the exact root is an integer and rounding lands on either side of it (16383.999999999995
        # for 16384 on some CPUs), which loses a whole token. The computed root is good to ~1e-12 relative (a few
        # eps_f64 from the budget's own sum, times < ~1e3 from the -b + sqrt cancellation at long histories), so
        # 1e-9 * root covers it with margin and stays far below one token for any prompt under 1e8 tokens.
        out.append(int(root + 1e-9 * root))
    return out


class CDSPPlanner:
    def __init__(
        self,
        model: TetrisPrefill,
        pool: Pool,
        improvement_rate: float = 0.1,
        sizes: Sequence[int] | None = None,
        min_chunk: int = 1024,
        chunking: bool = True,
        balancing: Balancing | MeasuredBalancing | None = None,
        stores: Stores | None = None,
    ):
        """sizes: candidate SP sizes (default: the fitted powers of two that fit the pool); min_chunk: a chunk
        smaller than this is not worth its own step; chunking=False gives request-level SP (Algorithm 2 only);
        balancing: the cost of spreading history onto a larger group (default: free); stores: the instances'
        history stores, which every chunk's group must hold (default: unbounded)."""
        self.pool, self.improvement_rate, self.min_chunk, self.chunking = pool, improvement_rate, min_chunk, chunking
        self.model, self.balancing, self.stores = model, balancing, stores
        if balancing is not None and balancing.per_node != pool.per_node:
            raise ValueError(f"balancing assumes {balancing.per_node} instances a node, the pool has {pool.per_node}")
        self.sizes = sorted(sizes or [s for s in model.coefficients if s <= pool.size])
        if not self.sizes or self.sizes[-1] > pool.size:
            raise ValueError(f"SP sizes {self.sizes} do not fit a pool of {pool.size} instances")
        # plain floats: Eq. (1) on numpy scalars costs more than the planning arithmetic itself
        self._coef: dict[int, Coef] = {s: tuple(float(c) for c in model.coef(s)) for s in self.sizes}
        self._node_base = np.arange(0, pool.size, pool.per_node)[:, None]  # each node's first instance id

    def latency(self, sp: int, n: int, h: int) -> float:
        return _latency(self._coef[sp], n, h)

    def groups(self) -> list[tuple[int, ...]]:
        """Every group a chunk may take."""
        return planner_groups(self.pool, self.sizes)

    def _fits(self, sp: int, n: int, h: int) -> bool:
        return self.stores is None or self.stores.fits(sp, n, h)

    def longest(self) -> int | None:
        """The longest prompt the pool's stores hold (None: unbounded)."""
        return None if self.stores is None else self.stores.longest(self.sizes[-1])

    def _balance(self, held: "_Group", group: "_Group", h: int) -> float:
        if self.balancing is None:
            return 0.0
        # group extends held, so it reaches another node exactly when it leaves fewer nodes untouched
        return self.balancing.move(held.sp, group.sp, h, len(group.free) < len(held.free))

    def _seconds(self, sp: int, n: int, h: int, balance: float) -> float:
        """A chunk's time with its history's move: hidden by its layers where they can (chunk_seconds), else
        ahead of it."""
        if self.balancing is not None and not self.balancing.hidden:
            return balance + _latency(self._coef[sp], n, h)
        return chunk_seconds(self._coef[sp], n, h, balance)

    def chunk_for(self, sp: int, budget: float, h: int) -> int:
        """Largest chunk that runs within `budget` seconds after h history tokens (see _chunks_for)."""
        return _chunks_for(self._coef[sp], h, 0.0, [budget])[0]

    # -- groups ----------------------------------------------------------------------------------------------
    def extend(self, prev: tuple[int, ...], sp: int, queues: Sequence[float]) -> tuple[int, ...] | None:
        """A group of `sp` instances holding `prev`: first the free instances on prev's nodes, then whole nodes
        with the shortest queues, then the node whose needed-th shortest queue is shortest (its shortest ones)."""
        book = self._booking(np.asarray(queues, np.float64))
        group = book.extend(book.group(prev), sp)
        return None if group is None else group.members

    def _booking(self, q: np.ndarray) -> "_Booking":
        return _Booking(self.pool, q, self._node_base)

    # -- Algorithm 2 -----------------------------------------------------------------------------------------
    def _single_chunk(
        self, tokens: int, book: "_Booking", prev: "_Group | None" = None, h: int = 0, held: "_Group | None" = None
    ) -> tuple[float, "_Group"]:
        """The TTFT and group of `tokens` as one chunk after h history tokens held by `held`, on a group extending
        `prev` (default: none)."""
        prev, held = prev or book.root, held or book.root
        best_end, best = 0.0, None
        for sp in self.sizes:  # every size fits the pool (checked at construction)
            group = book.extend(prev, sp) if sp >= prev.sp and self._fits(sp, tokens, h) else None
            if group is None:
                continue
            end = group.ready + self._seconds(sp, tokens, h, self._balance(held, group, h))
            if best is None or end < best_end * (1 - self.improvement_rate):
                best_end, best = end, group
        return best_end, best

    # -- Algorithm 1 -----------------------------------------------------------------------------------------
    def on_arrival(self, t: float) -> None:
        del t  # plans from the queues alone

    def plan(self, tokens: int, queues: Sequence[float]) -> ChunkPlan:
        if tokens < 1:
            raise ValueError(f"a prompt needs at least one token, got {tokens}")
        q = np.asarray(queues, np.float64)
        if q.shape != (self.pool.size,):
            raise ValueError(f"need one queue time per instance ({self.pool.size}), got shape {q.shape}")
        book = self._booking(np.maximum(q, 0.0))
        ttft, single = self._single_chunk(tokens, book)
        # no group's stores hold the prompt as one chunk: chunks that fill them, unless a chain does better
        filled = self._filling(tokens, book) if single is None else None
        ttft = filled.ttft if filled else ttft
        steps: tuple[Step, ...] = () if filled else ((single, tokens, 0, book.root),)
        if self.chunking:
            limit = single.sp if single is not None else self.sizes[-1]
            sizes = [s for s in self.sizes if s <= limit]
            coefs = [self._coef[s] for s in sizes]
            for first in range(len(sizes) - 1):
                chained = self._chains(tokens, book, book.chain(sizes[first:]), coefs[first:], ttft)
                if chained is not None:
                    ttft, steps = chained
        # Chunks are built for the chosen plan only: the search itself runs on (group, tokens, history) steps
        return ChunkPlan(tuple(self._chunk(*step) for step in steps)) if steps else filled

    def _filling(self, tokens: int, book: "_Booking") -> ChunkPlan:
        """The prompt in chunks one after another on the largest group, each as long as its stores' room allows,
        or a ValueError naming the numbers when even they cannot hold it."""
        sp = self.sizes[-1]
        largest = book.extend(book.root, sp)
        chunks, done, end = [], 0, largest.ready
        for n in self.stores.filling(sp, tokens):
            start, end = end, end + chunk_seconds(self._coef[sp], n, done)
            chunks.append(Chunk(n, done, largest.members, start, end))
            done += n
        return ChunkPlan(tuple(chunks))

    def _chains(
        self, tokens: int, book: "_Booking", groups: list["_Group"], coefs: list[Coef], bound: float
    ) -> tuple[float, tuple[Step, ...]] | None:
        """The TTFT and steps of the best plan that beats `bound` with chunks on the nested groups G_1 < G_2 < ...
        (a _Booking.chain; coefs[i]: Eq. (1) at G_i's size). Algorithm 1's recursion over (current, next) SP
        pairs, evaluated as a dynamic programme: a chunk on G_j runs from when G_j is ready until a larger G_i is
        (Eq. 2 books G_j exactly that long), so reaching G_i with more of the prompt done is never worse (the
        chunk solved for a budget shrinks by less than the history grows, and the rest's latency falls with
        history). Keeping the most progress per group makes the search O(sizes^2) instead of exponential. (With
        cache balancing this is a heuristic: more history is also more KV to move, and which smaller group holds
        it changes the move; the fully-connected layers hide most of it.)

        The last chunk goes to Algorithm 2's group for the rest, extending G_i at any size (the chain itself stops
        at the prompt's single-chunk size): a literal recursion that re-runs Algorithm 2 on every rest found
        lower TTFT than the chain alone in 8 of 600 random cases (up to 1.76x); with this, in 6 (up to 1.29x),
        while it loses in 75 to the DP."""
        ready = [g.ready for g in groups]
        done: list[int | None] = [0] + [None] * (len(groups) - 1)  # most prompt tokens done when G_i is ready
        back = [0] * len(groups)  # the group whose chunk ran until G_i was ready
        best, min_chunk = 0, self.min_chunk
        for j, h in enumerate(done):
            if h is None:
                continue
            coef, start, held = coefs[j], ready[j], groups[back[j]] if j else book.root
            if j:  # finish the prompt on a group extending G_j, its size chosen by Algorithm 2 for the rest
                end, last = self._single_chunk(tokens - h, book, groups[j], h, held)
                if last is not None and end < bound:
                    bound, best, finish = end, j, last
            # each chunk runs until a larger group's extra instances free up (at most what its stores hold)
            balance = self._balance(held, groups[j], h)
            if self.balancing is not None and not self.balancing.hidden:  # the move first, then the chunk
                start, balance = start + balance, 0.0
            room = self.stores.largest(groups[j].sp, h) if self.stores is not None else math.inf
            for i, n in enumerate(_chunks_for(coef, h, start, ready[j + 1 :], balance), j + 1):
                n = min(n, room)
                if min_chunk <= n < tokens - h and (done[i] is None or h + n > done[i]):
                    done[i], back[i] = h + n, j
        if not best:
            return None
        steps = [(finish, tokens - done[best], done[best], groups[back[best]])]
        i = best
        while i:  # back to G_1
            j = back[i]
            steps.append((groups[j], done[i] - done[j], done[j], groups[back[j]] if j else book.root))
            i = j
        return bound, tuple(reversed(steps))

    def _chunk(self, group: "_Group", n: int, h: int, held: "_Group") -> Chunk:
        seconds = self._seconds(group.sp, n, h, self._balance(held, group, h))
        return Chunk(n, h, group.members, group.ready, group.ready + seconds)


@dataclasses.dataclass(slots=True)
class _Group:
    """Instances in ring order with what extending them needs, so that no extension rescans them."""

    members: tuple[int, ...]
    ready: float  # when its busiest instance frees up (-inf for none)
    near: list[int]  # the free instances on its nodes, shortest queue first
    free: list[int]  # the nodes it does not touch, in _Booking.node_order
    grown: dict[int, "_Group | None"] = dataclasses.field(default_factory=dict)  # its extensions by size

    @property
    def sp(self) -> int:
        return len(self.members)


class _Booking:
    """Instance queue times with what group extension needs precomputed (each node's instances in queue order,
    nodes in order of their longest queue), and group extensions memoised: one per plan. Groups are interned by
    their members, so chains that meet share the rest of their extensions."""

    def __init__(self, pool: Pool, q: np.ndarray, node_base: np.ndarray):
        """node_base: each node's first instance id, as a column."""
        self.pool = pool
        self.queue = q.tolist()
        order = q.reshape(pool.nodes, pool.per_node).argsort(axis=1, kind="stable")
        order += node_base
        self.by_queue = order.tolist()  # node -> its instances, shortest queue first
        self.kth = q[order].T.tolist()  # kth[r][node]: its (r+1)-th shortest queue; kth[-1]: when all are free
        # a whole node is ready when its last instance is; among equals, the least loaded (stable: lower id) first
        self.node_order = sorted(range(pool.nodes), key=self.kth[-1].__getitem__)
        self.root = _Group((), -math.inf, [], self.node_order)
        self._groups = {(): self.root}  # one object per distinct group, so each is extended once per size

    def group(self, members: Sequence[int]) -> _Group:
        """Any instances as a group (the planner only extends its own, from the root)."""
        if not members:
            return self.root
        k, queue = self.pool.per_node, self.queue
        nodes = {i // k for i in members}
        taken = set(members)
        near = sorted((i for nd in nodes for i in self.by_queue[nd] if i not in taken), key=queue.__getitem__)
        free = [nd for nd in self.node_order if nd not in nodes]
        return _Group(tuple(members), max(queue[i] for i in members), near, free)

    def chain(self, sizes: list[int]) -> list[_Group]:
        """Nested groups of these sizes, each extending the last, from the root (as many as fit)."""
        groups, group = [], self.root
        for sp in sizes:
            group = self.extend(group, sp)
            if group is None:
                break
            groups.append(group)
        return groups

    def extend(self, prev: _Group, sp: int) -> _Group | None:
        if sp not in prev.grown:
            group = self._extend(prev, sp)
            prev.grown[sp] = group and self._groups.setdefault(group.members, group)
        return prev.grown[sp]

    def _extend(self, prev: _Group, sp: int) -> _Group | None:
        need = sp - len(prev.members)
        if need < 0 or sp > len(self.queue):
            return None
        if need == 0:
            return prev
        if prev is not self.root and not prev.near and self.root.grown.get(len(prev.members)) is prev:
            return self.extend(self.root, sp)  # whole nodes in the root's order: the same as from the root
        members, ready, near, free = list(prev.members), prev.ready, prev.near, prev.free
        if near:  # fill prev's nodes first
            took = near[:need]
            members += took
            ready = max(ready, self.queue[took[-1]])  # near is in queue order
            near, need = near[need:], need - len(took)
            if not need:
                return _Group(tuple(members), ready, near, free)
        whole, rest = divmod(need, self.pool.per_node)
        if whole > len(free) or (whole == len(free) and rest):
            return None
        for nd in free[:whole]:
            members += self.by_queue[nd]
        if whole:
            ready = max(ready, self.kth[-1][free[whole - 1]])  # free nodes are in order of readiness
        free = free[whole:]
        if rest:  # the node whose rest-th shortest queue is shortest
            nd = min(free, key=self.kth[rest - 1].__getitem__)
            members += self.by_queue[nd][:rest]
            ready = max(ready, self.kth[rest - 1][nd])
            near = self.by_queue[nd][rest:]
            free.remove(nd)
        return _Group(tuple(members), ready, near, free)


class FixedSPPlanner:
    """Baseline (Tetris 7.1): the pool split into independent groups of `sp` co-located instances; a request
    goes whole to the group that frees up first."""

    def __init__(self, model: TetrisPrefill, pool: Pool, sp: int):
        if pool.size % sp:
            raise ValueError(f"a pool of {pool.size} instances does not split into groups of {sp}")
        self.model, self.pool, self.sp = model, pool, sp

    def groups(self) -> list[tuple[int, ...]]:
        return [tuple(range(g, g + self.sp)) for g in range(0, self.pool.size, self.sp)]

    def on_arrival(self, t: float) -> None:
        del t  # plans from the queues alone

    def plan(self, tokens: int, queues: Sequence[float]) -> ChunkPlan:
        group, start = first_free(self.groups(), queues)
        return ChunkPlan((Chunk(tokens, 0, group, start, start + self.model.predict(self.sp, tokens)),))


def first_free(groups: Sequence[tuple[int, ...]], queues: Sequence[float]) -> tuple[tuple[int, ...], float]:
    """The group whose instances are all free first (the earliest in `groups` on a tie), and when."""
    q = np.maximum(np.asarray(queues, np.float64), 0.0)
    group = min(groups, key=lambda g: q[list(g)].max())
    return group, float(q[list(group)].max())
