"""Paged KV blocks owned by the scheduler, so that admission, prefix hits and eviction are decided in one place; the
engine only executes the block ids granted here.

Design after vLLM: each block has a reference count; a full block whose KV is computed is published under a hash
of its tokens chained to its parent's, so a later request with the same prefix reuses it. A block whose count drops
to 0 keeps its hash (free-but-cached) in an LRU free queue and is evicted only when allocation takes it.

A KV-parallel group of `kvp` device sets holds block b on set b % kvp. By default a request's blocks come from one
LRU queue, so its context spreads over every set. With `kvp_tokens` (Medha's progressive KV parallelism) each set
has its own queue: a request fills `kvp_tokens` tokens on the set with the most free blocks, then the next set's
(wrapping after the last), so a short request stays on one set and a long one's next set joins as it grows; a
full set lends its neighbour's blocks.

With a sliding window (Mistral v0.1, Phi-3) a block whose every position has left the window of every query to
come is released as its request's tokens are committed: its table entry becomes RELEASED (-1, which the attention
treats as a block held elsewhere) and its reference dropped (a published block stays cached for prefix hits).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Sequence

import numpy as np

SCRATCH_BLOCK = 0  # never handed out: the executor points padding writes at it (blocks below scratch_blocks too)
RELEASED = -1  # a table entry whose block left a sliding window and went back
_SEED = bytes(32)  # parent of a request's first block


def _block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """sha256, not hash(): a collision would silently serve another prompt's KV."""
    return hashlib.sha256(parent + np.asarray(tokens, dtype="<i8").tobytes()).digest()


@dataclasses.dataclass
class PrefixCacheStats:
    """Token counts for Prometheus: the hit rate is hit_tokens / query_tokens."""

    query_tokens: int = 0
    hit_tokens: int = 0


class BlockTables:
    """Each request's block table, as a scheduler reads it (KVCacheManager's; sched/spread_kv.py's)."""

    block_size: int
    _tables: dict[str, list[int]]

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def block_table(self, rid: str) -> list[int]:
        return list(self._tables.get(rid, ()))

    def num_blocks_held(self, rid: str) -> int:
        return len(self._tables.get(rid, ()))


