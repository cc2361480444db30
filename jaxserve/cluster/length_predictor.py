"""The live side of the prompt-reading decode-length predictor (sched/length_classifier.py, `--length_predictor=
prompt`): what it reads of a prompt, and its learned state kept on disk.

- PromptFeatures: the served model's own view of a prompt, the mean of its input embeddings. A cluster chooses the
  decode instance on arrival (CDSP streams KV to it chunk by chunk), before any layer has run, so the features
  cannot come from the prefill's hidden states; the embedding rows are a gather, no forward pass. Prompts are
  padded to powers of two (a program per size).
- KeptClassifier: the classifier, read from its cache file at start (a bad one is moved aside and learning starts
  afresh) and written back every `save_every` requests it learns from.
"""

from __future__ import annotations

import pathlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxserve import disk_cache
from jaxserve.engine import profile
from jaxserve.engine.sp_prefill import next_power_of_two
from jaxserve.models import quantize
from jaxserve.sched.decode_dispatch import PromptInfo
from jaxserve.sched.length_classifier import PromptClassifier

SHORTEST = 64  # the smallest padded size: short prompts share one program


@jax.jit
def _mean_rows(table: Any, ids: Int[Array, " n"], count: Int[Array, ""]) -> Float[Array, " e"]:
    rows = quantize.take(table, ids, jnp.float32)
    keep = (jnp.arange(ids.shape[0]) < count)[:, None]
    return jnp.sum(jnp.where(keep, rows, 0.0), axis=0) / count


class PromptFeatures:
    def __init__(self, params: Any):
        """params: the served model's (its embedding table is read; a host copy goes to this process's first
        device once)."""
        table = params["params"]["embed_tokens"]["embedding"]
        device = jax.local_devices()[0]
        self.table = jax.tree.map(lambda a: a if isinstance(a, jax.Array) else jax.device_put(a, device), table)
        self.dim = len(self([0]))  # the hidden size (a packed quantized table's last axis is not)

    def __call__(self, ids: Sequence[int]) -> Float[np.ndarray, " e"]:
        n = len(ids)
        padded = np.zeros(self._padded(n), np.int32)
        padded[:n] = ids
        return np.asarray(_mean_rows(self.table, padded, np.int32(n)), np.float32)

    def warmup(self, max_tokens: int) -> None:
        """Compile the program of every padded size a prompt up to max_tokens takes."""
        size = SHORTEST
        while size <= self._padded(max_tokens):
            self([0] * size)
            size *= 2

    @staticmethod
    def _padded(n: int) -> int:
        return max(SHORTEST, next_power_of_two(n))


class KeptClassifier:
    """A PromptClassifier whose state lives in `path` (None: in memory only); a LengthPredictor."""

    def __init__(self, path: pathlib.Path | None, dim: int, save_every: int = 32):
        self.path, self.save_every, self._unsaved = path, save_every, 0
        kept = (
            None if path is None else profile.read_kept(path, lambda: PromptClassifier.from_json(path.read_text(), dim))
        )
        self.classifier = kept or PromptClassifier(dim)

    def predict(self, prompt: PromptInfo) -> tuple[int, int]:
        return self.classifier.predict(prompt)

    def observe(self, prompt: PromptInfo, generated: int) -> None:
        self.classifier.observe(prompt, generated)
        self._unsaved += 1
        if self._unsaved >= self.save_every:
            self.save()

    def save(self) -> None:
        if self.path is not None:
            disk_cache.write_text(self.path, self.classifier.to_json())
        self._unsaved = 0


def default_path(model_name: str, dtype: str) -> pathlib.Path:
    """Per model and dtype (the lengths it answers with), not per device."""
    from jaxserve.models import registry

    return registry.cache_dir() / "length_predictor" / f"{pathlib.Path(model_name).stem}-{dtype}.json"
