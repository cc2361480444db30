"""TetriInfer's decode-length predictor (3.3.3): a classifier over length buckets that reads the prompt, here the
served model's own features of it (cluster/prompt_features.py: the mean of its input embeddings) and its length.

TetriInfer fine-tunes a small LLM offline on a trace. A server has no trace of its own model's answers, so this
one learns online, from the lengths the server produced, one finished request at a time: multinomial logistic
regression by AdaGrad on standardised features (running mean and variance). Until `warm` requests have taught it,
and for a prompt without features, it answers as the running mean (ObservedLengths) does. Its state is JSON
(`to_json` / `from_json`, checked when read); the executor keeps it on disk (cluster/build.py).
docs/BENCHMARKS.md "Decode-length prediction" measures it against the running mean.
"""

from __future__ import annotations

import json

import numpy as np
from jaxtyping import Float

from jaxserve.sched.decode_dispatch import ObservedLengths, PromptInfo

_EPS = 1e-6


class PromptClassifier:
    def __init__(
        self, dim: int, granularity: int = 200, buckets: int = 8, warm: int = 32, lr: float = 0.2, l2: float = 1e-4
    ):
        """dim: the prompt features' size. Buckets of `granularity` tokens, the last open-ended (a longer decode
        counts in it). warm: finished requests before the classifier answers."""
        if dim < 1 or granularity < 1 or buckets < 2 or warm < 0 or not lr > 0 or l2 < 0:
            raise ValueError(
                f"need dim >= 1, granularity >= 1, buckets >= 2, warm >= 0, lr > 0, l2 >= 0; got "
                f"{dim}, {granularity}, {buckets}, {warm}, {lr}, {l2}"
            )
        self.dim, self.granularity, self.buckets, self.warm, self.lr, self.l2 = dim, granularity, buckets, warm, lr, l2
        width = dim + 2  # the features, log prompt length, a bias
        self.weights = np.zeros((buckets, width))
        self.squares = np.zeros((buckets, width))  # AdaGrad's sum of squared gradients
        self.seen = 0
        self.mean, self.m2 = np.zeros(width - 1), np.zeros(width - 1)  # Welford's, over features and log length
        self.fallback = ObservedLengths(granularity=granularity)

    # ---- LengthPredictor ---------------------------------------------------------------------------------------
    def predict(self, prompt: PromptInfo) -> tuple[int, int]:
        if self.seen < self.warm or prompt.features is None:
            return self.fallback.predict(prompt)
        b = int(np.argmax(self.weights @ self._row(prompt)))
        return b * self.granularity, (b + 1) * self.granularity

    def observe(self, prompt: PromptInfo, generated: int) -> None:
        self.fallback.observe(prompt, generated)
        if prompt.features is None:
            return
        raw = self._raw(prompt)
        self.seen += 1
        delta = raw - self.mean
        self.mean += delta / self.seen
        self.m2 += delta * (raw - self.mean)
        x = self._row(prompt)
        logits = self.weights @ x
        p = np.exp(logits - logits.max())
        p /= p.sum()
        p[min(generated // self.granularity, self.buckets - 1)] -= 1.0  # softmax cross-entropy's gradient
        grad = np.outer(p, x) + self.l2 * self.weights
        self.squares += grad * grad
        self.weights -= self.lr * grad / (np.sqrt(self.squares) + _EPS)

    # ---- features ----------------------------------------------------------------------------------------------
    def _raw(self, prompt: PromptInfo) -> Float[np.ndarray, " w"]:
        f = np.asarray(prompt.features, np.float64).reshape(-1)
        if f.shape != (self.dim,) or not np.all(np.isfinite(f)):
            raise ValueError(f"prompt features must be {self.dim} finite numbers, got shape {f.shape}")
        return np.append(f, np.log1p(prompt.length))

    def _row(self, prompt: PromptInfo) -> Float[np.ndarray, " w"]:
        """Standardised features and log length (clipped: one odd prompt moves no weight far), then the bias."""
        std = np.sqrt(self.m2 / max(self.seen, 1)) + _EPS
        return np.append(np.clip((self._raw(prompt) - self.mean) / std, -5.0, 5.0), 1.0)

    # ---- state -------------------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(
            {
                "dim": self.dim,
                "granularity": self.granularity,
                "buckets": self.buckets,
                "warm": self.warm,
                "lr": self.lr,
                "l2": self.l2,
                "seen": self.seen,
                "weights": self.weights.tolist(),
                "squares": self.squares.tolist(),
                "mean": self.mean.tolist(),
                "m2": self.m2.tolist(),
                "observed": [self.fallback.total, self.fallback.count],
            }
        )

    @classmethod
    def from_json(cls, text: str, dim: int) -> PromptClassifier:
        """A saved state for features of size `dim`. ValueError names what is wrong with one that does not fit."""
        raw = json.loads(text)
        if raw.get("dim") != dim:
            raise ValueError(f"the saved predictor reads {raw.get('dim')} features; this model gives {dim}")
        c = cls(dim, raw["granularity"], raw["buckets"], raw["warm"], raw["lr"], raw["l2"])
        width = dim + 2
        for name, shape in (
            ("weights", (c.buckets, width)),
            ("squares", (c.buckets, width)),
            ("mean", (width - 1,)),
            ("m2", (width - 1,)),
        ):
            value = np.asarray(raw[name], np.float64)
            if value.shape != shape or not np.all(np.isfinite(value)):
                raise ValueError(f"the saved predictor's {name} is not {shape} finite numbers")
            setattr(c, name, value)
        total, count = raw["observed"]
        if not (isinstance(raw["seen"], int) and 0 <= raw["seen"] <= count and total >= 0):
            raise ValueError("the saved predictor's counts disagree")
        c.seen, c.fallback.total, c.fallback.count = raw["seen"], int(total), int(count)
        return c
