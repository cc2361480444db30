"""Tetris's load-aware improvement rate online: the table, the arrival-rate window and the adaptive planner."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.sched import cost_models as cm
from jaxserve.sched.cdsp import CDSPPlanner, Pool
from jaxserve.sched.improvement_rate import AdaptiveCDSP, ArrivalRate, RateTable, read_rate_table
from jaxserve.sched.profiles import tetris_table1_samples

MODEL = cm.TetrisPrefill.fit(tetris_table1_samples())
POOL = Pool(nodes=2, per_node=8)


def test_rate_table_picks_the_nearest_recorded_rate_and_round_trips():
    table = RateTable((0.5, 1.0, 2.0), (0.1, 0.3, 0.6))
    assert [table.lookup(x) for x in (0.0, 0.7, 0.76, 1.4, 1.6, 9.0)] == [0.1, 0.1, 0.3, 0.3, 0.6, 0.6]
    assert RateTable.from_json(table.to_json()) == table
    with pytest.raises(ValueError, match="ascending"):
        RateTable((2.0, 1.0), (0.1, 0.2))


def test_arrival_rate_counts_the_window():
    est = ArrivalRate(window=10.0)
    for t in np.arange(0, 40, 0.5):  # 2 req/s
        est.observe(float(t))
    assert est.rate(39.5) == pytest.approx(2.0, rel=0.06)
    fresh = ArrivalRate(window=10.0)
    for t in (0.0, 1.0, 2.0):
        fresh.observe(t)
    assert fresh.rate(2.0) == pytest.approx(1.0)  # only 2 s seen so far: 2 intervals of 1 s
    one = ArrivalRate(window=10.0)
    one.observe(3.0)
    assert one.rate(3.0) is None and one.rate(5.0) is None  # one arrival measures nothing
    burst = ArrivalRate(window=10.0)
    for _ in range(3):
        burst.observe(4.0)
    assert burst.rate(4.0) == float("inf") and RateTable((0.0, 1.0), (0.3, 0.05)).lookup(burst.rate(4.0)) == 0.05


def test_adaptive_planner_follows_the_load():
    planner = AdaptiveCDSP(CDSPPlanner(MODEL, POOL), RateTable((0.5, 4.0), (0.05, 0.7)), window=5.0, update_every=1.0)
    for t in np.arange(0, 10, 2.0):  # 0.5 req/s
        planner.on_arrival(float(t))
    assert planner.planner.improvement_rate == 0.05
    for t in np.arange(10, 20, 0.25):  # 4 req/s
        planner.on_arrival(float(t))
    assert planner.planner.improvement_rate == 0.7


def test_adaptive_planner_reads_the_load_from_the_first_arrivals():
    # Tetris's setting: 30 s window and updates; a loaded start must not run 30 s at the light-load rate.
    planner = AdaptiveCDSP(CDSPPlanner(MODEL, POOL), RateTable((0.5, 4.0), (0.05, 0.7)))
    for t in np.arange(0, 3, 0.25):  # 4 req/s from the start
        planner.on_arrival(float(t))
    assert planner.planner.improvement_rate == 0.7
    for t in np.arange(3, 40, 2.0):  # then 0.5 req/s: followed once the 30 s window has seen it
        planner.on_arrival(float(t))
    assert planner.planner.improvement_rate == 0.05
    # two arrivals 0.1 s apart read as 10 req/s; the light load after them is followed before a window is seen
    planner = AdaptiveCDSP(CDSPPlanner(MODEL, POOL), RateTable((0.5, 4.0), (0.05, 0.7)))
    for t in [0.0, 0.1, *np.arange(2, 20, 2.0)]:
        planner.on_arrival(float(t))
    assert planner.planner.improvement_rate == 0.05


def test_a_table_file_that_is_not_one_is_refused_naming_it(tmp_path):
    good = tmp_path / "rates.json"
    good.write_text(RateTable((0.5, 2.0), (0.1, 0.4)).to_json())
    assert read_rate_table(good) == RateTable((0.5, 2.0), (0.1, 0.4))
    for text in (
        '{"arrival_rates": [1.0]',
        '{"arrival_rates": [1.0], "improvement_rates": [1.5]}',
        '{"arrival_rates": [-1.0], "improvement_rates": [0.1]}',
        '{"rates": []}',
    ):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ValueError, match="--improvement_rates=.*bad.json: not an improvement-rate table"):
            read_rate_table(bad)
    with pytest.raises(ValueError, match="missing.json"):
        read_rate_table(tmp_path / "missing.json")
