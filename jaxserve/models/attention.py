"""The seam between the model and attention. Each layer hands its rotated q/k/v to a backend, which attends
over wherever the KV lives and returns the output with its updated caches. What a backend reads in every layer
(slots, block tables, key positions, ...) arrives as its metadata: a frozen dataclass registered as a JAX
pytree, so jit, shard_map and nn.scan pass it on as its arrays. The dense causal backend here keeps no cache:
it scores a whole sequence at once and gives the model its parameter shapes."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, TypeVar

import jax
from jaxtyping import Array, Float, Int

from jaxserve.pallas_kernels.reference import chunk_attention

Caches = Any  # the backend's whole KV pytree, every array with a leading layer axis, e.g. (k_all, v_all)


class AttentionMetadata:
    """The arrays one backend reads in every layer. Each backend defines its own subclass."""


M = TypeVar("M", bound=AttentionMetadata, contravariant=True)


class AttentionBackend(Protocol[M]):
    """Attention over wherever the KV lives.

    caches: the whole per-model KV pytree (arrays [num_layers, ...]); layer: traced int32 scalar, the current
    layer. The backend writes only the slice of `layer` and returns the whole pytree. metadata: the backend's
    arrays shared by all layers.
    """

    def __call__(
        self,
        q: Float[Array, "b t h d"],
        k: Float[Array, "b t kvh d"],
        v: Float[Array, "b t kvh d"],
        positions: Int[Array, "b t"],
        caches: Caches,
        layer: Int[Array, ""],
        metadata: M,
    ) -> tuple[Float[Array, "b t h d"], Caches]: ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseCausalMetadata(AttentionMetadata):
    """What DenseCausalBackend reads."""

    key_positions: Int[Array, " t"]
    """Each key's position: queries at or after it see it (padding: a position past every query)."""


@dataclasses.dataclass(frozen=True)
class DenseCausalBackend:
    """Causal attention of one sequence over itself (within a sliding window, if any); keeps no cache (caches
    pass through untouched)."""

    window: int | None = None

    def __call__(self, q, k, v, positions, caches, layer, metadata: DenseCausalMetadata):
        out, _ = chunk_attention(q[0], k[0], v[0], positions[0], metadata.key_positions, self.window)
        return out[None].astype(q.dtype), caches
