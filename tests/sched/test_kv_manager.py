import random
import subprocess
import sys
from collections import Counter

import pytest

from jaxserve.sched.kv_manager import RELEASED, KVCacheManager

BS = 4


def check_invariants(kv: KVCacheManager) -> None:
    tables = kv._tables
    holders = Counter(b for t in tables.values() for b in t if b != RELEASED)
    free = set().union(*kv._free)
    assert not set(range(kv.scratch_blocks)) & (set(holders) | free)
    for queue in kv._free:  # a block waits in its own set's queue
        assert len({b % len(kv._free) for b in queue}) <= 1
    for block in range(kv.scratch_blocks, kv.num_blocks):
        if block in free:
            assert kv._ref[block] == 0 and block not in holders
        else:
            assert kv._ref[block] == holders[block] > 0
    assert kv.num_free + len(holders) == kv.capacity
    for h, block in kv._cached.items():
        assert kv._hash[block] == h
    assert sum(h is not None for h in kv._hash) == len(kv._cached)
    for block, n in holders.items():
        if n > 1:
            assert kv._hash[block] is not None, f"shared block {block} is not a committed full block"
    for rid, table in tables.items():
        assert len(kv._chains[rid]) <= len(table)


def prompt(n: int, base: int = 0) -> list[int]:
    return list(range(base, base + n))


def start(kv: KVCacheManager, rid: str, tokens: list[int]) -> int:
    """A fresh prompt: match, allocate the rest, compute, commit; returns the hit tokens."""
    hit = kv.match_prefix(rid, tokens, len(tokens) - 1)
    assert kv.allocate(rid, len(tokens)) is not None
    kv.commit(rid, tokens, len(tokens))
    return hit


@pytest.mark.parametrize("caching", [True, False])
def test_blocks_that_leave_a_sliding_window_go_back(caching):
    """Window 6, blocks of 4: with 8 tokens computed the next query (position 8) sees 3..8, block 0 stays; at 10
    it sees 5..10, so block 0 (0..3) goes back; at 14, block 1 (4..7) too. A released block stays published for a prefix
    hit."""
    kv = KVCacheManager(8, BS, enable_prefix_caching=caching, sliding_window=6)
    tokens = prompt(8)
    kv.match_prefix("a", tokens, 7)
    kv.allocate("a", 8)
    kv.commit("a", tokens, 8)  # the next query (8) sees 3..8: block 0 still needed
    assert RELEASED not in kv.block_table("a") and kv.num_free == 5
    tokens += prompt(2, 8)
    kv.allocate("a", 10)
    kv.commit("a", tokens, 10)
    assert kv.block_table("a")[0] == RELEASED and kv.num_free == 5
    check_invariants(kv)
    tokens += prompt(4, 10)
    kv.allocate("a", 14)
    kv.commit("a", tokens, 14)
    assert kv.block_table("a")[:2] == [RELEASED, RELEASED] and kv.num_free == 5
    check_invariants(kv)
    assert start(kv, "b", prompt(9)) == (8 if caching else 0)  # the released blocks still serve a prefix
    kv.free("a")
    kv.free("b")
    check_invariants(kv)
    assert kv.num_free == kv.capacity


def test_a_released_first_block_keeps_the_kv_parallel_set():
    """kvp_tokens: a recompute served wholly from the prefix cache whose first block then leaves the window still
    takes its next blocks on the set its blocks belong on (from its first live block), not set -1 % sets."""
    kv = KVCacheManager(18, BS, scratch_blocks=2, kvp_tokens=2 * BS, sliding_window=5)
    tokens = prompt(8)
    start(kv, "a", tokens)
    kv.free("a")
    assert kv.match_prefix("b", tokens, 8) == 8 and kv.allocate("b", 8) == []
    kv.commit("b", tokens + [8, 9], 10)  # positions up to 9 computed: block 0 (0..3) left the window
    assert kv.block_table("b")[0] == RELEASED
    table = kv.block_table("b")
    new = kv.allocate("b", 12)
    assert new and new[0] % 2 == (table[1] + 1) % 2  # block 2 opens the next set after blocks 0-1's
    check_invariants(kv)


