"""Arrays whose devices belong to several processes (jax.distributed: one process per host).

Every process makes the same device calls in the same order (lockstep, cluster/lockstep.py); JAX runs each
program only on the devices a process owns, and a process that owns none of a program's devices skips it (no
compile, no wait) and gets an array with no local shards. Two things JAX leaves to the caller:

- moving an array between device sets owned by different processes (`move`: a point-to-point program over each
  pair of devices, as a transfer between hosts must be: only the two owners take part);
- reading a value on a process that does not hold it (`read` / `read_later`): its holder publishes it in the
  coordination service's key-value store and the leader (process 0, which runs the scheduler) reads it there.

In one process every array is fully addressable and these are plain `jax.device_put` / `np.asarray`.
"""

from __future__ import annotations

import functools
import itertools
import pickle
import threading
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, Sharding

LEADER = 0
VALUE_TIMEOUT_S = 60.0  # a value not published within this is a dead or stalled process
MEET_TIMEOUT_S = 600.0  # processes that do not all reach a first shared program within this are stuck or dead


class ProcessLost(RuntimeError):
    """A process this one waits on did not answer in time (it died, or stalled)."""


def coordination_client():
    """jax.distributed's client of the coordination service (its key-value store and barriers)."""
    from jax._src import distributed  # private; as jax-llm-examples uses it

    return distributed.global_state.client


def is_local(device: jax.Device) -> bool:
    return device.process_index == jax.process_index()


def local_devices(devices: Sequence[jax.Device]) -> list[jax.Device]:
    return [d for d in devices if is_local(d)]


def placeholder(shape: tuple[int, ...], sharding: Sharding, dtype) -> jax.Array:
    """An array on devices this process does not own (it holds none of its shards)."""
    return jax.make_array_from_single_device_arrays(shape, sharding, [], dtype=dtype)


_met: set[frozenset[int]] = set()


def meet(devices: Sequence[jax.Device]) -> None:
    """Call before the first program over `devices`: where they span processes, wait until each of their
    processes gets here. A first collective sets up its communicator, which every process in it must reach
    within a deadline (gloo: 30 s), and one process can be far behind another: it compiles the programs of its
    own devices, which the others skip."""
    owners = sorted({d.process_index for d in devices})
    ids = frozenset(d.id for d in devices)
    if len(owners) < 2 or jax.process_index() not in owners or ids in _met:
        return
    _met.add(ids)
    try:
        coordination_client().wait_at_barrier(
            f"jaxserve/meet/{'-'.join(map(str, sorted(ids)))}", int(MEET_TIMEOUT_S * 1000), owners
        )
    except Exception as e:  # noqa: BLE001 (the barrier timed out, or the coordination service is gone)
        raise ProcessLost(
            f"processes {owners} did not all reach their first program on devices "
            f"{sorted(ids)} within {MEET_TIMEOUT_S:.0f} s ({e})"
        ) from e


def _shard_devices(shape: tuple[int, ...], sharding: Sharding) -> dict[tuple, list[jax.Device]]:
    """Each shard's index (as a hashable key) -> the devices holding it, in id order."""
    out: dict[tuple, list[jax.Device]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        out.setdefault(tuple((s.start, s.stop) for s in index), []).append(device)
    return {k: sorted(v, key=lambda d: d.id) for k, v in out.items()}


@functools.lru_cache(maxsize=None)
def _pair_program(src: jax.Device, dst: jax.Device):
    """src's block to dst, a program only their two processes run."""
    mesh = Mesh(np.array([src, dst]), ("pair",))
    return NamedSharding(mesh, P("pair")), jax.jit(
        jax.shard_map(
            lambda x: jax.lax.ppermute(x, "pair", [(0, 1)]), mesh=mesh, in_specs=P("pair"), out_specs=P("pair")
        )
    )


def _send(block: jax.Array | None, src: jax.Device, dst: jax.Device, shape, dtype) -> jax.Array | None:
    """One shard from src (held here when src is local) to dst (returned when dst is local)."""
    if not (is_local(src) or is_local(dst)):
        return None
    if is_local(src) and is_local(dst):
        return jax.device_put(block, dst)
    meet((src, dst))
    sharding, program = _pair_program(src, dst)
    here = [jax.device_put(block[None], src)] if is_local(src) else [jax.device_put(np.zeros((1, *shape), dtype), dst)]
    out = program(jax.make_array_from_single_device_arrays((2, *shape), sharding, here, dtype=dtype))
    return out.addressable_shards[0].data[0] if is_local(dst) else None


def move(x: jax.Array, sharding: Sharding) -> jax.Array:
    """x on `sharding`'s devices, each shard to the device that holds the same index there. Within a process any
    resharding; across processes the shard shapes must match (as a copy between hosts is made shard by shard)."""
    devices = set(x.sharding.device_set) | set(sharding.device_set)
    if all(is_local(d) for d in devices):
        return jax.device_put(x, sharding)
    if not any(is_local(d) for d in devices):
        return placeholder(x.shape, sharding, x.dtype)
    src, dst = _shard_devices(x.shape, x.sharding), _shard_devices(x.shape, sharding)
    if src.keys() != dst.keys():
        raise ValueError(f"a move between processes keeps the shard shapes; {x.sharding} -> {sharding} does not")
    held = {s.device: s.data for s in x.addressable_shards}
    shape = x.sharding.shard_shape(x.shape)
    shards = [
        got
        for index, targets in dst.items()
        for target in targets
        if (got := _send(held.get(src[index][0]), src[index][0], target, shape, x.dtype)) is not None
    ]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards, dtype=x.dtype)


