"""Iteration time of a mixed batch (prefill chunks with history + decodes): what the batch packer asks while it
fills a time budget, and what the simulator charges for a Plan.

    T = overhead + linear_ops(total tokens) + sum(prefill attention) + sum(decode attention)

Linear ops (projections, MLP, norms) see the batch's tokens together, which is where batching pays: measured
profiles are flat (memory-bound) up to a knee and grow beyond it. Attention is per sequence.
"""

from __future__ import annotations

import abc
import bisect
from typing import Iterable, Sequence

from jaxserve.sched.cost_models import TetrisPrefill


class BatchCost(abc.ABC):
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

    def time(self, tokens: int, attention: float) -> float:
        return self.overhead + self.linear_ops(tokens) + attention if tokens else 0.0

    def batch_time(self, prefills: Iterable[tuple[int, int]] = (), decode_kvs: Sequence[int] = ()) -> float:
        tokens, attention = len(decode_kvs), sum(self.decode_attention(kv) for kv in decode_kvs)
        for n, h in prefills:
            tokens += n
            attention += self.prefill_attention(n, h)
        return self.time(tokens, attention)


class TetrisBatchCost(BatchCost):
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


class BucketedBatchCost(BatchCost):
    """Iteration time measured on the serving engine itself (engine/profile.py): the engine runs one compiled
    program per token bucket, so the non-attention time is a step function of the batch's tokens (the measured
    time of the smallest bucket that holds them); attention adds a measured cost per (query, history key) pair
    for prefill chunks and per cached key for decodes."""

    def __init__(self, token_buckets: Sequence[int], step_times: Sequence[float], prefill_pair: float,
                 decode_key: float):
        if len(token_buckets) != len(step_times) or not token_buckets:
            raise ValueError("need one measured step time per token bucket")
        self.token_buckets, self.step_times = list(token_buckets), list(step_times)
        self.prefill_pair, self.decode_key = prefill_pair, decode_key
        # past the largest bucket (never run by the engine, asked by Algorithm 3's long prompts): its per-token rate
        self._tail_rate = self.step_times[-1] / self.token_buckets[-1]

    def linear_ops(self, tokens: int) -> float:
        i = bisect.bisect_left(self.token_buckets, tokens)
        return self.step_times[i] if i < len(self.step_times) else tokens * self._tail_rate

    def prefill_attention(self, n: int, h: int) -> float:
        return self.prefill_pair * n * h

    def decode_attention(self, kv: int) -> float:
        return self.decode_key * kv

    def to_dict(self) -> dict:
        return {"token_buckets": self.token_buckets, "step_times": self.step_times,
                "prefill_pair": self.prefill_pair, "decode_key": self.decode_key}

    @classmethod
    def from_dict(cls, d: dict) -> BucketedBatchCost:
        return cls(d["token_buckets"], d["step_times"], d["prefill_pair"], d["decode_key"])
