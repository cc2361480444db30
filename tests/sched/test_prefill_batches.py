"""TetriInfer's prefill instance scheduler (3.3.1, 3.3.3): scheduling batches, FCFS/SJF/LJF inside one,
non-preemptive, fixed-size chunks that slice long prompts, merge short ones and pad the last one."""

from __future__ import annotations

import pytest

from jaxserve.sched import cost_models as cm
from jaxserve.sched.batch_cost import TetrisBatchCost
from jaxserve.sched.plan import Outcome, Phase, WorkItem
from jaxserve.sched.prefill_batches import PrefillBatchScheduler, chunk_time, least_queued
from jaxserve.sched.profiles import tetris_table1_samples
from jaxserve.sched.request import Request


def requests(*lens: int) -> list[Request]:
    return [Request(str(i), 0.0, p, 10) for i, p in enumerate(lens)]


def step(sched: PrefillBatchScheduler, now: float = 0.0) -> tuple[list[tuple[str, int, int]], list[str]]:
    """Run one chunk: its pieces (id, start, end) and the requests it finished."""
    plan = sched.schedule(now)
    assert plan is not None
    tokens = {i.request_id: (0,) for i in plan.items if sched.yields_token(i)}
    done = sched.apply(plan, Outcome(now + 1.0, (), tokens))
    return [(i.request_id, i.start, i.end) for i in plan.items], [r.id for r in done]


def test_chunks_merge_short_prompts_slice_long_ones_and_sjf_orders_each_batch():
    sched = PrefillBatchScheduler(chunk=512, batch=3, order="sjf")
    reqs = requests(300, 100, 200, 50, 400)
    for r in reqs:
        sched.add(r)
    # batch 1 is the first three arrivals sorted: 100, 200, 300 (ids 1, 2, 0); 300 is sliced 212 + 88
    assert step(sched) == ([("1", 0, 100), ("2", 0, 200), ("0", 0, 212)], ["1", "2"])
    # the batch's last chunk holds only 88 tokens (padded): batch 2 does not start in it
    assert step(sched) == ([("0", 212, 300)], ["0"])
    assert step(sched) == ([("3", 0, 50), ("4", 0, 400)], ["3", "4"])
    assert sched.schedule(0.0) is None
    assert all(r.generated == 1 and r.first_token_at == 1.0 and r.prefilled == r.prompt_len for r in reqs)


@pytest.mark.parametrize(
    "order, expected", [("fcfs", ["0", "1", "2"]), ("sjf", ["1", "2", "0"]), ("ljf", ["0", "2", "1"])]
)
def test_orders_within_a_scheduling_batch(order, expected):
    sched = PrefillBatchScheduler(chunk=64, batch=16, order=order)
    for r in requests(900, 100, 500):
        sched.add(r)
    finished = []
    while (plan := sched.schedule(0.0)) is not None:
        tokens = {i.request_id: (0,) for i in plan.items if sched.yields_token(i)}
        finished += [r.id for r in sched.apply(plan, Outcome(1.0, (), tokens))]
    assert finished == expected


def test_a_started_prompt_is_not_preempted_by_a_shorter_arrival():
    sched = PrefillBatchScheduler(chunk=512, batch=16, order="sjf")
    long, short = requests(1500, 20)
    sched.add(long)
    assert step(sched) == ([("0", 0, 512)], [])
    sched.add(short)  # shorter, but the long prompt's batch is in progress: it runs to its end first
    assert step(sched) == ([("0", 512, 1024)], [])
    assert step(sched) == ([("0", 1024, 1500)], ["0"])
    assert step(sched) == ([("1", 0, 20)], ["1"])


def test_one_chunk_in_flight_at_a_time():
    sched = PrefillBatchScheduler(chunk=512)
    sched.add(requests(2000)[0])
    assert sched.schedule(0.0) is not None
    assert sched.schedule(0.0) is None
    assert sched.queued_tokens() == 2000


def test_a_chunk_costs_its_pieces_with_their_history_plus_padding_as_tokens():
    cost = TetrisBatchCost(cm.TetrisPrefill.fit(tetris_table1_samples()))
    items = [
        WorkItem(request_id="a", start=212, end=300, phase=Phase.PREFILL, group=(0,), history=212),
        WorkItem(request_id="b", start=0, end=100, phase=Phase.PREFILL, group=(0,)),
    ]
    # padding runs through the linear ops (512 tokens) but attends to nothing
    expected = cost.overhead + cost.linear_ops(512) + cost.prefill_attention(88, 212) + cost.prefill_attention(100, 0)
    assert chunk_time(cost, items, 512) == pytest.approx(expected)
    assert chunk_time(cost, items, 512) > cost.batch_time([(88, 212), (100, 0)])


def test_rejects_bad_settings_and_duplicates():
    with pytest.raises(ValueError, match="order must be"):
        PrefillBatchScheduler(order="edf")
    with pytest.raises(ValueError, match="must be >= 1"):
        PrefillBatchScheduler(chunk=0)
    sched = PrefillBatchScheduler()
    r = requests(10)[0]
    sched.add(r)
    with pytest.raises(ValueError, match="already queued"):
        sched.add(r)


def test_arrivals_join_the_least_loaded_instance_and_a_removed_request_is_never_planned():
    a, b = PrefillBatchScheduler(chunk=512, group=(0,)), PrefillBatchScheduler(chunk=512, group=(1,))
    for r in requests(1300, 300, 40, 700):
        [a, b][least_queued([a, b])].add(r)
    assert (list(a.requests), list(b.requests)) == (["0"], ["1", "2", "3"])  # ties: the lowest index
    plan = b.schedule(0.0)
    assert [i.request_id for i in plan.items] == ["2", "1", "3"]  # shortest first
    b.remove("1")  # aborted while its chunk runs: the chunk's Outcome still applies to the others
    done = b.apply(plan, Outcome(1.0, (), {"2": (0,)}))
    assert [r.id for r in done] == ["2"] and set(b.requests) == {"3"}
    b.remove("3")
    assert b.schedule(1.0) is None and b.queued_tokens() == 0


def test_a_cancelled_chunk_is_planned_again():
    sched = PrefillBatchScheduler(chunk=512)
    for r in requests(300, 400):
        sched.add(r)
    plan = sched.schedule(0.0)
    sched.cancel(plan)  # the executor could not run it
    again = sched.schedule(0.0)
    pieces = lambda p: [(i.request_id, i.start, i.end) for i in p.items]  # noqa: E731
    assert pieces(again) == pieces(plan)