def test_constructor_and_sizes():
    with pytest.raises(ValueError):
        KVCacheManager(1, BS)
    with pytest.raises(ValueError):
        KVCacheManager(4, 0)
    kv = KVCacheManager(9, BS)
    assert (kv.capacity, kv.num_free, kv.blocks_for(0), kv.blocks_for(4), kv.blocks_for(5)) == (8, 8, 0, 1, 2)
    assert kv.block_table("x") == [] and kv.num_blocks_held("x") == 0
    assert kv.allocate("a", 6) == [1, 2]  # free queue starts in id order, block 0 is never handed out
    assert kv.allocate("a", 8) == [] and kv.allocate("a", 9) == [3]
    kv.block_table("a").append(99)  # a copy
    assert kv.block_table("a") == [1, 2, 3]


def test_same_prompt_hits_full_blocks_and_is_capped_by_max_tokens():
    kv = KVCacheManager(32, BS)
    p = prompt(14)  # 3.5 blocks
    assert start(kv, "a", p) == 0
    assert kv.match_prefix("b", p, len(p) - 1) == 12
    assert kv.block_table("b") == kv.block_table("a")[:3]
    assert kv.allocate("b", len(p)) == [5]
    exact = prompt(16, base=100)  # exactly 4 full blocks: the last token must still be computed
    start(kv, "c", exact)
    assert kv.match_prefix("d", exact, len(exact) - 1) == 12
    assert kv.match_prefix("e", exact, len(exact)) == 16
    assert kv.match_prefix("f", prompt(14, base=1), 13) == 0  # different first block: no hit
    check_invariants(kv)


def test_freed_blocks_stay_matchable_until_evicted_tail_first():
    kv = KVCacheManager(5, BS)  # 4 usable blocks
    p = prompt(16)
    kv.allocate("a", 16)
    kv.commit("a", p, 16)
    kv.free("a")
    assert kv.num_free == 4
    assert kv.match_prefix("b", p, 16) == 16
    kv.free("b")
    kv.allocate("x", 4)  # evicts the tail block (freed first), the head stays cached
    assert kv.match_prefix("c", p, 16) == 12
    kv.free("c")
    kv.allocate("y", 8)  # then the next tail blocks
    assert kv.match_prefix("d", p, 16) == 4
    kv.free("d")
    check_invariants(kv)


def test_allocate_short_changes_nothing():
    kv = KVCacheManager(5, BS)
    p = prompt(8)
    start(kv, "a", p)
    kv.free("a")  # 2 free-but-cached + 2 plain free
    kv.allocate("b", 4)
    before = (kv.num_free, [dict(q) for q in kv._free], dict(kv._cached), kv.block_table("b"))
    assert kv.allocate("b", 4 * BS + 1) is None
    assert kv.allocate("new", 4 * BS) is None
    assert (kv.num_free, [dict(q) for q in kv._free], dict(kv._cached), kv.block_table("b")) == before
    assert kv.block_table("new") == []
    check_invariants(kv)


def test_concurrent_duplicate_commit_keeps_the_first():
    kv = KVCacheManager(16, BS)
    p = prompt(9)
    for rid in ("a", "b"):  # both miss: neither has committed yet
        assert kv.match_prefix(rid, p, 8) == 0
        kv.allocate(rid, len(p))
    kv.commit("a", p, 9)
    kv.commit("b", p, 9)
    assert kv.match_prefix("c", p, 9) == 8
    assert kv.block_table("c") == kv.block_table("a")[:2]
    kv.free("a")
    kv.free("c")
    kv.free("b")  # b's duplicates return as plain free blocks
    assert kv.match_prefix("d", p, 9) == 8 and kv.block_table("d") == [1, 2]
    check_invariants(kv)


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False)
    p = prompt(12)
    assert start(kv, "a", p) == 0
    kv.free("a")
    assert kv.match_prefix("b", p, 11) == 0 and kv._cached == {}
    assert kv.stats.query_tokens == kv.stats.hit_tokens == 0


def test_preempted_request_resumes_from_its_committed_blocks():
    kv = KVCacheManager(16, BS)
    tokens = prompt(10)
    kv.match_prefix("a", tokens, 9)
    kv.allocate("a", 10)
    kv.commit("a", tokens, 10)
    tokens += [500, 501, 502]  # decode: token 10.. generated, KV up to 12 computed
    kv.allocate("a", 13)
    kv.commit("a", tokens, 12)
    table = kv.block_table("a")
    kv.free("a")  # preempted
    assert kv.match_prefix("a", tokens, len(tokens) - 1) == 12
    assert kv.block_table("a") == table[:3]
    kv.allocate("a", 13)
    kv.commit("a", tokens, 13)  # resumes incrementally
    check_invariants(kv)


