"""Iteration time of a mixed batch (prefill chunks with history + decodes): what the batch packer asks while it
fills a time budget, and what the simulator charges for a Plan.

A batch is summed up in a BatchState as it is built, chunk by chunk; a cost model prices the state. Two kinds:

- additive (GPU profiles, Tetris Eq. (1)): overhead + linear_ops(total tokens) + the sum of each sequence's
  attention. Linear ops see the batch's tokens together, which is where batching pays.
- the engine's own (EngineStepCost, measured by engine/profile.py): the program that runs the batch is chosen by
  its (tokens, rows) bucket, and its attention runs over every tile of the bucket to the batch's longest context.
"""

from __future__ import annotations

import abc
import bisect
import dataclasses
import itertools
from typing import Iterable, Iterator, Sequence

from jaxserve.sched.cost_models import TetrisPrefill
from jaxserve.sched.step_shapes import StepShapes


@dataclasses.dataclass(frozen=True, slots=True)
class BatchState:
    """A batch under construction, as much as any cost model needs to price it in O(1)."""

    tokens: int = 0
    rows: int = 0
    attention: float = 0.0  # additive models: the sum of the sequences' attention
    prefills: int = 0  # prefill chunks
    decode_span: int = 0  # the longest context a decode reads
    decode_kv: int = 0  # the decodes' contexts summed
    exchanged: int = 0  # query tokens whose partial attention is merged across KV-parallel workers

    def time(self, cost: BatchCost) -> float:
        return cost.time(self)


class BatchCost(abc.ABC):
    @abc.abstractmethod
    def time(self, state: BatchState) -> float:
        """Seconds for one iteration of the batch `state` sums up (0 for an empty one)."""

    def add_prefill(self, state: BatchState, n: int, h: int) -> BatchState:
        """`state` with a chunk of n tokens after h cached ones."""
        # built directly, not by dataclasses.replace: the packer calls this in its inner loop
        return BatchState(
            state.tokens + n,
            state.rows + 1,
            state.attention + self.chunk_attention(n, h),
            state.prefills + 1,
            state.decode_span,
            state.decode_kv,
            state.exchanged + self.chunk_kvp_rows(n, h + n),
        )

    def add_decodes(self, state: BatchState, kvs: Sequence[int]) -> BatchState:
        """`state` with one decode token per entry of kvs, each over that many cached tokens."""
        if not kvs:
            return state
        return BatchState(
            state.tokens + len(kvs),
            state.rows + len(kvs),
            state.attention + self.decodes_attention(kvs),
            state.prefills,
            max(state.decode_span, max(kvs)),
            state.decode_kv + sum(kvs),
            state.exchanged + self.decodes_kvp_rows(kvs),
        )

    def chunk_attention(self, n: int, h: int) -> float:
        """What a chunk adds to BatchState.attention (additive models; others price the spans)."""
        return 0.0

    def decodes_attention(self, kvs: Sequence[int]) -> float:
        """What decodes over `kvs` add to BatchState.attention."""
        return 0.0

    def chunk_kvp_rows(self, n: int, context: int) -> int:
        """Of a chunk's n query tokens over `context` cached ones, how many have their attention merged across
        KV-parallel workers (0 without KV parallelism)."""
        return 0

    def decodes_kvp_rows(self, kvs: Sequence[int]) -> int:
        """Of decodes over `kvs`, how many have their attention merged across KV-parallel workers."""
        return 0

    def batch_time(self, prefills: Iterable[tuple[int, int]] = (), decode_kvs: Sequence[int] = ()) -> float:
        state = self.add_decodes(BatchState(), decode_kvs)
        for n, h in prefills:
            state = self.add_prefill(state, n, h)
        return self.time(state)

    def burst_steps(self, rows: Sequence[tuple[int, int]]) -> Iterator[float]:
        """The times of a multi-step decode's steps, one after another: every row (start, tokens) runs in each
        step, its context growing with its tokens and then staying (a row past its share still runs, its writes
        discarded)."""
        for j in itertools.count():
            yield self.time(self.add_decodes(BatchState(), [start + min(j, n - 1) for start, n in rows]))

    def burst_time(self, rows: Sequence[tuple[int, int]], steps: int) -> float:
        return sum(itertools.islice(self.burst_steps(rows), steps))


