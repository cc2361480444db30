"""Tensor parallelism inside an instance (Megatron): each of `tp` devices holds a slice of every layer's heads and
of the MLP's intermediate features, and one all-reduce after the output projection and one after the down
projection sum the partial results. Embeddings, norms and the LM head stay whole on every device.

q/k/v/gate/up are split by output columns, o/down by input rows (a quantized kernel's arrays alike: values,
scales and offsets per block; ggml's rows of blocks by rows, or each row by whole blocks), so device j computes heads
[j*h, (j+1)*h) with h = num_heads / tp and, grouped as GQA groups them, their KV heads. When tp exceeds the
KV heads, each KV head is repeated on the tp / num_kv_heads devices whose query heads read it (as vLLM does):
the weights are expanded before sharding and the cache holds one KV head per device.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from jaxserve.models.config import LlamaConfig
from jaxserve.sharding.mesh import TP

_COLUMNS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split by output features
_ROWS = ("o_proj", "down_proj")  # split by input features: their outputs are partial sums


def shard_params(params: Any, cfg: LlamaConfig, tp: int) -> tuple[Any, Any]:
    """The model's (Hugging Face-named) parameters arranged for tp devices, and a PartitionSpec per leaf: k/v
    projections' heads repeated when tp exceeds the KV heads, then every projection split over the 'tp' axis."""
    shape = cfg.split(tp)

    def arrange(path, x):
        names = [getattr(k, "key", "") for k in path]
        if tp == 1 or not set(names) & set(_COLUMNS + _ROWS):
            return x, P()
        bias = names[-1] == "bias"  # a column-split projection's bias ([.., cols]): split like its columns
        rows = getattr(path[-1], "name", "") == "raw"  # ggml's blocks, [.., cols, k's bytes] (quantize.GGMLBlocks)
        if shape.kv_repeat > 1 and set(names) & {"k_proj", "v_proj"}:
            x = _repeat_heads(x, cfg.num_kv_heads, shape.kv_repeat, x.ndim - 2 if rows else x.ndim - 1)
        if bias:
            return x, P(*(None,) * (x.ndim - 1), TP)
        lead = (None,) * (x.ndim - 2)
        if rows:  # a row's blocks split whole or not at all: ggml's matmul names the cut
            return x, P(*lead, TP, None) if set(names) & set(_COLUMNS) else P(*lead, None, TP)
        if set(names) & set(_COLUMNS):
            return x, P(*lead, None, TP)
        # a quantized kernel's scale per column ([.., 1, out]) is whole on every device; blocks split with rows
        return x, P(*lead, TP if x.shape[-2] > 1 else None, None)

    pairs = jax.tree_util.tree_map_with_path(arrange, params)
    is_pair = lambda p: isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], P)  # noqa: E731
    return (jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair), jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair))


def _repeat_heads(x: Array, heads: int, repeat: int, axis: int) -> Array:
    """x's `axis` ([.., kvh * d, ..]) with each KV head's d entries repeated `repeat` times."""
    lead, cols, tail = x.shape[:axis], x.shape[axis], x.shape[axis + 1 :]
    grouped = x.reshape(*lead, heads, 1, cols // heads, *tail)
    return jnp.broadcast_to(grouped, (*lead, heads, repeat, cols // heads, *tail)).reshape(*lead, cols * repeat, *tail)


def shardings(mesh: Mesh, specs: Any) -> Any:
    """shard_params' PartitionSpecs as NamedShardings on `mesh` (what device_put and the assembly of arrays
    take)."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


@functools.partial(jax.jit, static_argnames="size")
def heads_of(k: Float[Array, "layers n kvh d"], v: Float[Array, "layers n kvh d"], start: Int[Array, ""], *, size: int):
    """The KV heads [start, start + size) of rows in the model's head layout (one program per size)."""
    cut = lambda x: jax.lax.dynamic_slice_in_dim(x, start, size, axis=2)  # noqa: E731
    return cut(k), cut(v)


@functools.partial(jax.jit, static_argnames="repeat")
def model_heads(k: Float[Array, "layers n kvh d"], v: Float[Array, "layers n kvh d"], *, repeat: int):
    """Rows in a tensor-parallel cache's head layout back in the model's: one copy of each repeated KV head."""
    return k[:, :, ::repeat], v[:, :, ::repeat]
