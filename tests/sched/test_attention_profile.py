"""Attention in the GPU-profile cost model: H100's measured table (jaxserve/sched/data/h100_attention.csv) against
its rows, monotone in the work, and the assumed utilisation where there is no table (A100) or for decode.

The row checks compare the curve with the very table it is built from, so they hold its stated fit error in place
(a regression check on the curve's construction), not validate it against other measurements."""

from __future__ import annotations

import csv
from importlib import resources

import pytest

from jaxserve.sched.profiles import GPUS, ProfileBatchCost, measured_attention

K = 1 << 10
# the fit's error against the measured rows (see MeasuredAttention), rounded up to the next 5%: from the knee up
# the scatter of head configs and shapes at equal FLOPs; below it the per-call floor's jitter
ABOVE_KNEE, FROM_2_41, BELOW_KNEE = 0.15, 0.05, 0.5


def _rows(kinds: tuple[str, ...]) -> list[dict[str, float]]:
    with resources.files("jaxserve.sched.data").joinpath("h100_attention.csv").open() as f:
        return [{k: float(v) for k, v in r.items() if k != "kind"} for r in csv.DictReader(f) if r["kind"] in kinds]


def test_the_h100_table_reproduces_every_prefill_and_history_row():
    m = measured_attention("h100_attention.csv")
    knee = m.kernel.xs[0]
    for r in _rows(("prefill", "history")):
        tol = FROM_2_41 if r["flops"] >= 2**41 else ABOVE_KNEE if r["flops"] >= 0.99 * knee else BELOW_KNEE
        assert m.floor + m(r["flops"]) == pytest.approx(r["seconds"], rel=tol), r


def test_the_floor_is_not_charged_and_the_knee_is_where_the_kernel_dominates():
    m = measured_attention("h100_attention.csv")
    assert 0.1e-3 < m.floor < 0.4e-3
    assert m(0) == 0 and m(2**30) < 0.01 * m.floor  # a short prompt's attention: microseconds, not a floor
    assert m.kernel.ys[0] >= 2 * m.floor
    assert 450e12 < m.kernel.xs[0] / m.kernel.ys[0] < 650e12  # the rate charged below the knee
    assert 550e12 < 2**45 / m(2**45) < 700e12  # the kernel's saturated rate


@pytest.mark.parametrize("profile,tp", [("h100_llama2_70b", 1), ("h100_llama2_70b", 8), ("h100_llama2_7b", 2)])
def test_h100_prefill_attention_is_the_measured_kernel_for_its_flops(profile, tp):
    """The measured kernel time for the chunk's FLOPs, or its KV reads at the assumed bandwidth where those take
    longer (a short multi-head prompt)."""
    cost, gpu = ProfileBatchCost(profile, tp=tp), GPUS["h100"]
    m, s = measured_attention("h100_attention.csv"), cost.shape
    per_pair, kv_bytes = 4 * s.head_dim * s.heads / tp, 4 * s.kv_heads * s.head_dim / tp
    for n, h in [(256, 0), (8 * K, 0), (64 * K, 0), (2 * K, 32 * K), (8 * K, 128 * K)]:
        flops = n * (h + (n + 1) / 2) * per_pair
        expected = cost.layers * max(m(flops), (h + n) * kv_bytes / (gpu.hbm_bandwidth * gpu.mbu))
        assert cost.prefill_attention(n, h) == pytest.approx(expected, rel=1e-12)
        if n >= 8 * K:
            assert expected == cost.layers * m(flops)


@pytest.mark.parametrize(
    "profile,tp,kvp",
    [("h100_llama2_70b", 8, 1), ("h100_llama2_70b", 8, 4), ("h100_llama2_7b", 1, 1), ("h100_llama2_7b", 2, 1)],
)
def test_more_tokens_never_take_less_time(profile, tp, kvp):
    cost = ProfileBatchCost(profile, tp=tp, kvp=kvp, kvp_tokens=256 * K if kvp > 1 else None)
    ns = sorted({1, 7, 64, 300, 1000} | {2**k for k in range(4, 21)} | {3 * 2**k for k in range(4, 19)})
    hs = [0, 1, 100, 4 * K, 100 * K, 255 * K, 256 * K, 300 * K, 1 << 20, 3 << 20, 10 << 20]
    for h in hs:
        times = [cost.prefill_attention(n, h) for n in ns]
        assert times == sorted(times), h
    for n in ns:
        times = [cost.prefill_attention(n, h) for h in hs]
        assert times == sorted(times), n
    decodes = [cost.decode_attention(kv) for kv in hs]
    assert decodes == sorted(decodes)


@pytest.mark.parametrize("tp", [1, 8])
def test_a100_attention_keeps_the_assumed_utilisation(tp):
    cost, gpu = ProfileBatchCost("a100_llama3_8b", tp=tp), GPUS["a100"]
    s = cost.shape
    per_pair, kv_bytes = 4 * s.head_dim * s.heads / tp, 4 * s.kv_heads * s.head_dim / tp
    flop_rate, byte_rate = gpu.peak_flops * gpu.mfu, gpu.hbm_bandwidth * gpu.mbu
    assert gpu.attention is None
    for n, h in [(1, 0), (512, 0), (8 * K, 0), (8 * K, 100 * K), (1, 1 << 20)]:
        expected = cost.layers * max(n * (h + (n + 1) / 2) * per_pair / flop_rate, (h + n) * kv_bytes / byte_rate)
        assert cost.prefill_attention(n, h) == pytest.approx(expected, rel=1e-12)
    for kv in (1, 4 * K, 1 << 20):
        expected = cost.layers * max(kv * per_pair / flop_rate, kv * kv_bytes / byte_rate)
        assert cost.decode_attention(kv) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("profile,tp", [("h100_llama2_70b", 8), ("h100_llama2_7b", 1)])
def test_h100_decode_reads_the_kv_at_the_assumed_bandwidth(profile, tp):
    cost, gpu = ProfileBatchCost(profile, tp=tp), GPUS["h100"]
    kv_bytes = 4 * cost.shape.kv_heads * cost.shape.head_dim / tp
    for kv in (1, 4 * K, 1 << 20):
        expected = cost.layers * kv * kv_bytes / (gpu.hbm_bandwidth * gpu.mbu)
        assert cost.decode_attention(kv) == pytest.approx(expected, rel=1e-12)


def test_the_best_measured_decode_agrees_with_the_assumed_bandwidth():
    """The decode rows are XLA's non-flash attention, mostly far below a decode kernel; their best is what a
    decode kernel reaches, and mbu assumes it."""
    best = max(r["kv_bytes"] / r["seconds"] for r in _rows(("decode",)))
    assert best == pytest.approx(GPUS["h100"].hbm_bandwidth * GPUS["h100"].mbu, rel=0.1)
