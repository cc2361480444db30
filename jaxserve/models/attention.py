"""The seam between the model and attention. Each layer hands its rotated q/k/v to a backend, which attends
over wherever the KV lives and returns the output with its updated caches. The dense causal backend here keeps
no cache: it scores a whole sequence at once and gives the model its parameter shapes."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from jaxtyping import Array, Float, Int

from jaxserve.pallas_kernels.reference import chunk_attention

Caches = Any  # the backend's whole KV pytree, every array with a leading layer axis, e.g. (k_all, v_all)


class AttentionBackend(Protocol):
    """Attention over wherever the KV lives.

    caches: the whole per-model KV pytree (arrays [num_layers, ...]); layer: traced int32 scalar, the current
    layer. The backend writes only the slice of `layer` and returns the whole pytree. ctx holds the arrays shared
    by all layers (slots, tables, ...).
    """

    def __call__(self, q: Float[Array, "b t h d"], k: Float[Array, "b t kvh d"], v: Float[Array, "b t kvh d"],
                 positions: Int[Array, "b t"], caches: Caches, layer: Int[Array, ""], ctx: Any
                 ) -> tuple[Float[Array, "b t h d"], Caches]: ...


@dataclasses.dataclass(frozen=True)
class DenseCausalBackend:
    """Causal attention of one sequence over itself; keeps no cache (caches pass through untouched)."""

    def __call__(self, q, k, v, positions, caches, layer, ctx):
        out, _ = chunk_attention(q[0], k[0], v[0], positions[0], ctx)
        return out[None].astype(q.dtype), caches
