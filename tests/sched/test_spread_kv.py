"""The blocks of requests spread over elastic instances (sched/spread_kv.py): taken from the instances' own pools
where ESP places them, grown on the last instance, then onto the emptiest other one (a scale-up)."""

from __future__ import annotations

import pytest

from jaxserve.sched.kv_manager import KVCacheManager
from jaxserve.sched.spread_kv import SpreadKV, group_block

BS = 4


def pools(*free_blocks: int) -> list[KVCacheManager]:
    return [KVCacheManager(n + 1, BS, enable_prefix_caching=False) for n in free_blocks]


def test_a_placed_prompt_lands_on_its_instances_in_their_shares_and_is_counted_there():
    managers = pools(8, 8, 8)
    kv = SpreadKV(managers)
    kv.place("a", {2: 10, 0: 10})  # positions 0-9 on instance 2, 10-19 on instance 0
    assert kv.promised(2) == 3 * BS and kv.promised(0) == 2 * BS and kv.promised(1) == 0
    table = kv.allocate("a", 20)
    assert [b % 3 for b in table] == [2, 2, 2, 0, 0]  # block 2 holds positions 8-11: instance 2's
    assert kv.held("a") == {2: 3, 0: 2} and kv.promised(2) == 0
    assert [m.num_free for m in managers] == [6, 8, 5] and kv.num_free == 19 and kv.capacity == 24
    assert table == [
        group_block(i, b, 3)
        for i, b in zip([2, 2, 2, 0, 0], managers[2].block_table("a") + managers[0].block_table("a"))
    ]
    assert kv.scale_ups == 0


def test_decode_grows_on_the_last_instance_then_scales_up_onto_the_emptiest_other():
    managers = pools(3, 2, 6)
    kv = SpreadKV(managers)
    kv.place("a", {1: 8})
    kv.allocate("a", 8)  # instance 1's two blocks
    assert kv.allocate("a", 9) is not None  # instance 1 is full: scale up onto the emptiest other, 2
    assert kv.held("a") == {1: 2, 2: 1} and kv.scale_ups == 1
    kv.allocate("a", 8 + 6 * BS)  # instance 2 takes the rest of its room
    assert kv.held("a") == {1: 2, 2: 6} and kv.scale_ups == 1
    kv.allocate("a", 8 + 7 * BS)  # then instance 0
    assert kv.held("a") == {1: 2, 2: 6, 0: 1} and kv.scale_ups == 2
    assert kv.allocate("a", 8 + 10 * BS) is None and kv.num_blocks_held("a") == 9  # 2 free: nothing changes
    kv.free("a")
    assert [m.num_free for m in managers] == [3, 2, 6] and kv.block_table("a") == []


def test_instances_serving_their_own_requests_meanwhile_are_respected():
    managers = pools(4, 4)
    kv = SpreadKV(managers)
    kv.place("a", {0: 16})
    managers[0].allocate("own", 3 * BS)  # instance 0's engine took three of its blocks since the placement
    assert [b % 2 for b in kv.allocate("a", 16)] == [0, 1, 1, 1]  # the plan where it can be, the rest moves on
    assert kv.scale_ups == 0  # part of the placement, not a decode's growth


def test_an_unplaced_request_starts_on_the_emptiest_instance():
    kv = SpreadKV(pools(2, 5, 3))
    kv.match_prefix("r", list(range(12)), 11)
    assert kv.allocate("r", 12) is not None and kv.held("r") == {1: 3}


def test_pools_that_cannot_be_joined_are_refused():
    with pytest.raises(ValueError, match="two or more"):
        SpreadKV(pools(4))
    with pytest.raises(ValueError, match="one block size"):
        SpreadKV([KVCacheManager(5, 4), KVCacheManager(5, 8)])
