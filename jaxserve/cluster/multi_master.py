"""LoongServe's multi-master decode, its data path (LoongServe 4.3): a request's KV held on several decode
instances at once, each share in its own instance's pool, decoded without moving it.

The instances form one KV-parallel group over their devices (engine/kv_cache.py): every instance runs the step
over the same batch, attends over the blocks it holds, and one all-gather of (output, log-sum-exp) per layer
merges the partials; the query moves, the KV stays. The group's cache is the instances' caches side by side,
joined without a copy for a step and handed back after it, so each instance goes on serving its own requests
from its own blocks between group steps. In the group's block numbers, instance i's block x is x * m + i (m
instances): `table` writes a spread request's table so.

Which requests spread, and when (ESP's scale-up for decode, LoongServe 4.4), is the cluster policy's choice
(the cluster-policy contract of sched/); here a caller names the blocks. Not built: the group's own copy of the
weights (it places them on its devices as any runner does, beside the instances' copies), and groups across
processes.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from jaxserve.engine import batch
from jaxserve.engine.runner import ModelRunner, cache_sharding
from jaxserve.sharding.mesh import make_mesh


class MultiMaster:
    def __init__(self, instances: Sequence[ModelRunner], params: Any, buckets: batch.Buckets | None = None):
        """instances: decode runners of one KV-parallel set each (any tensor-parallel size, the same for all),
        pools of the same size, in one process. buckets: the group's step shapes (default the first instance's;
        a spread context may be longer than one instance's max_model_len)."""
        self.instances = list(instances)
        first = self.instances[0]
        if len(self.instances) < 2:
            raise ValueError("a multi-master group needs at least two instances")
        for r in self.instances:
            if r.kvp != 1 or r.stages != 1 or r.tp != first.tp or r.num_blocks != first.num_blocks:
                raise ValueError("multi-master instances hold one KV-parallel set each, no pipeline stages, the same "
                                 f"tensor-parallel size and pool: got kvp {r.kvp}, {r.stages} stages, tp {r.tp}, "
                                 f"{r.num_blocks} blocks beside tp {first.tp}, {first.num_blocks} blocks")
        devices = [d for r in self.instances for d in r.devices]
        self._sharding = cache_sharding(make_mesh(devices, first.tp))  # the group runner's, before it exists
        self.group = ModelRunner(first.cfg, params, first.dtype, num_blocks=first.num_blocks * len(self.instances),
                                 block_size=first.block_size, buckets=buckets or first.buckets,
                                 key_block=first.key_block, devices=devices, tp=first.tp,
                                 kv_cache_dtype=first.kv_cache_dtype, caches=self._joined())

    def table(self, blocks: Sequence[tuple[int, int]]) -> list[int]:
        """A spread request's block table in the group's numbers, from its (instance, block) pairs in order."""
        m = len(self.instances)
        return [block * m + instance for instance, block in blocks]

    def execute(self, rows: Sequence[batch.Row]) -> np.ndarray:
        """One step of the rows over the joined caches (tables in the group's numbers, from `table`): each new
        token's K/V lands on the instance its block is on. Returns each row's sampled token."""
        self.group.caches = self._joined()
        try:
            return self.group.execute(rows)
        finally:
            self._part()

    def _joined(self) -> tuple[jax.Array, jax.Array]:
        """The instances' (k, v) caches as the group's arrays: instance i's rows the group's i-th share."""
        joined = []
        for i, first in enumerate(self.instances[0].caches):
            shape = (first.shape[0], first.shape[1] * len(self.instances), *first.shape[2:])
            joined.append(jax.make_array_from_single_device_arrays(
                shape, self._sharding, [_shard_on(r.caches[i], d) for r in self.instances for d in r.devices]))
        return tuple(joined)

    def _part(self) -> None:
        """Hand each instance its share of the group's caches back (the step donated the joined arrays)."""
        for r in self.instances:
            r.caches = tuple(jax.make_array_from_single_device_arrays(
                (c.shape[0], c.shape[1] // len(self.instances), *c.shape[2:]), r.cache_sharding,
                [_shard_on(c, d) for d in r.devices]) for c in self.group.caches)


def _shard_on(x: jax.Array, device: jax.Device) -> jax.Array:
    (shard,) = [s.data for s in x.addressable_shards if s.device == device]
    return shard
