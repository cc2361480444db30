"""Tetris's Eq. (1) measured on the live prefill pool: the latency of a chunk of n tokens after h history tokens on
an SP group of each size, c0 + c1*n + c2*n*h + c3*n^2, fitted to timed chunks (the compiled program, the ring over
the group and the sampled token back on the host). The CDSP planner plans with it; measured once per device
kind, model, dtype and pool shape, cached on disk as the engine's step profile is (engine/profile.py).

A chunk runs in power-of-two per-device buckets, so its time is a step function of n: the grid measures chunks
that fill their bucket (what a planned chunk costs at worst) at no history and at a long one.

The live pool's cache balancing (a prompt's history spread over its next chunk's larger group) is a move ahead of
the chunk: timed on each pair of nested groups, the rows moved against the seconds, a line the planner prices the
move with (sched/cdsp.py's MeasuredBalancing), cached beside Eq. (1).

The ESP policy plans with LoongServe's batch model instead, a + b*sum(l) + c*sum(l^2) per SP size, fitted to
whole prompts (no history) timed the same way.

Each model is a Measurement, timed one point at a time: at start (`run`), or, after a quick start, while a server
idles (ClusterEngine.run_deferred: a point at a time, yielding to requests between points), the pool planning
with a prior until then (`Later`: written to the cache and put to use when done).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import pathlib
import statistics
import time
from typing import Any, Callable, Generic, TypeVar

import jax
from tqdm.auto import tqdm

from jaxserve import disk_cache
from jaxserve.engine import profile
from jaxserve.sampling_params import SamplingParams
from jaxserve.engine.sp_prefill import Group, SPPrefill
from jaxserve.sched.cdsp import MeasuredBalancing
from jaxserve.sched.cost_models import KeyedLinearModel, LoongServePrefill, TetrisPrefill

VERSION = 1  # of the chunk step and of how it is measured: a change to either must not load an older profile
_GREEDY = SamplingParams(max_tokens=1)
_RID = "eq1-profile"
T = TypeVar("T")


class Measurement(Generic[T]):
    """A model fitted to timed points, measured one point at a time."""

    def __init__(self, name: str, points: list[Callable[[], Any]], fit: Callable[[list], T],
                 prepare: Callable[[], None] = lambda: None):
        """points: each times one sample; fit: the model from the samples; prepare: what must be done before the
        first point (compiling the programs the points run: a timing must not include a compile)."""
        self.name, self.points, self.fit, self.prepare = name, points, fit, prepare
        self.samples: list = []

    @property
    def done(self) -> bool:
        return len(self.samples) == len(self.points)

    def step(self) -> None:
        """Time the next point."""
        if not self.samples:
            self.prepare()
        self.samples.append(self.points[len(self.samples)]())

    def run(self, progress: bool = True) -> T:
        """Every point left, then the model."""
        for _ in tqdm(range(len(self.points) - len(self.samples)), desc=self.name, unit="point",
                      disable=not progress):
            self.step()
        return self.fit(self.samples)


@dataclasses.dataclass
class Later(Generic[T]):
    """A measurement a cluster takes while idle: when done, its model is written to `path` and put to use."""

    measurement: Measurement[T]
    path: pathlib.Path
    dumps: Callable[[T], str]
    use: Callable[[T], None]

    def finish(self) -> None:
        model = self.measurement.fit(self.measurement.samples)
        disk_cache.write_text(self.path, self.dumps(model))
        self.use(model)
        # warnings: the CLI shows them by default, and each is said once a pool
        logging.warning("%s: measured (%s); the pool plans with it from now on", self.measurement.name, self.path)


def grid(sp: SPPrefill, size: int, max_tokens: int) -> list[tuple[int, int]]:
    """(tokens, history) points for one SP size: the smallest, a middle and the largest full bucket at no
    history, and the smallest and largest after the longest history that leaves room for them."""
    full = [size * b for b in sp.buckets(size, max_tokens // 2)]
    small, mid, large = full[0], full[len(full) // 2], full[-1]
    points = [(small, 0), (mid, 0), (large, 0)]
    for n in (small, large):  # the history as long as the group's stores leave room for the chunk
        h = min(max_tokens - n, sp.room.history_room(size, n))
        if h > 0:
            points.append((n, h))
    return sorted(set(points))


def time_chunk(sp: SPPrefill, group: Group, tokens: int, history: int, repeats: int) -> float:
    """Median seconds of a chunk of `tokens` after `history` tokens on `group` (the history written first, untimed).
    The first repetition compiles nothing (the programs are built first) but warms caches and is dropped."""
    times = []
    for _ in range(repeats + 1):
        sp.claim(_RID, group)
        try:
            _write_history(sp, group, history)
            if history:
                sp.rebalance(_RID, group)  # even shares, as before a planned chunk
            start = time.perf_counter()
            sp.run_chunk(_RID, group, [1] * tokens, history, _GREEDY, 0).token()
            times.append(time.perf_counter() - start)
        finally:
            sp.release(_RID)
    return statistics.median(times[1:])


def _write_history(sp: SPPrefill, group: Group, history: int) -> None:
    """`history` tokens of _RID's prompt on `group`, in chunks (one store may not hold it all)."""
    done = 0
    for n in sp.room.filling(len(group), history):
        sp.run_chunk(_RID, group, [1] * n, done, _GREEDY, 0).token()
        done += n


