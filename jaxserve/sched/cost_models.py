"""Latency cost models for the planners, each a linear model in hand-picked features, fitted by weighted least
squares from profile samples and saved/loaded as JSON. Pure numpy: the scheduler never imports jax.

- TetrisPrefill (Tetris Eq. 1), per SP size:  T(n, h) = c0 + c1*n + c2*n*h + c3*n^2   (n chunk, h history tokens)
- LoongServePrefill, per (SP, TP):             T = a + b*sum(l) + c*sum(l^2)           (l: the batch's lengths)
- Decode:                                      T = a + b*batch + c*sum(kv)
- LinkModel, per link:                         T = latency + bytes / bandwidth

Samples are weighted by 1 / T by default, so the fit minimises relative error: a 0.1 s entry matters as much as
a 30 s one.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, ClassVar, Iterable, Sequence

import numpy as np


def weighted_lstsq(features: np.ndarray, times: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Coefficients minimising sum(w * (features @ c - t))^2; w defaults to 1 / t (relative error)."""
    times = np.asarray(times, np.float64)
    w = 1.0 / times if weights is None else np.asarray(weights, np.float64)
    if len(times) < features.shape[1]:
        raise ValueError(f"{len(times)} samples cannot fit {features.shape[1]} coefficients")
    coef, *_ = np.linalg.lstsq(features * w[:, None], times * w, rcond=None)
    return coef


@dataclasses.dataclass
class KeyedLinearModel:
    """One coefficient vector per key (an SP size, an (SP, TP) pair, a link name)."""

    kind: ClassVar[str]
    features: ClassVar[Callable[..., np.ndarray]]  # each model's design matrix, a staticmethod
    coefficients: dict[Any, np.ndarray] = dataclasses.field(default_factory=dict)

    @classmethod
    def fit(
        cls, samples: Iterable[tuple[Any, Sequence[float], float]], weight: Callable[[float], float] | None = None
    ) -> "KeyedLinearModel":
        """samples: (key, feature inputs, measured seconds). weight(t) defaults to 1 / t."""
        grouped: dict[Any, list[tuple[Sequence[float], float]]] = {}
        for key, x, t in samples:
            grouped.setdefault(key, []).append((x, t))
        model = cls()
        for key, rows in grouped.items():
            xs = [np.asarray(c, np.float64) for c in zip(*(x for x, _ in rows))]
            times = np.array([t for _, t in rows])
            w = None if weight is None else np.array([weight(t) for t in times])
            model.coefficients[key] = cls._fit_one(xs, times, w)
        return model

    @classmethod
    def _fit_one(cls, xs: list[np.ndarray], times: np.ndarray, w: np.ndarray | None) -> np.ndarray:
        return weighted_lstsq(cls.features(*xs), times, w)

    def coef(self, key: Any) -> np.ndarray:
        if key not in self.coefficients:
            raise KeyError(f"{self.kind}: no fit for {key!r}; fitted: {sorted(self.coefficients, key=str)}")
        return self.coefficients[key]

    def to_json(self) -> str:
        return json.dumps(
            {"kind": self.kind, "coefficients": [[_key_out(k), c.tolist()] for k, c in self.coefficients.items()]}
        )

    @classmethod
    def from_json(cls, text: str) -> "KeyedLinearModel":
        raw = json.loads(text)
        if raw.get("kind") != cls.kind:
            raise ValueError(f"expected a {cls.kind} model, got {raw.get('kind')!r}")
        return cls({_key_in(k): np.asarray(c, np.float64) for k, c in raw["coefficients"]})


def _key_out(key: Any) -> Any:
    return list(key) if isinstance(key, tuple) else key