class KVCacheManager(BlockTables):
    """Paged KV blocks owned by the scheduler: reference counts, prefix hashes over full blocks, LRU eviction of
    free-but-cached blocks (vLLM's design)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        scratch_blocks: int = 1,
        kvp_tokens: int | None = None,
        sliding_window: int | None = None,
    ):
        """scratch_blocks: blocks 0..scratch_blocks-1 are never handed out (one per device set of a KV-parallel
        group, whose block b lives on set b % group). kvp_tokens: a request's tokens on one set before the next
        set's blocks (whole blocks; None: its blocks alternate sets). sliding_window: the model's (blocks that
        leave it are released on commit)."""
        if scratch_blocks < 1 or num_blocks <= scratch_blocks or block_size < 1:
            raise ValueError(
                f"need num_blocks > scratch_blocks >= 1 and block_size >= 1, got {num_blocks}, "
                f"{scratch_blocks} and {block_size}"
            )
        if kvp_tokens is not None and (
            kvp_tokens < block_size or kvp_tokens % block_size or num_blocks % scratch_blocks
        ):
            raise ValueError(
                f"kvp_tokens ({kvp_tokens}) must be whole KV blocks of {block_size} tokens, and the "
                f"{num_blocks} blocks split evenly over the {scratch_blocks} KV-parallel sets"
            )
        self.num_blocks, self.block_size, self.enable_prefix_caching = num_blocks, block_size, enable_prefix_caching
        self.scratch_blocks, self.sliding_window = scratch_blocks, sliding_window
        self.stats = PrefixCacheStats()
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks  # set only while the block is published in _cached
        self._cached: dict[bytes, int] = {}  # hash -> its canonical block
        # ref-0 blocks as ordered sets (one, or one per KV-parallel set with kvp_tokens): allocate pops the front
        # (least recently freed), free appends at the back. OrderedDict, not dict: a dict's front, once deleted from,
        # is found again in O(deletions) (CPython)
        self._sets = scratch_blocks if kvp_tokens is not None else 1
        self._per_set = kvp_tokens // block_size if kvp_tokens is not None else 0  # a request's blocks on one set
        self._free: list[collections.OrderedDict[int, None]] = [
            collections.OrderedDict.fromkeys(range(scratch_blocks + k, num_blocks, self._sets))
            for k in range(self._sets)
        ]
        self._first_set: dict[str, int] = {}  # with kvp_tokens: the set holding each request's first blocks
        self._tables: dict[str, list[int]] = {}
        self._chains: dict[str, list[bytes]] = {}  # hashes of each table's committed full blocks, in order

    @classmethod
    def for_tokens(cls, tokens: int, block_size: int, enable_prefix_caching: bool = True) -> KVCacheManager:
        """A cache holding `tokens` tokens (rounded up to whole blocks), plus the scratch block."""
        return cls(-(-tokens // block_size) + 1, block_size, enable_prefix_caching)

    @property
    def capacity(self) -> int:
        return self.num_blocks - self.scratch_blocks

    def describe(self) -> str:
        """What the pool holds, in words: "4 KV-parallel sets of 1,024 tokens", or "1,024 tokens"."""
        sets = self.scratch_blocks
        per_set = self.capacity // sets * self.block_size
        return f"{sets} KV-parallel sets of {per_set:,} tokens" if sets > 1 else f"{per_set:,} tokens"

    @property
    def num_free(self) -> int:
        return sum(map(len, self._free))

    def _queue(self, block: int) -> collections.OrderedDict[int, None]:
        return self._free[block % self._sets]

    def match_prefix(self, rid: str, token_ids: Sequence[int], max_tokens: int) -> int:
        """Longest cached prefix of token_ids made of full blocks, at most max_tokens tokens (the caller passes
        len-1 for a fresh prompt so the last prompt token is always computed and yields logits). The hit blocks
        become the start of rid's table (reference count +1; a hit on a free-but-cached block takes it out of the
        free queue). Returns the number of tokens covered (a multiple of block_size). rid must hold no blocks yet.
        With prefix caching off: 0. Counts queries/hits in token units for metrics."""
        if self._tables.get(rid):
            raise ValueError(f"request {rid} already holds blocks")
        if not self.enable_prefix_caching:
            return 0
        bs, chain, hits = self.block_size, [], []
        for i in range(min(max_tokens, len(token_ids)) // bs):
            h = _block_hash(chain[-1] if chain else _SEED, token_ids[i * bs : (i + 1) * bs])
            block = self._cached.get(h)
            if block is None:
                break
            chain.append(h)
            hits.append(block)
        for block in hits:
            if self._ref[block] == 0:
                del self._queue(block)[block]
            self._ref[block] += 1
        self._tables[rid], self._chains[rid] = hits, chain
        self.stats.query_tokens += len(token_ids)
        self.stats.hit_tokens += len(hits) * bs
        return len(hits) * bs

    def allocate(self, rid: str, total_tokens: int) -> list[int] | None:
        """Grow rid's table to cover total_tokens positions; returns the new block ids (possibly []), or None
        (and changes nothing) when not enough blocks are free. Taking a free-but-cached block evicts it: its hash
        leaves the map."""
        held = self.num_blocks_held(rid)
        need = self.blocks_for(total_tokens) - held
        if need <= 0:
            return []
        if need > self.num_free:
            return None
        new = []
        for k in range(held, held + need):
            block, _ = self._free[self._set_for(rid, k)].popitem(last=False)
            if (h := self._hash[block]) is not None:
                del self._cached[h]
                self._hash[block] = None
            self._ref[block] = 1
            new.append(block)
        self._tables.setdefault(rid, []).extend(new)
        self._chains.setdefault(rid, [])
        return new

    def _set_for(self, rid: str, k: int) -> int:
        """The queue rid's k-th block comes from: the only one, or with kvp_tokens the set its k-th block belongs
        on (its first set: where it already holds blocks, else the one with the most free), or the next set with
        a free block when that one is full."""
        if self._sets == 1:
            return 0
        if rid not in self._first_set:
            table = self._tables.get(rid, [])
            live = next((i for i, b in enumerate(table) if b != RELEASED), None)  # from its first live block
            self._first_set[rid] = (
                (table[live] - live // self._per_set) % self._sets
                if live is not None
                else max(range(self._sets), key=lambda j: (len(self._free[j]), -j))
            )
        want = (self._first_set[rid] + k // self._per_set) % self._sets
        return next(j % self._sets for j in range(want, want + self._sets) if self._free[j % self._sets])

    def commit(self, rid: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Record the hashes of rid's full blocks among its first num_computed tokens (token_ids holds at least
        that many: prompt + generated so far). Incremental: each block is hashed once per table. A block whose
        hash is already mapped to another block is left unmapped (two requests computed the same prefix at once;
        the first stays canonical). Then, with a sliding window, the blocks no query from num_computed on sees
        are released."""
        table, chain, bs = self._tables[rid], self._chains[rid], self.block_size
        full = min(num_computed, len(token_ids)) // bs
        if full > len(table):
            raise ValueError(f"request {rid}: {num_computed} computed tokens but only {len(table)} blocks")
        for i in range(len(chain), full if self.enable_prefix_caching else 0):
            h = _block_hash(chain[-1] if chain else _SEED, token_ids[i * bs : (i + 1) * bs])
            chain.append(h)
            if h not in self._cached and table[i] != RELEASED:
                self._cached[h], self._hash[table[i]] = table[i], h
        if self.sliding_window:
            self._release(table, (num_computed - self.sliding_window + 1) // bs)

    def _release(self, table: list[int], blocks: int) -> None:
        """Drop the table's first `blocks` blocks (those before the window's first key)."""
        for i in range(min(blocks, len(table))):
            if table[i] != RELEASED:
                self._unref(table[i])
                table[i] = RELEASED

    def _unref(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._queue(block)[block] = None

    def free(self, rid: str) -> None:
        """Drop rid's references in reverse order (tail blocks first, so they are evicted first). A block whose
        count reaches 0 goes to the back of the free queue keeping its hash (free-but-cached) if it has one.
        Unknown rid: no-op."""
        self._chains.pop(rid, None)
        self._first_set.pop(rid, None)
        for block in reversed(self._tables.pop(rid, [])):
            if block != RELEASED:
                self._unref(block)

    def reset_prefix_cache(self) -> None:
        """Forget every hash (e.g. after the device caches were rebuilt). Live requests keep their blocks; their
        chains restart so a later commit republishes them, and free blocks simply become uncached."""
        self._cached.clear()
        self._hash = [None] * self.num_blocks
        for chain in self._chains.values():
            chain.clear()
