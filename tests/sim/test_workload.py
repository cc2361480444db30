"""Workloads: packaged traces, seeded arrival processes and the long/short synthetic mix (fast, numpy only)."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import numpy as np
import pytest

from jaxserve.sim.workload import (
    TRACES,
    Workload,
    gamma_arrivals,
    load_trace,
    poisson_arrivals,
    read_trace_file,
    synthetic_mix,
)

# Data rows in the packaged CSVs (header excluded).
TRACE_ROWS = {"azure_conv": 19366, "azure_code": 8819, "arxiv": 28257}


@pytest.mark.parametrize("name", TRACES)
def test_trace_loads_every_row_with_positive_lengths_in_arrival_order(name):
    w = load_trace(name, rate=1.0 if name == "arxiv" else None)
    assert len(w) == TRACE_ROWS[name]
    assert w.name == name
    assert w.arrivals.dtype == np.float64 and w.prompt_lens.dtype == np.int64 and w.output_lens.dtype == np.int64
    assert (w.prompt_lens >= 1).all() and (w.output_lens >= 1).all()
    assert (np.diff(w.arrivals) >= 0).all()


def test_azure_arrivals_are_relative_to_the_first_with_microsecond_precision():
    w = load_trace("azure_conv")
    # 18:15:46.6805900 -> 18:15:50.9951690
    assert w.arrivals[0] == 0.0
    assert w.arrivals[1] == pytest.approx(4.314579, abs=1e-9)
    assert (w.prompt_lens[0], w.output_lens[0]) == (374, 44)


@pytest.mark.parametrize("name", ["azure_conv", "azure_code"])
@pytest.mark.parametrize("rate", [0.5, 7.5, 100.0])
def test_rate_rescaling_hits_the_mean_rate_and_keeps_burstiness(name, rate):
    raw = load_trace(name)
    w = load_trace(name, rate=rate)
    assert w.rate == pytest.approx(rate, rel=1e-9)
    # One time factor for all gaps: the trace's shape is kept.
    factor = w.arrivals[-1] / raw.arrivals[-1]
    np.testing.assert_allclose(w.arrivals, raw.arrivals * factor, rtol=1e-12)
    np.testing.assert_array_equal(w.prompt_lens, raw.prompt_lens)


def test_arxiv_needs_a_rate_and_gets_seeded_poisson_arrivals():
    with pytest.raises(ValueError, match="no timestamps.*rate"):
        load_trace("arxiv")
    a, b, c = (load_trace("arxiv", rate=4.0, seed=s) for s in (1, 1, 2))
    np.testing.assert_array_equal(a.arrivals, b.arrivals)
    assert not np.array_equal(a.arrivals, c.arrivals)
    # Lengths are in file order, independent of the seed.
    np.testing.assert_array_equal(a.prompt_lens, c.prompt_lens)
    assert a.prompt_lens[0] == 3772 and a.output_lens[0] == 54
    assert np.mean(np.diff(a.arrivals)) == pytest.approx(1 / 4.0, rel=0.05)


def test_max_len_filters_before_limit():
    raw = load_trace("azure_code")
    w = load_trace("azure_code", max_len=2048, limit=100)
    fits = np.flatnonzero(raw.prompt_lens + raw.output_lens <= 2048)[:100]
    assert len(w) == 100
    assert (w.prompt_lens + w.output_lens <= 2048).all()
    np.testing.assert_array_equal(w.prompt_lens, raw.prompt_lens[fits])
    np.testing.assert_array_equal(w.arrivals, raw.arrivals[fits])
    assert len(load_trace("arxiv", rate=2.0, limit=10)) == 10
    assert load_trace("azure_conv", limit=500, rate=3.0).rate == pytest.approx(3.0, rel=1e-9)


def test_trace_errors_name_the_problem():
    with pytest.raises(ValueError, match="azure_conv, azure_code, arxiv"):
        load_trace("sharegpt")
    with pytest.raises(ValueError, match="rate"):
        load_trace("azure_conv", rate=0.0)
    with pytest.raises(ValueError, match="limit"):
        load_trace("azure_conv", limit=0)
    with pytest.raises(ValueError, match="max_len"):
        load_trace("azure_conv", max_len=1)


def test_loaded_workloads_do_not_share_the_cached_arrays():
    w = load_trace("azure_conv")
    w.prompt_lens[0] = 99
    w.arrivals[1] = 0.0
    again = load_trace("azure_conv")
    assert again.prompt_lens[0] == 374 and again.arrivals[1] > 4


@pytest.mark.parametrize("rate", [0.5, 20.0])
def test_poisson_mean_gap(rate):
    arrivals = poisson_arrivals(20000, rate, np.random.default_rng(0))
    assert arrivals[0] > 0 and (np.diff(arrivals) > 0).all()
    assert np.mean(np.diff(arrivals, prepend=0.0)) == pytest.approx(1 / rate, rel=0.05)


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_gamma_mean_gap_and_cv(cv):
    gaps = np.diff(gamma_arrivals(20000, 5.0, cv, np.random.default_rng(0)), prepend=0.0)
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.10)


def test_arrivals_are_deterministic_per_seed():
    def arrivals(seed):
        return gamma_arrivals(1000, 2.0, 2.0, np.random.default_rng(seed))

    np.testing.assert_array_equal(arrivals(3), arrivals(3))
    assert not np.array_equal(arrivals(3), arrivals(4))


def test_synthetic_mix_long_fraction_and_ranges():
    w = synthetic_mix(20000, rate=10.0, long_fraction=0.05, seed=0)
    assert w.name == "mix0.05-azure_conv"
    assert len(w) == 20000
    conv = load_trace("azure_conv")
    is_long = w.prompt_lens >= 131072  # the conv trace's prompts are far shorter
    assert conv.prompt_lens.max() < 131072
    assert abs(is_long.mean() - 0.05) < 0.01
    assert (w.prompt_lens[is_long] <= 1048576).all()
    assert ((w.output_lens[is_long] >= 128) & (w.output_lens[is_long] <= 1024)).all()
    # Log-uniform: about as many long prompts below the geometric mean (362K) of the range as above it.
    assert abs(np.mean(w.prompt_lens[is_long] < math.sqrt(131072 * 1048576)) - 0.5) < 0.1
    # Short requests are (prompt, output) pairs of the trace.
    pairs = set(zip(conv.prompt_lens.tolist(), conv.output_lens.tolist()))
    assert set(zip(w.prompt_lens[~is_long].tolist(), w.output_lens[~is_long].tolist())) <= pairs
    assert np.mean(np.diff(w.arrivals, prepend=0.0)) == pytest.approx(0.1, rel=0.05)


def test_synthetic_mix_is_deterministic_per_seed_and_supports_gamma():
    a, b, c = (synthetic_mix(2000, 4.0, seed=s, arrival="gamma", cv=3.0, short_trace="azure_code") for s in (7, 7, 8))
    for field in ("arrivals", "prompt_lens", "output_lens"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
        assert not np.array_equal(getattr(a, field), getattr(c, field))
    assert a.name.startswith("mix0.05-azure_code")
    assert not (synthetic_mix(2000, 4.0, long_fraction=0.0).prompt_lens >= 131072).any()
    assert (synthetic_mix(200, 4.0, long_fraction=1.0, long_range=(1000, 1000)).prompt_lens == 1000).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n=0), "n must be"),
        (dict(rate=0.0), "rate"),
        (dict(rate=-1.0), "rate"),
        (dict(long_fraction=1.5), "long_fraction"),
        (dict(long_fraction=-0.1), "long_fraction"),
        (dict(arrival="uniform"), "arrival"),
        (dict(arrival="gamma", cv=0.0), "cv"),
        (dict(long_range=(2000, 1000)), "long_range"),
        (dict(long_output=(0, 10)), "long_output"),
        (dict(short_trace="nope"), "azure_conv, azure_code, arxiv"),
    ],
)
def test_synthetic_mix_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        synthetic_mix(**(dict(n=100, rate=1.0) | kwargs))


def test_arrival_processes_reject_bad_arguments():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(10, 0.0, rng)
    with pytest.raises(ValueError, match="n must be"):
        poisson_arrivals(0, 1.0, rng)
    with pytest.raises(ValueError, match="cv"):
        gamma_arrivals(10, 1.0, -1.0, rng)


def test_scaled_head_and_rate():
    w = load_trace("azure_conv", limit=1000)
    half = w.scaled(0.5)
    np.testing.assert_array_equal(half.arrivals, w.arrivals * 0.5)
    assert half.rate == pytest.approx(2 * w.rate, rel=1e-12)
    np.testing.assert_array_equal(half.prompt_lens, w.prompt_lens)
    for bad in (0.0, -2.0):
        with pytest.raises(ValueError, match="factor"):
            w.scaled(bad)
    h = w.head(10)
    assert len(h) == 10 and h.name == w.name
    np.testing.assert_array_equal(h.arrivals, w.arrivals[:10])
    assert Workload(np.array([1.0, 1.0]), np.array([1, 2]), np.array([3, 4]), "t").rate == math.inf
    assert Workload(np.array([0.0, 2.0, 4.0]), np.array([1, 2, 3]), np.array([1, 1, 1]), "t").rate == 0.5


def test_workload_validates_its_arrays():
    with pytest.raises(ValueError, match="sorted"):
        Workload(np.array([2.0, 1.0]), np.array([1, 1]), np.array([1, 1]), "t")
    with pytest.raises(ValueError, match=">= 1"):
        Workload(np.array([0.0, 1.0]), np.array([0, 1]), np.array([1, 1]), "t")
    with pytest.raises(ValueError, match="one entry per request"):
        Workload(np.array([0.0, 1.0]), np.array([1]), np.array([1, 1]), "t")


def test_importing_the_workload_module_does_not_import_jax():
    code = "import sys, jaxserve.sim.workload; sys.exit('jax' in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "kind, lo, hi, mean_k",
    [("short", 4096, 97280, 23.6), ("medium", 8192, 145408, 32.8), ("long", 16384, 194560, 50.1)],
)
def test_long_context_traces_match_tetris_ranges_and_means(kind, lo, hi, mean_k):
    from jaxserve.sim.workload import long_context

    w = long_context(kind, 20000, 2.0, seed=0)
    assert w.prompt_lens.min() >= lo and w.prompt_lens.max() <= hi
    assert w.prompt_lens.mean() / 1024 == pytest.approx(mean_k, rel=0.05)
    assert np.array_equal(w.prompt_lens, long_context(kind, 20000, 2.0, seed=0).prompt_lens)
    with pytest.raises(ValueError, match="unknown long-context trace"):
        long_context("huge", 10, 1.0)


# ---- a user's trace file ----------------------------------------------------------------------------------------


def test_a_csv_trace_with_times_reads_in_arrival_order(tmp_path):
    f = tmp_path / "mine.csv"
    f.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2024-05-01 10:00:02.5,100,20\n2024-05-01 10:00:00,50,10\n2024-05-01 10:00:01,70,1\n"
    )
    w = read_trace_file(f)
    assert w.name == "mine"
    np.testing.assert_allclose(w.arrivals, [0.0, 1.0, 2.5])  # sorted, from the first
    assert w.prompt_lens.tolist() == [50, 70, 100] and w.output_lens.tolist() == [10, 1, 20]
    assert read_trace_file(f, rate=2.0).rate == pytest.approx(2.0)
    assert len(read_trace_file(f, limit=2)) == 2 and len(read_trace_file(f, max_len=100)) == 2


def test_lengths_written_as_floats_and_arrivals_first_named_late_are_read(tmp_path):
    f = tmp_path / "late.jsonl"
    f.write_text(
        '{"prompt_tokens": 12.0, "output_tokens": "3"}\n{"arrival": 2, "prompt_tokens": 4, "output_tokens": 5}\n'
    )
    with pytest.raises(ValueError, match="late.jsonl:1: an arrival must be"):  # the column exists: every row needs it
        read_trace_file(f)
    f.write_text('{"arrival": 1, "prompt_tokens": 12.0, "output_tokens": "3"}\n')
    assert read_trace_file(f).prompt_lens.tolist() == [12]


def test_a_jsonl_trace_with_seconds_or_no_arrivals(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text(
        '{"arrival": 0.5, "prompt_tokens": 12, "output_tokens": 3}\n\n'
        '{"arrival": 1.75, "prompt_tokens": 40, "output_tokens": 8, "user": "x"}\n'
    )
    w = read_trace_file(f)
    np.testing.assert_allclose(w.arrivals, [0.0, 1.25])
    assert w.prompt_lens.tolist() == [12, 40]
    g = tmp_path / "lengths.csv"
    g.write_text("input_tokens,output_tokens\n5,6\n7,8\n")
    with pytest.raises(ValueError, match="no timestamps: pass rate"):
        read_trace_file(g)
    assert len(read_trace_file(g, rate=3.0, seed=1)) == 2


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("a.csv", "arrival,prompt_tokens\n0,5\n", "a.csv:1: no column of output_tokens"),
        ("a.csv", "arrival,prompt_tokens,output_tokens\n0,5,6\n1,five,6\n", "a.csv:3: prompt_tokens must be a whole"),
        ("a.csv", "arrival,prompt_tokens,output_tokens\n0,5,0\n", "a.csv:2: output_tokens must be a whole"),
        ("a.csv", "arrival,prompt_tokens,output_tokens\n0,5,6\nsoon,5,6\n", "a.csv:3: an arrival must be"),
        ("a.csv", "arrival,prompt_tokens,output_tokens\n0,5,6,7\n", "a.csv:2: more fields than the header"),
        ("a.csv", "arrival,prompt_tokens,output_tokens\n", "no requests"),
        ("a.jsonl", '{"arrival": 0, "prompt_tokens": 5, "output_tokens": 6}\n{"arrival": 1,\n', "a.jsonl:2: not JSON"),
        ("a.jsonl", "[1, 2, 3]\n", "a.jsonl:1: a request must be a JSON object"),
        ("a.jsonl", '{"arrival": 0, "prompt_tokens": 2.5, "output_tokens": 6}\n', "a.jsonl:1: prompt_tokens"),
        (
            "a.jsonl",
            '{"arrival": 0, "prompt_tokens": 5, "output_tokens": 6}\n'
            '{"arrival": "2024-05-01T10:00:00", "prompt_tokens": 5, "output_tokens": 6}\n',
            "arrivals mix",
        ),
        (
            "a.csv",
            "arrival,prompt_tokens,output_tokens\n2024-05-01T10:00:00Z,5,6\n2024-05-01T10:00:01,5,6\n",
            "arrivals mix local and zoned",
        ),
        ("a.csv", "arrival,prompt_tokens,output_tokens\n0,5,6\nnan,5,6\n", "a.csv:3: an arrival must be"),
    ],
)
def test_a_bad_trace_file_is_refused_with_its_line(tmp_path, name, text, message):
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        read_trace_file(f)
