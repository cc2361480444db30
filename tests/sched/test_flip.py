"""TetriInfer's flip policy."""

from __future__ import annotations

from jaxserve.sched.flip import Flip, FlipController, FlipPolicy, decode_busy


def test_flip_toward_the_busy_role_only_from_an_idle_unit():
    policy = FlipPolicy(idle=0.1, busy=0.8)
    assert policy.choose([0.95, 0.9], [0.05, 0.5]) == (Flip.TO_PREFILL, 0)
    assert policy.choose([0.05, 0.5, 0.02], [0.9, 0.85]) == (Flip.TO_DECODE, 2)
    assert policy.choose([0.5, 0.5], [0.05, 0.5]) is None  # prefill not busy enough to take a decode instance
    assert policy.choose([0.95], [0.05, 0.01]) == (Flip.TO_PREFILL, 1)
    assert policy.choose([0.05], [0.9]) is None  # the last prefill unit stays
    assert policy.choose([None, 0.9], [0.9, None]) is None  # not watched for a whole window yet


def test_the_controller_flips_one_unit_at_a_time_once_it_has_drained():
    """Loads seen for a whole window start a flip; none starts while one drains; the drained unit's flip ends
    and its old role's window is dropped, so it is watched afresh if it comes back."""
    flips = FlipController(FlipPolicy(idle=0.1, busy=0.8, window=2.0))
    prefill, decode = {"p0": 0.9, "p1": 0.95}, {"d0": 0.02, "d1": 0.5}
    assert [flips.start(t, prefill, decode) for t in (0.0, 1.0)] == [None, None]  # not a whole window yet
    assert flips.start(2.0, prefill, decode) == (Flip.TO_PREFILL, "d0") and flips.leaving == "d0"
    decode.pop("d0")  # the executor sends it no new work
    assert flips.start(3.0, {"p0": 0.9, "p1": 0.95}, {"d1": 0.01}) is None  # one flip at a time
    assert flips.finish(lambda u: True, lambda u: False) == [] and flips.leaving == "d0"  # still draining
    assert flips.finish(lambda u: True, lambda u: u == "d0") == [(Flip.TO_PREFILL, "d0")] and flips.leaving is None
    assert ("decode", "d0") not in flips._windows  # its samples as a decode unit are gone


def test_decode_busy_is_the_fuller_of_memory_and_batch():
    assert decode_busy(30, 100, 2, 4) == 0.5
    assert decode_busy(90, 100, 1, 4) == 0.9