# ---- values the leader reads ---------------------------------------------------------------------------------
_reads = itertools.count()  # every process reads in the same order, so the n-th read has the same key everywhere


def _holder(x: jax.Array, index: int | None) -> jax.Device:
    """The device (lowest id) holding element `index` of x's first axis (all of x, when None)."""
    holders = [
        d
        for d, idx in x.sharding.devices_indices_map(x.shape).items()
        if index is None or index in range(*idx[0].indices(x.shape[0]))
    ]
    return min(holders, key=lambda d: d.id)


def _local_value(x: jax.Array, device: jax.Device, index: int | None) -> np.ndarray:
    shard = next(s for s in x.addressable_shards if s.device == device)
    value = np.asarray(shard.data)
    return value if index is None else value[index - (shard.index[0].start or 0)]


_publishing: list[threading.Thread] = []  # a follower's threads that publish values for the leader


def finish_publishing() -> None:
    """Wait for the values this process is publishing (a follower, before it ends)."""
    while _publishing:
        _publishing.pop().join(timeout=VALUE_TIMEOUT_S)


class Later:
    """A value of device array x (or its element `index` on the first axis) that the leader reads once x's
    devices finish: ready() polls, value() waits. Its holder publishes it (from a thread, so the lockstep goes on
    meanwhile); a process that neither holds it nor leads gets zeros of its shape (no one there reads it)."""

    def __init__(self, x: jax.Array, index: int | None = None):
        self._x, self._index = x, index
        self._holder = _holder(x, index)
        self._value: np.ndarray | None = None
        self._key = f"jaxserve/value/{next(_reads)}"
        if is_local(self._holder) and jax.process_index() != LEADER:
            thread = threading.Thread(target=self._publish, daemon=True)
            _publishing.append(thread)
            thread.start()

    def _publish(self) -> None:
        coordination_client().key_value_set_bytes(self._key, pickle.dumps(self.value()))

    def _remote(self) -> bool:
        return not is_local(self._holder) and jax.process_index() == LEADER

    def ready(self) -> bool:
        if not self._remote():
            return self._x.is_ready()
        if self._value is None:
            try:
                self._value = pickle.loads(coordination_client().key_value_try_get_bytes(self._key))
            except Exception:  # not published yet (the store answers NOT_FOUND)
                return False
            coordination_client().key_value_delete(self._key)
        return True

    def value(self, timeout: float = VALUE_TIMEOUT_S) -> np.ndarray:
        if is_local(self._holder):
            return _local_value(self._x, self._holder, self._index)
        if not self._remote():
            return np.zeros(self._x.shape[1:] if self._index is not None else self._x.shape, self._x.dtype)
        if self._value is None:
            try:
                raw = coordination_client().blocking_key_value_get_bytes(self._key, int(timeout * 1000))
            except Exception as e:
                raise ProcessLost(
                    f"process {self._holder.process_index} did not publish a result within {timeout:.0f} s ({e})"
                ) from e
            self._value = pickle.loads(raw)
            coordination_client().key_value_delete(self._key)
        return self._value


class Here:
    """A value held in this process (there is only one), copied to the host as soon as it is computed."""

    def __init__(self, x: jax.Array, index: int | None):
        self._x, self._index = x, index
        x.copy_to_host_async()

    def ready(self) -> bool:
        return self._x.is_ready()

    def value(self) -> np.ndarray:
        value = np.asarray(self._x)
        return value if self._index is None else value[self._index]


def read_later(x: jax.Array, index: int | None = None) -> Later | Here:
    """Call in lockstep (every process, same order) when the program making x is dispatched."""
    return Here(x, index) if jax.process_count() == 1 else Later(x, index)


def read(x: jax.Array, index: int | None = None) -> np.ndarray:
    """x (or its element `index` on the first axis) on the host, waiting for it (in lockstep, as read_later)."""
    return read_later(x, index).value()
