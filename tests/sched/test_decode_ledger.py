"""The decode side's ledger: what a dispatcher sees of a decode instance, and the receive-buffer handshake."""

from __future__ import annotations

import pytest

from jaxserve.sched.decode_dispatch import DecodeLoad
from jaxserve.sched.decode_ledger import DecodeLedger, Transfer


def test_a_promise_counts_prompt_and_decode_until_blocks_are_held_then_decode_until_it_decodes():
    ledger = DecodeLedger(2)
    ledger.expect("a", 300, 64, heavy=False)
    ledger.expect("b", 1000, 700, heavy=True)
    assert ledger.load(10_000, 3) == DecodeLoad(10_000 - 364 - 1700, 5, heavy=1, light=1)
    assert ledger.predicted("b") == 700
    ledger.hold("a")  # a's prompt now sits in the instance's own blocks, counted in its free slots
    assert ledger.load(9_700, 3) == DecodeLoad(9_700 - 64 - 1700, 4, heavy=1, light=1)
    ledger.admit("a")  # a runs there: counted by the instance itself
    assert ledger.load(9_700, 4) == DecodeLoad(9_700 - 1700, 5, heavy=1, light=1)
    ledger.forget("a")
    ledger.forget("b")
    assert ledger.load(10_000, 0) == DecodeLoad(10_000, 0, 0, 0)


def test_transfers_go_in_order_into_free_buffers_and_a_request_waits_for_all_its_chunks():
    ledger = DecodeLedger(2)
    ledger.expect("a", 300, 64, heavy=False)
    ledger.expect("b", 100, 64, heavy=False)
    chunks = [Transfer("a", 0, False, 200, 1.0), Transfer("a", 1, True, 100, 2.0), Transfer("b", 0, True, 100, 2.5)]
    for t in chunks:
        ledger.offer(t)
    assert ledger.send(3.0) == chunks[:2] and [t.sent for t in chunks] == [3.0, 3.0, None]
    assert ledger.send(3.5) == []  # both buffers held
    ledger.land(chunks[1], 4.0)  # the last chunk lands before the first
    assert not ledger.ready("a")
    assert ledger.send(4.0) == [chunks[2]]
    ledger.land(chunks[0], 5.0)
    assert ledger.ready("a") and not ledger.ready("b")
    ledger.land(chunks[2], 5.5)
    assert ledger.ready("b") and not ledger.held and not ledger.waiting


def test_forgetting_a_request_frees_its_buffers_and_returns_its_transfers():
    ledger = DecodeLedger(1)
    ledger.expect("a", 300, 64, heavy=False)
    ledger.expect("b", 100, 64, heavy=True)
    sent, waiting = Transfer("a", 0, True, 300, 1.0), Transfer("b", 0, True, 100, 1.0)
    ledger.offer(sent)
    ledger.offer(waiting)
    ledger.send(1.0)
    assert ledger.forget("a") == [sent]
    assert ledger.send(2.0) == [waiting]
    assert ledger.forget("b") == [waiting] and not ledger.heavy and not ledger.incoming


def test_bad_uses_are_refused():
    with pytest.raises(ValueError, match="at least one receive buffer"):
        DecodeLedger(0)
    ledger = DecodeLedger(1)
    ledger.expect("a", 1, 1, heavy=False)
    with pytest.raises(ValueError, match="already dispatched"):
        ledger.expect("a", 1, 1, heavy=False)


def test_the_flip_load_counts_requests_on_their_way_in_the_batch():
    ledger = DecodeLedger(1)
    assert ledger.busy(0, 1000, 0, 4) == 0.0
    ledger.expect("a", 300, 64, heavy=False)
    ledger.expect("b", 300, 64, heavy=False)
    assert ledger.busy(100, 1000, 1, 4) == 0.75  # 1 running and 2 on their way of 4; memory 0.1
    ledger.hold("a")
    assert ledger.busy(900, 1000, 1, 4) == 0.9  # memory the fuller


def test_held_transfers_land_in_order_once_their_request_holds_blocks():
    ledger = DecodeLedger(3)
    for rid in "abc":
        ledger.expect(rid, 100, 10, heavy=False)
        ledger.offer(Transfer(rid, 0, True, 100, 0.0))
    ledger.send(0.0)
    asked = []

    def reserve(rid):
        asked.append(rid)
        return rid != "b"  # b's blocks are not free yet

    landed = [t.request_id for t in ledger.landing(lambda t: t.request_id != "a", reserve)]  # a still on the link
    assert landed == [] and asked == ["b"]  # b refused: c waits behind it, a is skipped
    got = list(ledger.landing(lambda t: True, lambda rid: True))
    assert [t.request_id for t in got] == ["a", "b", "c"] and all(ledger.holds(r) for r in "abc")
