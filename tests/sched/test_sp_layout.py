"""CSPS's choice between SP-NTP and SP-TP from the bytes each moves per layer."""

from __future__ import annotations

import pytest

from jaxserve.sched import sp_layout
from jaxserve.sched.profiles import network


def test_bytes_follow_the_papers_formulas():
    d, n, length = 4096, 8, 100_000
    assert sp_layout.layer_bytes("sp_tp", length, d, n, True, dtype_bytes=1) == 2 * length * d * (n - 1)
    assert sp_layout.layer_bytes("sp_ntp", length, d, n, True, dtype_bytes=1) == pytest.approx(
        (4 * d * d + 4 * length * d / n) * (n - 1)
    )
    assert sp_layout.layer_bytes("sp_ntp", length, d, n, False, dtype_bytes=1) == pytest.approx(
        4 * length * d / n * (n - 1)
    )
    assert sp_layout.layer_bytes("sp_tp", length, d, 1, True) == 0


@pytest.mark.parametrize("d,n", [(4096, 4), (4096, 8), (16384, 3), (8192, 16)])
def test_sp_ntp_wins_past_the_crossover_length(d, n):
    crossover = 2 * d * n / (n - 2)  # L > 2 d N / (N - 2)
    assert sp_layout.choose(int(crossover * 0.9), d, n, tensor_parallel=True) == "sp_tp"
    assert sp_layout.choose(int(crossover * 1.1), d, n, tensor_parallel=True) == "sp_ntp"


def test_two_gpus_never_pick_sp_ntp_under_tp_and_without_tp_always_do():
    assert sp_layout.choose(10_000_000, 4096, 2, tensor_parallel=True) == "sp_tp"
    assert sp_layout.choose(1_000, 4096, 8, tensor_parallel=False) == "sp_ntp"


def test_the_chosen_layout_is_the_faster_one_on_the_link():
    link = network("h100")
    for length in (2_000, 20_000, 200_000):
        chosen = sp_layout.choose(length, 8192, 8, True)
        times = {x: sp_layout.layer_seconds(x, length, 8192, 8, True, link, "inter_node") for x in ("sp_ntp", "sp_tp")}
        assert times[chosen] == min(times.values())
