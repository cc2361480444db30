"""CDSP prefill on devices: each chunk of a prompt runs the whole model over its own SP group (ring attention
inside `shard_map`), and the request's history KV is rebalanced onto the next chunk's larger group in between.

The history lives device-major: per layer (k, v) of shape [p * cap, kvh, d], device i holding rows
[i * cap, (i + 1) * cap); its positions are also kept on the host (the planner knows where every token is).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.models.config import LlamaConfig
from jaxserve.models.llama import Llama
from jaxserve.pallas_kernels.reference import NO_POSITION
from jaxserve.sharding import layouts, rebalance
from jaxserve.sharding.mesh import SP
from jaxserve.sharding.ring import RingBackend


@dataclasses.dataclass
class ShardedHistory:
    mesh: Mesh
    layers: list[tuple[jax.Array, jax.Array]]
    pos: np.ndarray  # [p, cap] host copy of the positions, NO_POSITION for empty slots

    @classmethod
    def empty(cls, cfg: LlamaConfig, mesh: Mesh, dtype=jnp.float32) -> "ShardedHistory":
        p = mesh.shape[SP]
        zeros = jnp.zeros((p, cfg.num_kv_heads, cfg.head_dim), dtype)
        return cls(mesh, [(zeros, zeros)] * cfg.num_layers, np.full((p, 1), NO_POSITION, np.int32))

    @property
    def tokens(self) -> int:
        return int((self.pos != NO_POSITION).sum())


def _place(mesh: Mesh, x: np.ndarray) -> jax.Array:
    return jax.device_put(x, NamedSharding(mesh, P(SP)))


# Compiled once per (model, group) and per (group, share): a CDSP prefill reuses them chunk after chunk.
@functools.lru_cache(maxsize=64)
def _chunk_step(cfg: LlamaConfig, mesh: Mesh, dtype) -> Any:
    model = Llama(cfg, RingBackend(mesh.shape[SP]), dtype)

    def body(params, ids, q_pos, k_pos, caches, hist_pos):
        logits, caches = model.apply(params, ids[None], q_pos[None], caches, (hist_pos, k_pos))
        return logits[0], caches

    seq = P(SP)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), seq, seq, seq, seq, seq), out_specs=(seq, seq)))


@functools.lru_cache(maxsize=64)
def _rebalance_step(mesh: Mesh, share: int) -> Any:
    def body(k, v, pos, dest, at):
        return rebalance.rebalance(k, v, pos, dest[0], at[0], share=share, axis_size=mesh.shape[SP])

    seq = P(SP)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(seq,) * 5, out_specs=(seq,) * 3))


def prefill_chunk(cfg: LlamaConfig, params: Any, history: ShardedHistory, tokens: np.ndarray, start: int,
                  layout: layouts.Layout = "zigzag", dtype=jnp.float32) -> tuple[np.ndarray, ShardedHistory]:
    """Logits [len(tokens), vocab] of a chunk at positions start.., computed on history.mesh."""
    mesh = history.mesh
    p = mesh.shape[SP]
    n = len(tokens)
    quantum = 2 * p if layout == "zigzag" else p
    padded = -(-n // quantum) * quantum
    perm = layouts.permutation(padded, p, layout)
    idx = np.arange(padded)
    valid = idx < n
    ids = np.where(valid, np.pad(np.asarray(tokens, np.int32), (0, padded - n)), 0)[perm]
    q_pos = np.where(valid, start + idx, -1).astype(np.int32)[perm]
    k_pos = np.where(valid, start + idx, NO_POSITION).astype(np.int32)[perm]
    put = functools.partial(_place, mesh)
    logits, caches = _chunk_step(cfg, mesh, dtype)(params, put(ids), put(q_pos), put(k_pos), history.layers,
                                                    put(history.pos.reshape(-1)))
    new_pos = np.concatenate([history.pos, k_pos.reshape(p, -1)], axis=1)
    logits = np.asarray(logits)[layouts.inverse(perm)][:n]
    return logits, ShardedHistory(mesh, [tuple(c) for c in caches], new_pos)


def _extend(x: jax.Array, mesh: Mesh) -> jax.Array:
    """x, sharded over a prefix of mesh's devices, as an array over all of them: the shards stay where they are
    and the joining devices get empty (zero) buffers of the same size."""
    by_device = {s.device: s.data for s in x.addressable_shards}
    rows = next(iter(by_device.values())).shape[0]
    devices = list(mesh.devices.reshape(-1))
    shards = [by_device[d] if d in by_device else jax.device_put(jnp.zeros((rows,) + x.shape[1:], x.dtype), d)
              for d in devices]
    return jax.make_array_from_single_device_arrays((rows * len(devices),) + x.shape[1:],
                                                    NamedSharding(mesh, P(SP)), shards)


def move_to(history: ShardedHistory, mesh: Mesh) -> ShardedHistory:
    """Rebalance the history onto `mesh`, whose first devices are history.mesh's (a larger or equal group)."""
    old_p, new_p = history.mesh.shape[SP], mesh.shape[SP]
    old_devices = list(history.mesh.devices.reshape(-1))
    if list(mesh.devices.reshape(-1))[:old_p] != old_devices:
        raise ValueError("the new group must extend the old one (the old group is its prefix)")
    cap = history.pos.shape[1]
    extra = new_p - old_p  # joining devices start with empty buffers
    pos = np.concatenate([history.pos, np.full((extra, cap), NO_POSITION, np.int32)])
    dest, at, share = rebalance.plan(pos)
    run = _rebalance_step(mesh, share)
    placed = [_place(mesh, x) for x in (pos.reshape(-1), dest[:, None], at[:, None])]
    layers = []
    for k, v in history.layers:
        k2, v2, _ = run(_extend(k, mesh), _extend(v, mesh), *placed)
        layers.append((k2, v2))
    new_pos = np.full((new_p, share), NO_POSITION, np.int32)
    for i in range(new_p):
        sel = dest[i] < new_p
        new_pos[dest[i][sel], at[i][sel]] = pos[i][sel]
    return ShardedHistory(mesh, layers, new_pos)
