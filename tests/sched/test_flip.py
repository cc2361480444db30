"""TetriInfer's flip policy."""

from __future__ import annotations

from jaxserve.sched.flip import FlipPolicy


def test_flip_toward_the_busy_role_only_from_an_idle_unit():
    policy = FlipPolicy(idle=0.1, busy=0.8)
    assert policy.choose([0.95, 0.9], [0.05, 0.5]) == ("to_prefill", 0)
    assert policy.choose([0.05, 0.5, 0.02], [0.9, 0.85]) == ("to_decode", 2)
    assert policy.choose([0.5, 0.5], [0.05, 0.5]) is None  # prefill not busy enough to take a decode instance
    assert policy.choose([0.95], [0.05, 0.01]) == ("to_prefill", 1)
    assert policy.choose([0.05], [0.9]) is None  # the last prefill unit stays
    assert policy.choose([None, 0.9], [0.9, None]) is None  # not watched for a whole window yet
