"""Tetris's Eq. (1) measured on the live prefill pool: the latency of a chunk of n tokens after h history tokens on
an SP group of each size, c0 + c1*n + c2*n*h + c3*n^2, fitted to timed chunks (the compiled program, the ring over
the group and the sampled token back on the host). The CDSP planner plans with it; measured once per device
kind, model, dtype and pool shape, cached on disk as the engine's step profile is (engine/profile.py).

A chunk runs in power-of-two per-device buckets, so its time is a step function of n: the points are chunks that
fill their bucket (what a planned chunk costs at worst), a ladder of them at no history and two after a long one.
Each point takes seconds: the ladder stops where a chunk's run passes BUDGET_S (what the fit needs, not every
chunk the pool runs), and a history is assumed, not computed (only its length costs the chunk time).

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
from typing import Any, Callable, Generic, Iterator, TypeVar

import jax
from tqdm.auto import tqdm

from jaxserve import disk_cache
from jaxserve.engine import profile
from jaxserve.sampling_params import SamplingParams
from jaxserve.engine.sp_prefill import Group, SPPrefill
from jaxserve.sched.cdsp import MeasuredBalancing
from jaxserve.sched.cost_models import KeyedLinearModel, LoongServePrefill, TetrisPrefill

VERSION = 2  # of the chunk step and of how it is measured: a change to either must not load an older profile
_GREEDY = SamplingParams(max_tokens=1)
_RID = "eq1-profile"
BUDGET_S = 4.0  # a chunk's run past which a ladder stops growing (after three): each point takes seconds
LONG_S = 1.0  # a run past which one timed run is a point's time (shorter ones: the median of REPEATS)
REPEATS = 3
T = TypeVar("T")


class Measurement(Generic[T]):
    """A model fitted to timed points, measured one point at a time. Which point comes next may depend on the
    samples so far (a ladder of chunks stops growing once one takes BUDGET_S)."""

    def __init__(
        self,
        name: str,
        points: Callable[[list], Iterator[Callable[[], Any]]],
        fit: Callable[[list], T],
        most: int,
        prepare: Callable[[], None] = lambda: None,
    ):
        """points(samples): the points, each a call that times one sample, chosen as the samples so far say;
        most: how many there are at most (the progress shown); fit: the model from the samples; prepare: what
        must be done before the first point (compiling the programs the points run: a timing must not include
        a compile)."""
        self.name, self.fit, self.most, self.prepare = name, fit, most, prepare
        self._points, self._left = points, None
        self.samples: list = []
        self.done = False

    def step(self) -> None:
        """Time the next point (a call that finds none left marks the measurement done)."""
        if self._left is None:
            self.prepare()
            self._left = iter(self._points(self.samples))
        point = next(self._left, None)
        if point is None:
            self.done = True
        else:
            self.samples.append(point())

    def run(self, progress: bool = True) -> T:
        """Every point left, then the model."""
        with tqdm(total=self.most, desc=self.name, unit="point", disable=not progress) as bar:
            while not self.done:
                self.step()
                bar.update(len(self.samples) - bar.n)
        return self.fit(self.samples)


@dataclasses.dataclass
class Later(Generic[T]):
    """A measurement a cluster takes while idle: when done, its model is written to `path` and put to use."""

    measurement: Measurement[T]
    path: pathlib.Path
    dumps: Callable[[T], str]
    use: Callable[[T], None]
    seconds: float = 0.0  # spent on the points so far

    @property
    def name(self) -> str:
        return self.measurement.name

    @property
    def done(self) -> bool:
        return self.measurement.done

    def step(self) -> None:
        """Time the next point, logged with its seconds (the progress of a measurement no bar shows)."""
        start, taken = time.perf_counter(), len(self.measurement.samples)
        if not taken:
            logging.warning(
                "%s while idle: at most %d points of seconds each (each logged at INFO)",
                self.name,
                self.measurement.most,
            )
        self.measurement.step()
        took = time.perf_counter() - start
        self.seconds += took
        if len(self.measurement.samples) > taken:
            logging.info("%s: point %d (of at most %d) took %.1f s", self.name, taken + 1, self.measurement.most, took)

    def finish(self) -> None:
        model = self.measurement.fit(self.measurement.samples)
        disk_cache.write_text(self.path, self.dumps(model))
        self.use(model)
        # warnings: the CLI shows them by default, and each is said once a pool
        logging.warning(
            "%s: measured in %d points, %.0f s (%s); the pool plans with it from now on",
            self.name,
            len(self.measurement.samples),
            self.seconds,
            self.path,
        )


def ladder(
    sp: SPPrefill, size: int, max_tokens: int, samples: list, point: Callable[[int], Callable[[], Any]]
) -> Iterator[Callable[[], Any]]:
    """Chunks on `size` instances that fill their bucket, from the smallest up to max_tokens, one point each
    (point(tokens)); after three, the ladder stops at the first whose time (samples[-1]'s last field) passes
    BUDGET_S: the fit extrapolates to the longer ones."""
    for k, n in enumerate(size * b for b in sp.buckets(size, max_tokens)):
        yield point(n)
        if k >= 2 and samples[-1][-1] > BUDGET_S:
            return


def time_chunk(sp: SPPrefill, group: Group, tokens: int, history: int, warm: bool) -> float:
    """Seconds of a chunk of `tokens` after `history` tokens on `group` (the history assumed, not computed:
    SPPrefill.assume_history): one run past LONG_S, else the median of REPEATS, after a run dropped when `warm`
    (the program's first: it compiles nothing, the programs are built first, but warms caches)."""

    def once() -> float:
        sp.assume_history(_RID, group, history)
        try:
            start = time.perf_counter()
            sp.run_chunk(_RID, group, [1] * tokens, history, _GREEDY, 0).token()
            return time.perf_counter() - start
        finally:
            sp.release(_RID)

    if warm:
        once()
    times = [once()]
    if times[0] < LONG_S:
        times += [once() for _ in range(REPEATS - 1)]
    return statistics.median(times)


def time_move(sp: SPPrefill, held: Group, group: Group, history: int) -> tuple[int, float]:
    """Rows moved and median seconds of spreading `history` tokens held on `held` over `group`, which extends it
    (the history assumed, not computed; the first run, which compiles the move's pieces, dropped)."""
    times, moved = [], 0
    for _ in range(REPEATS + 1):
        sp.assume_history(_RID, held, history)
        try:
            start = time.perf_counter()
            moved = sp.rebalance(_RID, group)
            jax.block_until_ready([(sp.stores[i].k, sp.stores[i].v) for i in group])
            times.append(time.perf_counter() - start)
        finally:
            sp.release(_RID)
    return moved, statistics.median(times[1:])


def moves_measurement(
    sp: SPPrefill, groups: dict[int, Group], max_tokens: int, per_node: int
) -> Measurement[MeasuredBalancing]:
    """The move's line from each pair of consecutive SP sizes whose groups nest (groups: size -> instance ids),
    at a short and at the longest history the smaller group holds."""
    sizes = sorted(groups)
    work = []
    for small, large in zip(sizes, sizes[1:]):
        if set(groups[small]) <= set(groups[large]):
            longest = min(max_tokens, sp.room.longest(small))
            work += [(small, large, h) for h in sorted({longest // 4, longest}) if h]
    points = [functools.partial(time_move, sp, groups[small], groups[large], h) for small, large, h in work]
    return Measurement(
        "measure cache balancing",
        lambda samples: points,
        lambda samples: MeasuredBalancing.fit(*zip(*samples), per_node=per_node),
        len(points),
    )


def load_moves(path: pathlib.Path, per_node: int) -> MeasuredBalancing:
    """The move's line in `path`, checked against the pool."""
    moves = MeasuredBalancing(**json.loads(path.read_text()))
    if moves.per_node != per_node or moves.fixed < 0 or moves.per_token < 0:
        raise ValueError(f"the cache balancing profile {path} is not this pool's ({per_node} instances a node)")
    return moves


def dumps_moves(moves: MeasuredBalancing) -> str:
    return json.dumps(dataclasses.asdict(moves))


def chunk_seconds(sp: SPPrefill, groups: dict[int, Group]) -> Callable[[int, int, int], float]:
    """seconds(size, tokens, history): time_chunk on the group of that size (groups: size -> instance ids), with a
    run dropped the first time a program runs."""
    ran: set[tuple[int, int]] = set()  # (SP size, local bucket) run: its program's caches are warm

    def seconds(size: int, n: int, h: int) -> float:
        local = sp.local_bucket(size, n)
        took = time_chunk(sp, groups[size], n, h, warm=(size, local) not in ran)
        ran.add((size, local))
        return took

    return seconds


def compile_buckets(sp: SPPrefill, groups: dict[int, Group], max_tokens: int) -> None:
    """Every chunk program of up to max_tokens on each group: a timing must not include a compile."""
    for size, group in groups.items():
        for b in sp.buckets(size, max_tokens):
            sp.program(group, b)


def eq1_measurement(sp: SPPrefill, groups: dict[int, Group], max_tokens: int) -> Measurement[TetrisPrefill]:
    """Eq. (1) per SP size from chunks timed on one group of that size (groups: size -> instance ids): a ladder
    of chunks up to half of max_tokens at no history (c0, c1, c3), then the smallest and the ladder's last after
    the longest history that leaves room for them (c2)."""
    seconds = chunk_seconds(sp, groups)

    def point(size: int, n: int, h: int) -> Callable[[], tuple]:
        return lambda: (size, (n, h), seconds(size, n, h))

    def points(samples: list) -> Iterator[Callable[[], tuple]]:
        for size in sorted(groups):
            yield from ladder(sp, size, max_tokens // 2, samples, lambda n: point(size, n, 0))
            top = samples[-1][1][0]
            for n in sorted({size * sp.min_local, top}):
                if (h := min(max_tokens - n, sp.room.history_room(size, n))) > 0:
                    yield point(size, n, h)

    most = sum(len(sp.buckets(size, max_tokens // 2)) + 2 for size in groups)
    return Measurement(
        "measure Eq. (1) chunk latency",
        points,
        TetrisPrefill.fit,
        most,
        functools.partial(compile_buckets, sp, groups, max_tokens // 2),
    )


def batch_measurement(sp: SPPrefill, groups: dict[int, Group], max_tokens: int) -> Measurement[LoongServePrefill]:
    """LoongServe's batch model per (SP size, TP) from whole prompts timed on one group of each size, a ladder up
    to max_tokens: a batch of one prompt of l tokens has sum(l) = l and sum(l^2) = l^2."""
    seconds = chunk_seconds(sp, groups)

    def point(size: int, n: int) -> Callable[[], tuple]:
        return lambda: ((size, sp.tp), (n, n * n), seconds(size, n, 0))

    def points(samples: list) -> Iterator[Callable[[], tuple]]:
        for size in sorted(groups):
            yield from ladder(sp, size, max_tokens, samples, functools.partial(point, size))

    most = sum(len(sp.buckets(size, max_tokens)) for size in groups)
    return Measurement(
        "measure ESP prefill latency",
        points,
        LoongServePrefill.fit,
        most,
        functools.partial(compile_buckets, sp, groups, max_tokens),
    )


def prefill_measurement(sp: SPPrefill, groups: dict[int, Group], max_tokens: int, esp: bool = False) -> Measurement:
    """Eq. (1), or with esp LoongServe's batch model."""
    return (batch_measurement if esp else eq1_measurement)(sp, groups, max_tokens)


def default_path(
    model_name: str, dtype: str, policy: str, pool_size: int, node_size: int, tp: int, capacity: int, key_block: int
) -> pathlib.Path:
    """Per device kind, model, dtype, policy and pool shape (what the chunk programs and their timings depend on)."""
    shape = f"{policy}-p{pool_size}x{node_size}-tp{tp}-cap{capacity}-kb{key_block}"
    return profile.cache_file(model_name, dtype, shape, VERSION)


def load_or_measure(
    path: pathlib.Path,
    sp: SPPrefill,
    groups: dict[int, Group],
    max_tokens: int,
    progress: bool = True,
    esp: bool = False,
) -> KeyedLinearModel:
    """The fit in `path` (Eq. (1), or with esp LoongServe's batch model), measured (and written there) first if
    the file does not exist."""
    kind = LoongServePrefill if esp else TetrisPrefill
    return profile.cached(
        path,
        lambda: load(path, kind, keys_of(sp, groups, esp)),
        lambda: prefill_measurement(sp, groups, max_tokens, esp).run(progress),
        kind.to_json,
    )


def keys_of(sp: SPPrefill, groups: dict[int, Group], esp: bool = False) -> set:
    """The keys a pool's model has: SP sizes, or with esp (SP size, TP) pairs."""
    return {(s, sp.tp) for s in groups} if esp else set(groups)


def load(path: pathlib.Path, kind: type[KeyedLinearModel], keys: set) -> KeyedLinearModel:
    """The fit in `path`, checked against the pool's SP sizes."""
    model = kind.from_json(path.read_text())
    if set(model.coefficients) != keys:
        raise ValueError(
            f"the prefill profile {path} was fitted for {sorted(model.coefficients)}, not this pool's {sorted(keys)}"
        )
    return model


def load_or_later(
    path: pathlib.Path,
    sp: SPPrefill,
    groups: dict[int, Group],
    max_tokens: int,
    use: Callable[[KeyedLinearModel], None],
    esp: bool = False,
) -> tuple[KeyedLinearModel, Later | None]:
    """The fit in `path`; with none there, the prior (sched/cost_models.py) and the Later that measures the
    pool's own while it idles, `use` taking it."""
    kind = LoongServePrefill if esp else TetrisPrefill
    keys = keys_of(sp, groups, esp)
    kept = profile.read_kept(path, lambda: load(path, kind, keys))
    if kept is not None:
        return kept, None
    logging.warning(
        "the prefill pool plans with a prior model (sched/cost_models.py: short prompts on the smallest "
        "group, long ones on the largest) until its own is measured, while it idles (%s)",
        path,
    )
    return kind.prior(sorted(keys)), Later(prefill_measurement(sp, groups, max_tokens, esp), path, kind.to_json, use)


def moves_or_later(
    path: pathlib.Path,
    sp: SPPrefill,
    groups: dict[int, Group],
    max_tokens: int,
    per_node: int,
    use: Callable[[MeasuredBalancing], None],
) -> tuple[MeasuredBalancing | None, Later | None]:
    """The move's line in `path`; with none there, None (moves priced free) and the Later that measures it."""
    kept = profile.read_kept(path, lambda: load_moves(path, per_node))
    if kept is not None:
        return kept, None
    return None, Later(moves_measurement(sp, groups, max_tokens, per_node), path, dumps_moves, use)


def load_or_measure_moves(
    path: pathlib.Path, sp: SPPrefill, groups: dict[int, Group], max_tokens: int, per_node: int, progress: bool = True
) -> MeasuredBalancing:
    """The move's line in `path`, measured (and written there) first if the file does not exist."""
    return profile.cached(
        path,
        lambda: load_moves(path, per_node),
        lambda: moves_measurement(sp, groups, max_tokens, per_node).run(progress),
        dumps_moves,
    )