def _key_in(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


# A prior Eq. (1) at SP 1, (c0, c1, c2, c3): 20 ms a chunk, 5,000 tokens/s, attention at 1e-8 s per pair; a group
# of s instances multiplies the fixed cost by s and divides the rest by s. What its decisions are matters, not
# its times: it stands in until the pool's own is measured (cluster/build.py).
PRIOR_COEFFICIENTS = np.array([2e-2, 2e-4, 2e-8, 1e-8])


class TetrisPrefill(KeyedLinearModel):
    """Tetris Eq. (1), keyed by SP size."""

    kind = "tetris_prefill"

    @staticmethod
    def features(n, h):
        n, h = np.asarray(n, np.float64), np.asarray(h, np.float64)
        return np.stack([np.ones_like(n), n, n * h, n * n], axis=-1)

    def predict(self, sp: int, n: float, h: float = 0.0) -> float:
        return float(self.features(n, h) @ self.coef(sp))

    def fastest(self, n: float, h: float = 0.0) -> float:
        """The latency at the best fitted SP size: a prompt's light-load TTFT, which SLOs scale with."""
        return min(self.predict(sp, n, h) for sp in self.coefficients)

    @classmethod
    def prior(cls, sizes: Sequence[int]) -> "TetrisPrefill":
        """What a pool plans with before its own is measured: a chunk's fixed cost grows with its group and its
        per-token costs shrink, so short prompts take the smallest group and long ones the largest."""
        return cls({s: PRIOR_COEFFICIENTS / np.array([1 / s, s, s, s]) for s in sizes})

    @classmethod
    def _fit_one(cls, xs, times, w):
        n, h = xs
        if np.any(h):
            return weighted_lstsq(cls.features(n, h), times, w)
        # Whole prompts only (Tetris Table 1): c2 is not identifiable. A chunk's queries meet h history keys
        # each and n/2 of their own on average, so attention costs c3*(2*n*h + n^2): c2 = 2*c3.
        c0, c1, c3 = weighted_lstsq(np.stack([np.ones_like(n), n, n * n], axis=-1), times, w)
        return np.array([c0, c1, 2 * c3, c3])


class LoongServePrefill(KeyedLinearModel):
    """LoongServe's batch model, keyed by (SP, TP); inputs are sum(l) and sum(l^2) of the batch."""

    kind = "loongserve_prefill"

    @staticmethod
    def features(sum_l, sum_l2):
        sum_l = np.asarray(sum_l, np.float64)
        return np.stack([np.ones_like(sum_l), sum_l, np.asarray(sum_l2, np.float64)], axis=-1)

    def predict(self, sp: int, tp: int, lengths: Sequence[int]) -> float:
        lengths = np.asarray(lengths, np.float64)
        return float(self.features(lengths.sum(), (lengths**2).sum()) @ self.coef((sp, tp)))

    @classmethod
    def prior(cls, keys: Sequence[tuple[int, int]]) -> "LoongServePrefill":
        """As TetrisPrefill.prior, for batches of whole prompts on (SP, TP) groups."""
        c0, c1, _, c3 = PRIOR_COEFFICIENTS
        return cls({(sp, tp): np.array([c0 * sp, c1 / sp, c3 / sp]) for sp, tp in keys})


class Decode(KeyedLinearModel):
    """Decode step time, keyed by (SP, TP): a + b * batch + c * sum(kv)."""

    kind = "decode"

    @staticmethod
    def features(batch, sum_kv):
        batch = np.asarray(batch, np.float64)
        return np.stack([np.ones_like(batch), batch, np.asarray(sum_kv, np.float64)], axis=-1)

    def predict(self, sp: int, tp: int, kv_lens: Sequence[int]) -> float:
        return float(self.features(len(kv_lens), float(np.sum(kv_lens))) @ self.coef((sp, tp)))


class LinkModel(KeyedLinearModel):
    """Message time over a link (keyed by link name): latency + bytes / bandwidth."""

    kind = "transfer"

    @staticmethod
    def features(nbytes):
        nbytes = np.asarray(nbytes, np.float64)
        return np.stack([np.ones_like(nbytes), nbytes], axis=-1)

    def predict(self, link: str, nbytes: float) -> float:
        return float(self.features(nbytes) @ self.coef(link))

    def bandwidth(self, link: str) -> float:
        """Bytes per second of the fitted link."""
        return 1.0 / float(self.coef(link)[1])