class AdditiveBatchCost(BatchCost):
    """overhead + linear_ops(tokens) + sum(prefill attention) + sum(decode attention) + KV-parallel exchange."""

    overhead: float = 0.0

    @abc.abstractmethod
    def linear_ops(self, tokens: int) -> float:
        """Seconds for the non-attention work of a batch holding `tokens` tokens in total."""

    @abc.abstractmethod
    def prefill_attention(self, n: int, h: int) -> float:
        """Seconds of attention for a chunk of n tokens after h cached ones."""

    @abc.abstractmethod
    def decode_attention(self, kv: int) -> float:
        """Seconds of attention for one decode token over kv cached tokens."""

    def time(self, state: BatchState) -> float:
        if not state.tokens:
            return 0.0
        return self.overhead + self.linear_ops(state.tokens) + state.attention + self.exchange(state.exchanged)

    def exchange(self, rows: int) -> float:
        """Seconds to merge `rows` query tokens' partial attention across KV-parallel workers, every layer."""
        return 0.0

    def chunk_attention(self, n: int, h: int) -> float:
        return self.prefill_attention(n, h)

    def decodes_attention(self, kvs: Sequence[int]) -> float:
        return sum(self.decode_attention(kv) for kv in kvs)


class TetrisBatchCost(AdditiveBatchCost):
    """Tetris Eq. (1) at one SP size, spread over a batch: c0 once, c1 per token, c2*n*h + c3*n^2 per chunk.
    A decode is a chunk of one token after kv."""

    def __init__(self, model: TetrisPrefill, sp: int = 1):
        self.overhead, self.c1, self.c2, self.c3 = (float(c) for c in model.coef(sp))

    def linear_ops(self, tokens: int) -> float:
        return self.c1 * tokens

    def prefill_attention(self, n: int, h: int) -> float:
        return self.c2 * n * h + self.c3 * n * n

    def decode_attention(self, kv: int) -> float:
        return self.c2 * kv + self.c3


