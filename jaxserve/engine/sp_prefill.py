"""CDSP prefill on devices: each chunk of a prompt runs the whole model over its own SP group (ring attention
inside `shard_map`), and the request's history KV is rebalanced onto the next chunk's larger group in between.

The history lives device-major, every layer stacked: (k, v) of shape [layers, p * cap, kvh, d] sharded
P(None, SP), device i holding rows [i * cap, (i + 1) * cap) of every layer; its positions are also kept on the
host (the planner knows where every token is).
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


# The stacked history's sharding: layer axis replicated, rows split over the SP group.
KV_SPEC = P(None, SP)


@dataclasses.dataclass
class ShardedHistory:
    mesh: Mesh
    kv: tuple[jax.Array, jax.Array]  # (k, v), each [layers, p * cap, kvh, d] sharded KV_SPEC
    pos: np.ndarray  # [p, cap] host copy of the positions, NO_POSITION for empty slots

    @classmethod
    def empty(cls, cfg: LlamaConfig, mesh: Mesh, dtype=jnp.float32) -> "ShardedHistory":
        p = mesh.shape[SP]
        zeros = jax.device_put(jnp.zeros((cfg.num_layers, p, cfg.num_kv_heads, cfg.head_dim), dtype),
                               NamedSharding(mesh, KV_SPEC))
        return cls(mesh, (zeros, zeros), np.full((p, 1), NO_POSITION, np.int32))

    @property
    def tokens(self) -> int:
        return int((self.pos != NO_POSITION).sum())


def _place(mesh: Mesh, x: np.ndarray, spec: P = P(SP)) -> jax.Array:
    return jax.device_put(x, NamedSharding(mesh, spec))


# Compiled once per (model, group) and per (group, share): a CDSP prefill reuses them chunk after chunk.
@functools.lru_cache(maxsize=64)
def _chunk_step(cfg: LlamaConfig, mesh: Mesh, dtype) -> Any:
    model = Llama(cfg, RingBackend(mesh.shape[SP]), dtype)

    def body(params, ids, q_pos, k_pos, caches, hist_pos):
        # Reserve t rows per layer after this device's history for the chunk's K/V: the carry keeps one shape.
        t = ids.shape[0]
        caches = jax.tree.map(lambda x: jnp.pad(x, ((0, 0), (0, t), (0, 0), (0, 0))), caches)
        logits, caches = model.apply(params, ids[None], q_pos[None], caches, (hist_pos, k_pos))
        return logits[0], caches

    seq = P(SP)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), seq, seq, seq, KV_SPEC, seq),
                                 out_specs=(seq, KV_SPEC)))


@functools.lru_cache(maxsize=64)
def _rebalance_step(mesh: Mesh, share: int) -> Any:
    def body(k, v, pos, dest, at):
        # Every layer moves the same rows: fold the layer axis into the heads and move all layers at once.
        layers, cap, kvh, d = k.shape

        def fold(x):  # [layers, cap, kvh, d] -> [cap, layers * kvh, d]
            return x.transpose(1, 0, 2, 3).reshape(cap, layers * kvh, d)

        def unfold(x):  # [share, layers * kvh, d] -> [layers, share, kvh, d]
            return x.reshape(share, layers, kvh, d).transpose(1, 0, 2, 3)

        k2, v2, pos2 = rebalance.rebalance(fold(k), fold(v), pos, dest[0], at[0], share=share,
                                           axis_size=mesh.shape[SP])
        return unfold(k2), unfold(v2), pos2

    seq = P(SP)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(KV_SPEC, KV_SPEC, seq, seq, seq),
                                 out_specs=(KV_SPEC, KV_SPEC, seq)))


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
    logits, kv = _chunk_step(cfg, mesh, dtype)(params, put(ids), put(q_pos), put(k_pos), history.kv,
                                               put(history.pos.reshape(-1)))
    new_pos = np.concatenate([history.pos, k_pos.reshape(p, -1)], axis=1)
    logits = np.asarray(logits)[layouts.inverse(perm)][:n]
    return logits, ShardedHistory(mesh, tuple(kv), new_pos)


def _extend(x: jax.Array, mesh: Mesh) -> jax.Array:
    """x [layers, rows, ...], its rows sharded over a prefix of mesh's devices, as an array over all of them: the
    shards stay where they are and the joining devices get empty (zero) buffers of the same size."""
    by_device = {s.device: s.data for s in x.addressable_shards}
    local = next(iter(by_device.values())).shape
    devices = list(mesh.devices.reshape(-1))
    shards = [by_device[d] if d in by_device else jax.device_put(jnp.zeros(local, x.dtype), d) for d in devices]
    return jax.make_array_from_single_device_arrays((local[0], local[1] * len(devices)) + local[2:],
                                                    NamedSharding(mesh, KV_SPEC), shards)


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
    k, v = history.kv
    k2, v2, _ = run(_extend(k, mesh), _extend(v, mesh), *placed)
    new_pos = np.full((new_p, share), NO_POSITION, np.int32)
    for i in range(new_p):
        sel = dest[i] < new_p
        new_pos[dest[i][sel], at[i][sel]] = pos[i][sel]
    return ShardedHistory(mesh, (k2, v2), new_pos)
