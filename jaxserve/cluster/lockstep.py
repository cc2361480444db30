"""Many processes, one scheduler (multi-controller JAX: one process per host, jax.distributed between them).

The leader (process 0) runs the frontend, the scheduler and the cluster's control. The device layer (the prefill
pool, the decode runners, the KV mover) exists in every process: the leader creates each object and calls its
methods through `new`, which first publishes the call in the coordination service's key-value store; every
other process (a follower, `follow`) makes the same call on its own copy, in the same order. JAX runs each
program on the devices a process owns and skips it where it owns none, so the processes meet in every program
they share. Followers never decide: they replay. Values the leader needs from another host's devices (sampled
tokens) come back through the same store (sharding/processes.py).

A call's arguments travel pickled; devices go as their ids, the weights as a reference to the copy each process
loaded itself, device-layer objects as their names. A device array in an argument is an error: KV and weights
never go through the store.
"""

from __future__ import annotations

import io
import itertools
import pickle
import threading
import time
from typing import Any, Callable

import jax

from jaxserve.sharding.processes import LEADER, ProcessLost, coordination_client as _client, finish_publishing

PREFIX = "jaxserve/op/"
POLL_MS = 1000  # a follower waits this long per try for the next call
COLLECT_EVERY = 256  # calls between sweeps of the ones every follower has made
HEARTBEAT_S = 1.0  # a follower reports it is alive this often (from a thread: also while in a long program)
SYNC_HEARTBEAT_S = 60.0  # a follower silent this long while the leader waits for it in sync() is gone


class _Pickler(pickle.Pickler):
    def __init__(self, file, params: Any, names: dict[int, str]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._params, self._names = params, names

    def persistent_id(self, obj):
        if obj is self._params and obj is not None:
            return ("params",)
        if isinstance(obj, jax.Device):
            return ("device", obj.id)
        if isinstance(obj, _Published):
            return ("object", obj._name)
        if id(obj) in self._names:
            return ("object", self._names[id(obj)])
        if isinstance(obj, jax.Array):
            raise TypeError("a device array cannot go through the lockstep channel (it is on the devices)")
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, params: Any, objects: dict[str, Any]):
        super().__init__(file)
        self._params, self._objects = params, objects
        self._devices = {d.id: d for d in jax.devices()}

    def persistent_load(self, pid):
        kind, *rest = pid
        if kind == "params":
            return self._params
        if kind == "device":
            return self._devices[rest[0]]
        return self._objects[rest[0]]


class Leader:
    """Publishes the device-layer calls of process 0 (created by `new`) in order."""

    def __init__(self, params: Any):
        self._params, self._names = params, {}
        self._seq, self._syncs = itertools.count(), itertools.count()
        self._swept = 0
        self.published = 0  # calls so far
        self.publish_seconds = 0.0  # spent publishing them
        self.published_bytes = 0  # their size, pickled
        self._beats: dict[str, tuple[bytes, float]] = {}  # follower -> (its last heartbeat, when it changed)

    def lost(self, timeout: float) -> str | None:
        """Why a follower counts as gone (its heartbeat unchanged for `timeout` seconds, by this process's clock),
        or None. A follower that has not beaten yet is still starting."""
        now = time.monotonic()
        try:
            beats = dict(_client().key_value_dir_get_bytes("jaxserve/alive/"))
        except Exception as e:  # noqa: BLE001
            return f"the coordination service does not answer: {e}"
        for key, beat in beats.items():
            last, since = self._beats.get(key, (None, now))
            if beat != last:
                self._beats[key] = (beat, now)
            elif now - since > timeout:
                return f"process {key.rsplit('/', 1)[-1]} stopped answering ({now - since:.0f} s without a heartbeat)"
        return None

    def new(self, cls: Callable, *args, **kwargs) -> Any:
        """cls(*args, **kwargs) here and in every follower; its method calls are published from now on."""
        name = f"{getattr(cls, '__name__', 'object')}-{len(self._names)}"
        self._publish(("new", name, cls, args, kwargs))
        obj = cls(*_unwrap(args), **_unwrap(kwargs))  # the objects themselves: their calls inside are not published
        self._names[id(obj)] = name
        return _Published(self, name, obj)

    def stop(self) -> None:
        """Followers leave their loop."""
        self._publish(("stop",))

    def sync(self, heartbeat_timeout: float = SYNC_HEARTBEAT_S) -> None:
        """Wait until every follower has made every call so far. The leader runs ahead of followers whose
        devices have programs it skips (it compiles and waits on none of them), which matters where both must
        meet within a deadline: a first collective between two processes sets up its communicator within 30 s.
        Call it after warming up. Raises ProcessLost if a follower stops beating meanwhile."""
        n = next(self._syncs)
        self._publish(("sync", n))
        client = _client()
        for rank in range(1, jax.process_count()):
            key = f"jaxserve/synced/{rank}/{n}"
            while True:
                try:
                    client.blocking_key_value_get(key, POLL_MS)
                    break
                except Exception as e:  # noqa: BLE001 (DEADLINE_EXCEEDED: not there yet)
                    if (why := self.lost(heartbeat_timeout)) is not None:
                        raise ProcessLost(why) from e
            client.key_value_delete(key)

    def _publish(self, op: tuple) -> None:
        start = time.perf_counter()
        buf = io.BytesIO()
        _Pickler(buf, self._params, self._names).dump(op)
        n = next(self._seq)
        _client().key_value_set_bytes(f"{PREFIX}{n}", buf.getvalue())
        if n and n % COLLECT_EVERY == 0:
            self._sweep(n)
        self.published += 1
        self.published_bytes += buf.tell()
        self.publish_seconds += time.perf_counter() - start

    def _sweep(self, n: int) -> None:
        """Delete the calls every follower has made (each reports its progress under jaxserve/done/)."""
        done = [int(v) for _, v in _client().key_value_dir_get("jaxserve/done/")]
        if len(done) == jax.process_count() - 1:
            for i in range(self._swept, min(done)):
                _client().key_value_delete(f"{PREFIX}{i}")
            self._swept = max(self._swept, min(done))


