"""Choosing a decode instance for a prefilled request (disaggregation), and the decode-length prediction that
TetriInfer's choice relies on.

- Freeness (Tetris 5.2, Llumnix): the instance with the most KV slots per running request, slots promised to
  transfers in flight counted as used ("virtual usage").
- Power of two with heavy/light balance (TetriInfer 3.3.4): among instances with enough memory for the request's
  predicted footprint, sample two; a heavy decode goes to the one with fewer heavy decodes (spreading them
  evenly keeps every instance's heavy:light ratio low), a light one to the less loaded.
- BucketPredictor: TetriInfer predicts a decode-length range (a bucket), not a count. The baseline here is the
  Bayes classifier from trace statistics: per prompt-length band, the most frequent output bucket. Anything with
  the same `predict` can replace it (TetriInfer fine-tunes a small LLM; sched/length_classifier.py reads the
  served model's features of the prompt).
- ObservedLengths: what a live server predicts with no trace to fit on: the mean output served so far.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Protocol, Sequence

import numpy as np

HEAVY_DECODE = 512  # TetriInfer 2.2.2: a decode of more than ~512 tokens is heavy


@dataclasses.dataclass(frozen=True)
class PromptInfo:
    """What a length predictor reads of a prompt: its length and, where the executor computes them, the served
    model's features of it (cluster/prompt_features.py; None in simulation)."""

    length: int
    features: np.ndarray | None = None


class LengthPredictor(Protocol):
    def predict(self, prompt: PromptInfo) -> tuple[int, int]:
        """The predicted decode-length range [lo, hi)."""

    def observe(self, prompt: PromptInfo, generated: int) -> None:
        """A request for `prompt` finished after `generated` tokens (a predictor that learns from what it served)."""


@dataclasses.dataclass(frozen=True)
class BucketPredictor:
    granularity: int
    band_edges: tuple[int, ...]  # prompt-length band boundaries, ascending
    buckets: tuple[int, ...]  # predicted bucket per band (len(band_edges) + 1 bands)

    @classmethod
    def fit(
        cls, prompt_lens: Sequence[int], output_lens: Sequence[int], granularity: int = 200, bands: int = 16
    ) -> "BucketPredictor":
        if granularity < 1:
            raise ValueError(f"granularity must be >= 1, got {granularity}")
        p, o = np.asarray(prompt_lens), np.asarray(output_lens)
        if len(p) != len(o) or not len(p):
            raise ValueError("need as many output lengths as prompt lengths, and at least one")
        edges = tuple(int(e) for e in np.unique(np.quantile(p, np.linspace(0, 1, bands + 1)[1:-1])))
        band = np.searchsorted(edges, p, side="right")
        bucket = o // granularity
        overall = int(np.bincount(bucket).argmax())
        per_band = tuple(
            int(np.bincount(bucket[band == b]).argmax()) if np.any(band == b) else overall
            for b in range(len(edges) + 1)
        )
        return cls(granularity, edges, per_band)

    def predict(self, prompt: PromptInfo) -> tuple[int, int]:
        b = self.buckets[int(np.searchsorted(self.band_edges, prompt.length, side="right"))]
        return b * self.granularity, (b + 1) * self.granularity

    def observe(self, prompt: PromptInfo, generated: int) -> None:
        del prompt, generated  # fitted on a trace; learns nothing while serving


def accuracy(predictor: LengthPredictor, prompts: Sequence[PromptInfo], output_lens: Sequence[int]) -> float:
    """Share of requests whose decode length falls in the predicted range (TetriInfer's measure)."""
    hits = [lo <= o < hi for p, o in zip(prompts, output_lens) for lo, hi in (predictor.predict(p),)]
    return float(np.mean(hits))


class ObservedLengths:
    """The default decode-length predictor: the mean output of the requests finished so far (a bucket of
    `granularity` around it), or `prior` before any."""

    def __init__(self, prior: int = 256, granularity: int = 64):
        self.prior, self.granularity, self.total, self.count = prior, granularity, 0, 0

    def observe(self, prompt: PromptInfo, generated: int) -> None:
        del prompt
        self.total, self.count = self.total + generated, self.count + 1

    def predict(self, prompt: PromptInfo) -> tuple[int, int]:
        del prompt
        mean = self.total / self.count if self.count else self.prior
        lo = int(mean) // self.granularity * self.granularity
        return lo, lo + self.granularity


@dataclasses.dataclass
class DecodeLoad:
    """What a dispatcher knows of one decode instance."""

    free_slots: int  # KV slots free, transfers in flight already subtracted
    running: int
    heavy: int = 0
    light: int = 0


def by_freeness(loads: Sequence[DecodeLoad]) -> int:
    return max(range(len(loads)), key=lambda i: (loads[i].free_slots / max(loads[i].running, 1), -i))


def power_of_two(loads: Sequence[DecodeLoad], need: int, heavy: bool, rng: random.Random) -> int:
    """TetriInfer's decentralised choice: `need` is prompt + predicted decode (upper bound)."""
    alpha = [i for i, load in enumerate(loads) if load.free_slots >= need]
    if not alpha:  # nobody has room for the prediction: the most free one, and it waits for memory there
        return max(range(len(loads)), key=lambda i: (loads[i].free_slots, -i))
    pair = rng.sample(alpha, 2) if len(alpha) >= 2 else alpha
    # spread heavy decodes evenly (they crowd a batch the longest); a light one goes where fewer are assigned
    if heavy:
        key = lambda i: (loads[i].heavy, loads[i].heavy + loads[i].light, -loads[i].free_slots)  # noqa: E731
    else:
        key = lambda i: (loads[i].heavy + loads[i].light, -loads[i].free_slots)  # noqa: E731
    return min(pair, key=key)  # ties: the first sampled