def time_move(sp: SPPrefill, held: Group, group: Group, history: int, repeats: int) -> tuple[int, float]:
    """Rows moved and median seconds of spreading `history` tokens written on `held` over `group`, which extends
    it (the history written first, untimed; the first repetition, which compiles the move's pieces, dropped)."""
    times, moved = [], 0
    for _ in range(repeats + 1):
        sp.claim(_RID, held)
        try:
            _write_history(sp, held, history)
            start = time.perf_counter()
            moved = sp.rebalance(_RID, group)
            jax.block_until_ready([(sp.stores[i].k, sp.stores[i].v) for i in group])
            times.append(time.perf_counter() - start)
        finally:
            sp.release(_RID)
    return moved, statistics.median(times[1:])


def moves_measurement(sp: SPPrefill, groups: dict[int, Group], max_tokens: int, per_node: int,
                      repeats: int = 2) -> Measurement[MeasuredBalancing]:
    """The move's line from each pair of consecutive SP sizes whose groups nest (groups: size -> instance ids),
    at a short and at the longest history the smaller group holds."""
    sizes = sorted(groups)
    work = []
    for small, large in zip(sizes, sizes[1:]):
        if set(groups[small]) <= set(groups[large]):
            longest = min(max_tokens, sp.room.longest(small))
            work += [(small, large, h) for h in sorted({longest // 4, longest}) if h]
    points = [functools.partial(time_move, sp, groups[small], groups[large], h, repeats) for small, large, h in work]
    return Measurement("measure cache balancing", points,
                       lambda samples: MeasuredBalancing.fit(*zip(*samples), per_node=per_node))


def load_moves(path: pathlib.Path, per_node: int) -> MeasuredBalancing:
    """The move's line in `path`, checked against the pool."""
    moves = MeasuredBalancing(**json.loads(path.read_text()))
    if moves.per_node != per_node or moves.fixed < 0 or moves.per_token < 0:
        raise ValueError(f"the cache balancing profile {path} is not this pool's ({per_node} instances a node)")
    return moves


def dumps_moves(moves: MeasuredBalancing) -> str:
    return json.dumps(dataclasses.asdict(moves))


def eq1_measurement(sp: SPPrefill, groups: dict[int, Group], max_tokens: int,
                    repeats: int = 2) -> Measurement[TetrisPrefill]:
    """Eq. (1) per SP size from chunks timed on one group of that size (groups: size -> instance ids)."""
    work = [(size, n, h) for size in sorted(groups) for n, h in grid(sp, size, max_tokens)]

    def compile_all() -> None:  # the timings must not include a compile
        for size, n, h in work:
            for t in (n, min(h, sp.room.largest(size, 0))):
                if t:
                    sp.program(groups[size], sp.local_bucket(size, t))

    def point(size: int, n: int, h: int) -> tuple:
        return size, (n, h), time_chunk(sp, groups[size], n, h, repeats)

    return Measurement("measure Eq. (1) chunk latency", [functools.partial(point, *w) for w in work],
                       TetrisPrefill.fit, compile_all)


def batch_measurement(sp: SPPrefill, groups: dict[int, Group], max_tokens: int,
                      repeats: int = 2) -> Measurement[LoongServePrefill]:
    """LoongServe's batch model per (SP size, TP) from whole prompts (each filling its bucket) timed on one group
    of each size: a batch of one prompt of l tokens has sum(l) = l and sum(l^2) = l^2."""
    work = []
    for size in sorted(groups):
        full = [size * b for b in sp.buckets(size, max_tokens)]
        work += [(size, n) for n in sorted({full[0], full[len(full) // 3], full[2 * len(full) // 3], full[-1]})]

    def compile_all() -> None:
        for size, n in work:
            sp.program(groups[size], sp.local_bucket(size, n))

    def point(size: int, n: int) -> tuple:
        return (size, sp.tp), (n, n * n), time_chunk(sp, groups[size], n, 0, repeats)

    return Measurement("measure ESP prefill latency", [functools.partial(point, *w) for w in work],
                       LoongServePrefill.fit, compile_all)


def prefill_measurement(sp: SPPrefill, groups: dict[int, Group], max_tokens: int, esp: bool = False) -> Measurement:
    """Eq. (1), or with esp LoongServe's batch model."""
    return (batch_measurement if esp else eq1_measurement)(sp, groups, max_tokens)


def default_path(model_name: str, dtype: str, policy: str, pool_size: int, node_size: int, tp: int, capacity: int,
                 key_block: int) -> pathlib.Path:
    """Per device kind, model, dtype, policy and pool shape (what the chunk programs and their timings depend on)."""
    shape = f"{policy}-p{pool_size}x{node_size}-tp{tp}-cap{capacity}-kb{key_block}"
    return profile.cache_file(model_name, dtype, shape, VERSION)


def load_or_measure(path: pathlib.Path, sp: SPPrefill, groups: dict[int, Group], max_tokens: int,
                    progress: bool = True, esp: bool = False) -> KeyedLinearModel:
    """The fit in `path` (Eq. (1), or with esp LoongServe's batch model), measured (and written there) first if
    the file does not exist."""
    kind = LoongServePrefill if esp else TetrisPrefill
    return profile.cached(path, lambda: load(path, kind, keys_of(sp, groups, esp)),
                          lambda: prefill_measurement(sp, groups, max_tokens, esp).run(progress), kind.to_json)


def keys_of(sp: SPPrefill, groups: dict[int, Group], esp: bool = False) -> set:
    """The keys a pool's model has: SP sizes, or with esp (SP size, TP) pairs."""
    return {(s, sp.tp) for s in groups} if esp else set(groups)


def load(path: pathlib.Path, kind: type[KeyedLinearModel], keys: set) -> KeyedLinearModel:
    """The fit in `path`, checked against the pool's SP sizes."""
    model = kind.from_json(path.read_text())
    if set(model.coefficients) != keys:
        raise ValueError(f"the prefill profile {path} was fitted for {sorted(model.coefficients)}, not this "
                         f"pool's {sorted(keys)}")
    return model


def load_or_later(path: pathlib.Path, sp: SPPrefill, groups: dict[int, Group], max_tokens: int,
                  use: Callable[[KeyedLinearModel], None], esp: bool = False) -> tuple[KeyedLinearModel, Later | None]:
    """The fit in `path`; with none there, the prior (sched/cost_models.py) and the Later that measures the
    pool's own while it idles, `use` taking it."""
    kind = LoongServePrefill if esp else TetrisPrefill
    keys = keys_of(sp, groups, esp)
    kept = profile.read_kept(path, lambda: load(path, kind, keys))
    if kept is not None:
        return kept, None
    logging.warning("the prefill pool plans with a prior model (sched/cost_models.py: short prompts on the smallest "
                    "group, long ones on the largest) until its own is measured, while it idles (%s)", path)
    return kind.prior(sorted(keys)), Later(prefill_measurement(sp, groups, max_tokens, esp), path, kind.to_json, use)


def moves_or_later(path: pathlib.Path, sp: SPPrefill, groups: dict[int, Group], max_tokens: int, per_node: int,
                   use: Callable[[MeasuredBalancing], None]) -> tuple[MeasuredBalancing | None, Later | None]:
    """The move's line in `path`; with none there, None (moves priced free) and the Later that measures it."""
    kept = profile.read_kept(path, lambda: load_moves(path, per_node))
    if kept is not None:
        return kept, None
    return None, Later(moves_measurement(sp, groups, max_tokens, per_node), path, dumps_moves, use)


def load_or_measure_moves(path: pathlib.Path, sp: SPPrefill, groups: dict[int, Group], max_tokens: int,
                          per_node: int, progress: bool = True) -> MeasuredBalancing:
    """The move's line in `path`, measured (and written there) first if the file does not exist."""
    return profile.cached(path, lambda: load_moves(path, per_node),
                          lambda: moves_measurement(sp, groups, max_tokens, per_node).run(progress), dumps_moves)
