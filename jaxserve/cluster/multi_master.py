"""LoongServe's multi-master decode, its data path (LoongServe 4.3): a request's KV held on several decode
instances at once, each share in its own instance's pool, decoded without moving it.

The instances form one KV-parallel group over their devices (engine/kv_cache.py): every instance runs the step
over the same batch, attends over the blocks it holds, and one all-gather of (output, log-sum-exp) per layer
merges the partials; the query moves, the KV stays. MultiMaster is the group's runner: its cache is the
instances' caches side by side, joined without a copy for each step (and each landing of KV) and handed back
after it, so each instance goes on serving its own requests from its own blocks between group steps. In the
group's block numbers instance i's block x is x * m + i (sched/spread_kv.py's group_block, whose SpreadKV
chooses the blocks: ESP's scale-down and scale-up).

Not built: the group's own copy of the weights is placed beside the instances' (as any runner places its own),
and groups across processes.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from jaxserve.engine import batch
from jaxserve.engine.runner import ModelRunner, Pending, cache_sharding
from jaxserve.sharding.mesh import make_mesh


class MultiMaster(ModelRunner):
    def __init__(self, instances: Sequence[ModelRunner], params, buckets: batch.Buckets | None = None):
        """instances: decode runners of one KV-parallel set each (any tensor-parallel size, the same for all),
        pools of the same size, in one process. buckets: the group's step shapes (default the first instance's;
        a spread context may be longer than one instance's max_model_len)."""
        self.instances = list(instances)
        first = self.instances[0]
        if len(self.instances) < 2:
            raise ValueError("a multi-master group needs at least two instances")
        for r in self.instances:
            if r.kvp != 1 or r.stages != 1 or r.tp != first.tp or r.num_blocks != first.num_blocks:
                raise ValueError(
                    "multi-master instances hold one KV-parallel set each, no pipeline stages, the same "
                    f"tensor-parallel size and pool: got kvp {r.kvp}, {r.stages} stages, tp {r.tp}, "
                    f"{r.num_blocks} blocks beside tp {first.tp}, {first.num_blocks} blocks"
                )
        devices = [d for r in self.instances for d in r.devices]
        self._group_sharding = cache_sharding(make_mesh(devices, first.tp))
        super().__init__(
            first.cfg,
            params,
            first.dtype,
            num_blocks=first.num_blocks * len(self.instances),
            block_size=first.block_size,
            buckets=buckets or first.buckets,
            key_block=first.key_block,
            devices=devices,
            tp=first.tp,
            kv_cache_dtype=first.kv_cache_dtype,
            caches=self._joined(),
        )
        self._part()

    def start(self, rows: Sequence[batch.Row], steps: int = 1, guided: bool = False) -> Pending | None:
        """A step of the rows over the joined caches (tables in the group's numbers): each new token's K/V lands on
        the instance its block is on."""
        self._stages[0].caches = self._joined()
        try:
            return super().start(rows, steps, guided)
        finally:
            self._part()

    def land(self, k_rows: jax.Array, v_rows: jax.Array, slots: np.ndarray) -> None:
        """KV from a prefill pool, each row onto the instance its slot's block is on."""
        self._stages[0].caches = self._joined()
        try:
            super().land(k_rows, v_rows, slots)
        finally:
            self._part()

    @property
    def caches_lost(self) -> bool:
        """An instance's cache is gone (a failed step of the group or of the instance deleted its buffers): the
        group's requests' KV with it."""
        slots = () if self._slots is None else self._slots
        return any(r.caches_lost for r in self.instances) or any(x.is_deleted() for x in slots)

    def recover(self) -> None:
        """Forget the failed step's state; the caches are the instances' (their engines rebuild them)."""
        self._previous = self._no_tokens()
        self._waiting = None
        self._slots = None

    def _joined(self) -> tuple[jax.Array, jax.Array]:
        """The instances' (k, v) caches as the group's arrays: instance i's rows the group's i-th share."""
        joined = []
        for i, first in enumerate(self.instances[0].caches):
            shape = (first.shape[0], first.shape[1] * len(self.instances), *first.shape[2:])
            joined.append(
                jax.make_array_from_single_device_arrays(
                    shape, self._group_sharding, [_shard_on(r.caches[i], d) for r in self.instances for d in r.devices]
                )
            )
        return tuple(joined)

    def _part(self) -> None:
        """Hand each instance its share of the group's caches back (a step donated the joined arrays); the group
        keeps their shapes alone, so that it holds no buffer an instance's step donates."""
        (stage,) = self._stages
        if any(isinstance(c, jax.Array) and c.is_deleted() for c in stage.caches):  # a step that failed to start
            stage.caches = tuple(jax.ShapeDtypeStruct(c.shape, c.dtype, sharding=c.sharding) for c in stage.caches)
            return
        for r in self.instances:
            r.caches = tuple(
                jax.make_array_from_single_device_arrays(
                    (c.shape[0], c.shape[1] // len(self.instances), *c.shape[2:]),
                    r.cache_sharding,
                    [_shard_on(c, d) for d in r.devices],
                )
                for c in stage.caches
            )
        stage.caches = tuple(jax.ShapeDtypeStruct(c.shape, c.dtype, sharding=c.sharding) for c in stage.caches)


def _shard_on(x: jax.Array, device: jax.Device) -> jax.Array:
    (shard,) = [s.data for s in x.addressable_shards if s.device == device]
    return shard