def test_stats_count_tokens():
    kv = KVCacheManager(16, BS)
    p = prompt(10)
    start(kv, "a", p)
    start(kv, "b", p)
    assert (kv.stats.query_tokens, kv.stats.hit_tokens) == (20, 8)


def test_reset_prefix_cache_keeps_live_blocks():
    kv = KVCacheManager(16, BS)
    p, q = prompt(8), prompt(8, base=50)
    start(kv, "a", p)
    start(kv, "b", q)
    kv.free("b")
    held = kv.block_table("a")
    kv.reset_prefix_cache()
    assert kv.block_table("a") == held and kv.num_free == kv.capacity - 2
    assert kv.match_prefix("c", p, 8) == 0 and kv.match_prefix("d", q, 8) == 0
    kv.commit("a", p, 8)  # the live request republishes what it computed
    assert kv.match_prefix("e", p, 8) == 8
    check_invariants(kv)


def test_randomized_invariants():
    rng = random.Random(0)
    kv = KVCacheManager(40, BS)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    live: dict[str, tuple[list[int], int]] = {}  # rid -> (tokens, computed)
    next_id = 0
    for _ in range(4000):
        op = rng.random()
        if op < 0.3 or not live:  # a new request sharing a random prefix
            rid, next_id = f"r{next_id}", next_id + 1
            tokens = rng.choice(prefixes)[: rng.randrange(1, 30)] + [rng.randrange(50) for _ in range(rng.randrange(5))]
            hit = kv.match_prefix(rid, tokens, len(tokens) - 1)
            assert hit % BS == 0 and hit <= len(tokens) - 1 and kv.num_blocks_held(rid) == hit // BS
            live[rid] = (tokens, hit)
        else:
            rid = rng.choice(sorted(live))
            tokens, computed = live[rid]
            if op < 0.75:  # compute a chunk or a decode token, then commit it
                if computed == len(tokens):
                    tokens.append(rng.randrange(50))
                end = rng.randrange(computed + 1, len(tokens) + 1)
                if kv.allocate(rid, end) is None:
                    kv.free(rid)  # preempted; resumes later through match_prefix
                    del live[rid]
                else:
                    assert kv.num_blocks_held(rid) >= kv.blocks_for(end)
                    kv.commit(rid, tokens, end)
                    live[rid] = (tokens, end)
            else:
                kv.free(rid)
                del live[rid]
                kv.free(rid)  # a second free is a no-op
        check_invariants(kv)
    assert kv.stats.hit_tokens > 0


def test_kv_manager_never_imports_jax():
    code = (
        "import sys, jaxserve.sched.kv_manager; "
        "assert not [m for m in sys.modules if m == 'jax' or m.startswith('jax.')], 'jax imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_progressive_kvp_fills_one_set_then_the_next():
    """Medha's progressive KV parallelism over 4 device sets, 3 blocks a set: a short request stays on one set; a
    long one starts on the set with the most free blocks and moves on every 3 blocks, as it grows (a set joining
    mid-prefill); a full set lends its neighbour's blocks; freed blocks go back to their own set's queue."""
    kv = KVCacheManager(4 * 12, BS, enable_prefix_caching=False, scratch_blocks=4, kvp_tokens=3 * BS)
    assert kv.allocate("short", 2 * BS) is not None
    (short_set,) = {b % 4 for b in kv.block_table("short")}
    kv.allocate("long", 4 * BS)  # a first chunk
    kv.allocate("long", 10 * BS)  # the rest of the prompt: sets join as it grows
    sets = [b % 4 for b in kv.block_table("long")]
    first = sets[0]
    assert first != short_set  # the emptiest set
    assert sets == [(first + k // 3) % 4 for k in range(10)]
    check_invariants(kv)
    kv.allocate("wide", 3 * BS)  # starts on the set with the most free: the one "long" has used least
    check_invariants(kv)
    kv.free("long")
    kv.free("short")
    check_invariants(kv)
    assert kv.num_free == kv.capacity - 3
    # a set that runs out lends the next set's blocks
    one = KVCacheManager(2 * 4, BS, enable_prefix_caching=False, scratch_blocks=2, kvp_tokens=8 * BS)
    assert [b % 2 for b in one.allocate("a", 5 * BS)] == [0, 0, 0, 1, 1]
    check_invariants(one)
    with pytest.raises(ValueError, match="kvp_tokens"):
        KVCacheManager(9, BS, scratch_blocks=2, kvp_tokens=BS)  # 9 blocks do not split over 2 sets