def _unwrap(x: Any) -> Any:
    if isinstance(x, _Published):
        return x._obj
    if type(x) in (list, tuple):
        return type(x)(_unwrap(v) for v in x)
    if isinstance(x, dict):
        return {k: _unwrap(v) for k, v in x.items()}
    return x


class _Published:
    """A device-layer object on the leader: a method call is published, then made here."""

    def __init__(self, leader: Leader, name: str, obj: Any):
        self._leader, self._name, self._obj = leader, name, obj

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._obj, attr)
        if not callable(value) or attr.startswith("__"):
            return value

        def call(*args, **kwargs):
            self._leader._publish(("call", self._name, attr, args, kwargs))
            return value(*_unwrap(args), **_unwrap(kwargs))

        return call

    def __setattr__(self, attr: str, value: Any) -> None:
        if attr.startswith("_"):
            object.__setattr__(self, attr, value)
        else:
            raise AttributeError(f"set {attr} through a method: followers would not see it")


def follow(params: Any) -> None:
    """Replay the leader's calls until it stops (a follower's whole life after loading the weights). Raises
    ProcessLost when the leader is gone."""
    objects: dict[str, Any] = {}
    client, me = _client(), jax.process_index()
    stop = threading.Event()
    beat = threading.Thread(target=_beat, args=(client, me, stop), daemon=True, name="jaxserve-heartbeat")
    beat.start()
    try:
        for n in itertools.count():
            raw = None
            while raw is None:
                try:
                    raw = client.blocking_key_value_get_bytes(f"{PREFIX}{n}", POLL_MS)
                except Exception as e:  # noqa: BLE001
                    if "DEADLINE_EXCEEDED" not in str(e):  # the store lives in the leader: no answer, no leader
                        raise ProcessLost(f"the leader (process {LEADER}) is gone: {e}") from e
            op = _Unpickler(io.BytesIO(raw), params, objects).load()
            if op[0] == "stop":
                return
            if op[0] == "sync":
                client.key_value_set(f"jaxserve/synced/{me}/{op[1]}", "1")
            elif op[0] == "new":
                _, name, cls, args, kwargs = op
                objects[name] = cls(*args, **kwargs)
            else:
                _, name, attr, args, kwargs = op
                getattr(objects[name], attr)(*args, **kwargs)
            if n % 16 == 15:
                client.key_value_set(f"jaxserve/done/{me}", str(n + 1), allow_overwrite=True)
    finally:
        # no thread of ours may still be inside a jax call when the interpreter ends: Python would unwind it
        # from under the C++ frame (glibc: "FATAL: exception not rethrown", the process aborts)
        stop.set()
        beat.join(timeout=10 * HEARTBEAT_S)
        finish_publishing()


def _beat(client, me: int, stop: threading.Event) -> None:
    for n in itertools.count():
        if stop.is_set():
            return
        try:
            client.key_value_set_bytes(f"jaxserve/alive/{me}", str(n).encode(), allow_overwrite=True)
        except Exception:  # noqa: BLE001 (the leader is gone: follow() finds out)
            return
        stop.wait(HEARTBEAT_S)
