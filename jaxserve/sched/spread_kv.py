"""The KV blocks of requests that decode over several elastic instances at once (LoongServe's multi-master decode,
Sections 4.3-4.4): a block manager over the instances' own managers, so that a spread request's blocks come from
(and are counted in) the pools its instances serve their own requests from.

In the group, instance i's block x is block x * m + i (m instances): block b lives on KV-parallel set b % m, as
engine/kv_cache.py lays out a group's pool (`group_block`). Where a request's blocks go is ESP's decision
(sched/esp.py): its prompt on the instances scale-down chose, in the shares it chose (`place`); its new tokens on
the last of its instances while that one has room, then on the instance scale-up chooses (the emptiest outside
its set), each such growth counted in `scale_ups`. A request placed nowhere (a recompute) starts on the emptiest.

The group's engine runs a ReplicaScheduler over this manager. Prefix caching is off: a spread prompt's blocks
are not published for other requests.
"""

from __future__ import annotations

from typing import Sequence

from jaxserve.sched.esp import ElasticInstance, ESPScheduler
from jaxserve.sched.kv_manager import BlockTables, KVCacheManager, PrefixCacheStats


def group_block(instance: int, block: int, instances: int) -> int:
    """Instance `instance`'s block `block` in the group's numbers."""
    return block * instances + instance


class SpreadKV(BlockTables):
    enable_prefix_caching = False

    def __init__(self, instances: Sequence[KVCacheManager]):
        """instances: each elastic instance's manager (one KV-parallel set each, the same block size)."""
        self.instances = list(instances)
        self.block_size = self.instances[0].block_size
        if len(self.instances) < 2 or any(
            m.block_size != self.block_size or m.scratch_blocks != 1 for m in self.instances
        ):
            raise ValueError("a spread pool joins two or more instances' pools of one set each and one block size")
        self.stats = PrefixCacheStats()  # never hit: prefix caching is off
        self.scale_ups = 0  # times a decoding request grew onto another instance
        self._tables: dict[str, list[int]] = {}  # group block numbers
        self._held: dict[str, dict[int, int]] = {}  # instance -> blocks held there, in the order it joined
        self._planned: dict[str, list[int]] = {}  # the instance of each of a prompt's blocks (`place`), until
        # they are allocated

    @property
    def capacity(self) -> int:
        return sum(m.capacity for m in self.instances)

    @property
    def num_free(self) -> int:
        return sum(m.num_free for m in self.instances)

    def describe(self) -> str:
        return f"{len(self.instances)} elastic instances of {self.instances[0].capacity * self.block_size:,} tokens"

    def held(self, rid: str) -> dict[int, int]:
        """Blocks rid holds on each of its instances, in the order they joined it."""
        return dict(self._held.get(rid, {}))

    def place(self, rid: str, shares: dict[int, int]) -> None:
        """Where rid's prompt goes (ESPScheduler.scale_down's shares: instance -> tokens, in position order): each
        block on the instance holding its first position."""
        bounds, at = [], 0
        for instance, tokens in shares.items():
            at += tokens
            bounds.append((at, instance))
        blocks = self.blocks_for(at)
        self._planned[rid] = [next(i for end, i in bounds if k * self.block_size < end) for k in range(blocks)]

    def unplace(self, rid: str) -> None:
        """Forget where rid's prompt was to go (it ended before its KV landed)."""
        self._planned.pop(rid, None)

    def promised(self, instance: int) -> int:
        """Tokens placed on an instance and not allocated there yet (a prompt whose KV has not landed)."""
        return sum(
            self.block_size
            for rid, plan in self._planned.items()
            for k, i in enumerate(plan)
            if i == instance and k >= self.num_blocks_held(rid)
        )

    def match_prefix(self, rid: str, token_ids: Sequence[int], max_tokens: int) -> int:
        if self._tables.get(rid):
            raise ValueError(f"request {rid} already holds blocks")
        self._tables.setdefault(rid, [])
        return 0

    def allocate(self, rid: str, total_tokens: int) -> list[int] | None:
        """Grow rid's table to cover total_tokens positions, one block at a time on the instance ESP chooses;
        None (nothing changes) when the instances have too few free blocks together."""
        table = self._tables.setdefault(rid, [])
        need = self.blocks_for(total_tokens) - len(table)
        if need <= 0:
            return []
        if need > self.num_free:
            return None
        held = self._held.setdefault(rid, {})
        new = []
        for _ in range(need):
            i = self._instance_for(rid, len(table))
            if i not in held and len(table) >= len(self._planned.get(rid, ())) and table:
                self.scale_ups += 1
            manager = self.instances[i]
            (block,) = manager.allocate(rid, (manager.num_blocks_held(rid) + 1) * self.block_size)
            held[i] = held.get(i, 0) + 1
            table.append(group_block(i, block, len(self.instances)))
            new.append(table[-1])
        if len(table) >= len(self._planned.get(rid, ())):  # its placement is done: `promised` no longer walks it
            self._planned.pop(rid, None)
        return new

    def _instance_for(self, rid: str, k: int) -> int:
        """The instance of rid's k-th block: as placed; else its last instance while it has room; else scale-up's
        choice; else any of its own with room (one has: allocate checked the free blocks)."""
        plan, held = self._planned.get(rid, ()), self._held[rid]
        if k < len(plan) and self.instances[plan[k]].num_free:
            return plan[k]
        if held and self.instances[last := next(reversed(held))].num_free:
            return last
        views = [
            ElasticInstance(i, m.capacity * self.block_size, (m.capacity - m.num_free) * self.block_size)
            for i, m in enumerate(self.instances)
        ]
        grown = ESPScheduler.scale_up({i: n * self.block_size for i, n in held.items()}, views)
        return grown if grown is not None else max(held, key=lambda i: self.instances[i].num_free)

    def commit(self, rid: str, token_ids: Sequence[int], num_computed: int) -> None:
        del rid, token_ids, num_computed  # nothing published (prefix caching is off)

    def free(self, rid: str) -> None:
        for i in self._held.pop(rid, {}):
            self.instances[i].free(rid)
        self._tables.pop(rid, None)
        self._planned.pop(rid, None)

    def reset_prefix_cache(self) -> None:
        pass