class PiecewiseLinear:
    """y(x) through sorted points, extended linearly past the last one (profiles stop at a max token count)."""

    def __init__(self, xs: Sequence[float], ys: Sequence[float]):
        merged: dict[float, list[float]] = {}  # repeated measurements of one x: their mean
        for x, y in zip(xs, ys):
            merged.setdefault(float(x), []).append(float(y))
        self.xs = sorted(merged)
        self.ys = [sum(merged[x]) / len(merged[x]) for x in self.xs]
        if len(self.xs) < 2:
            raise ValueError("a piecewise-linear profile needs at least two points")
        tail = max(len(self.xs) // 8, 1)  # slope of the last eighth: robust to one noisy point
        self.tail_slope = (self.ys[-1] - self.ys[-1 - tail]) / (self.xs[-1] - self.xs[-1 - tail])

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x >= xs[-1]:
            return ys[-1] + (x - xs[-1]) * self.tail_slope
        if x <= xs[0]:
            return ys[0]
        i = bisect.bisect_right(xs, x)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def tile_key_blocks(n: int, h: int, tile: int, key_block: int) -> int:
    """The key blocks a chunk of n tokens after h cached ones reads, cut into tiles of `tile` tokens, each tile
    reading as far as its own last token."""
    return sum(-(-(h + min(end, n)) // key_block) for end in range(tile, n + tile, tile))


class EngineStepCost(BatchCost):
    """The engine's step time, as engine/profile.py measured it. A batch of decodes alone runs in the decode
    program of its rows (sched.step_shapes), which costs `decode_base` without attention; any other batch runs in
    the smallest mixed (tokens, rows) program that holds it, which costs `base` without attention. The attention
    (the jnp reference in pallas_kernels/ragged_paged_attention.py) runs over every tile / every decode row of the
    program, key block by key block: each prefill tile to its own last position, `tile_fixed + tile_block *
    key_blocks` (a padding tile reads none: its cost is in `base`); the decode rows together, up to the longest
    decode context, per decode row `decode_fixed`, plus `decode_block` per key block of its own context and
    `decode_pad_block` per block past it (a padding block: the scratch block, read again and again, costs less
    than a block of real keys), padding rows included."""

    def __init__(
        self,
        shapes: StepShapes,
        key_block: int,
        base: Sequence[Sequence[float]],
        decode_base: Sequence[float],
        tile_fixed: float,
        tile_block: float,
        decode_fixed: float,
        decode_block: float,
        decode_pad_block: float,
    ):
        if [len(row) for row in base] != [len(shapes.rows)] * len(shapes.tokens):
            raise ValueError("need one measured base time per (token bucket, row bucket)")
        if len(decode_base) != len(shapes.decode_rows):
            raise ValueError("need one measured base time per decode program")
        self.shapes, self.key_block = shapes, key_block
        self.base = [list(row) for row in base]
        self.decode_base = list(decode_base)
        self.tile_fixed, self.tile_block = tile_fixed, tile_block
        self.decode_fixed, self.decode_block, self.decode_pad_block = decode_fixed, decode_block, decode_pad_block

    def _blocks(self, span: int) -> int:
        return -(-span // self.key_block)

    def chunk_attention(self, n: int, h: int) -> float:
        tiles = -(-n // self.shapes.tile)
        return tiles * self.tile_fixed + self.tile_block * tile_key_blocks(n, h, self.shapes.tile, self.key_block)

    def time(self, state: BatchState) -> float:
        if not state.tokens:
            return 0.0
        shapes = self.shapes
        if not state.prefills:
            # decodes past the largest program (a simulator's what-if) price at its rate per row
            r = shapes.fit_decode(min(state.rows, shapes.decode_rows[-1]))
            base = self.decode_base[shapes.decode_rows.index(r)] * max(state.rows / r, 1.0)
            return base + self._decodes(state, max(r, state.rows))
        # rows past the largest bucket (a simulator's what-if) price at the largest; tokens past it, at its rate
        rows = min(state.rows, shapes.rows[-1])
        if max(state.tokens, rows) <= shapes.tokens[-1]:
            t, r = shapes.fit(state.tokens, rows)
            base = self.base[shapes.tokens.index(t)][shapes.rows.index(r)]
        else:
            t, r = state.tokens, shapes.fit(0, rows)[1]
            base = self.base[-1][shapes.rows.index(r)] * t / shapes.tokens[-1]
        return base + state.attention + self._decodes(state, r)

    def _decodes(self, state: BatchState, r: int) -> float:
        """The decode attention of a program with r decode rows."""
        if not state.decode_span:
            return 0.0
        own = state.decode_kv / self.key_block
        return (
            r * self.decode_fixed
            + self.decode_block * own
            + self.decode_pad_block * (r * self._blocks(state.decode_span) - own)
        )

    def to_dict(self) -> dict:
        return {
            "shapes": self.shapes.to_dict(),
            "key_block": self.key_block,
            "base": self.base,
            "decode_base": self.decode_base,
            "tile_fixed": self.tile_fixed,
            "tile_block": self.tile_block,
            "decode_fixed": self.decode_fixed,
            "decode_block": self.decode_block,
            "decode_pad_block": self.decode_pad_block,
        }

    @classmethod
    def from_dict(cls, d: dict) -> EngineStepCost:
        return cls(
            StepShapes.from_dict(d["shapes"]),
            d["key_block"],
            d["base"],
            d["decode_base"],
            d["tile_fixed"],
            d["tile_block"],
            d["decode_fixed"],
            d["decode_block"],
            d["decode_pad_block"],
        )
