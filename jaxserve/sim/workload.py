"""Workloads for the simulator: when requests arrive and how long their prompts and outputs are.

Real traces keep their own burstiness (Azure LLM inference traces, 2023) or, where a trace has lengths only
(arXiv summarization), get Poisson arrivals. A user's own trace (CSV or JSON Lines) reads the same way
(`read_trace_file`). `synthetic_mix` adds the rare very long requests (128K-1M tokens)
that long-context serving is about to a short-request trace. Everything is seeded and pure numpy (no jax).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import functools
import importlib.resources
import io
import json
import math
import pathlib

import numpy as np

TRACES = ("azure_conv", "azure_code", "arxiv")

# name -> (file, arrival column or None, prompt column, output column)
_TRACE_FILES = {
    "azure_conv": ("azure_llm_2023_conv.csv", "TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "azure_code": ("azure_llm_2023_code.csv", "TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "arxiv": ("arxiv_summarization_lengths.csv", None, "num_prefill_tokens", "num_decode_tokens"),
}

ARRIVALS = ("poisson", "gamma")

# a trace file's columns, under the names common trace formats give them (Azure's, Vidur's, Splitwise's, ...)
ARRIVAL_COLUMNS = ("arrival", "arrival_time", "arrived_at", "timestamp")
PROMPT_COLUMNS = ("prompt_tokens", "prompt_len", "input_tokens", "input_length", "num_prefill_tokens", "contexttokens")
OUTPUT_COLUMNS = ("output_tokens", "output_len", "output_length", "num_decode_tokens", "generatedtokens")


@dataclasses.dataclass(frozen=True)
class Workload:
    """Requests in arrival order. Validated on construction so a simulator can trust the arrays blindly."""

    arrivals: np.ndarray  # float64 seconds, sorted ascending, first may be > 0
    prompt_lens: np.ndarray  # int64 >= 1
    output_lens: np.ndarray  # int64 >= 1
    name: str

    def __post_init__(self):
        n = len(self.arrivals)
        for field, dtype in (("arrivals", np.float64), ("prompt_lens", np.int64), ("output_lens", np.int64)):
            arr = np.asarray(getattr(self, field), dtype=dtype)
            if arr.ndim != 1 or len(arr) != n:
                raise ValueError(f"workload {self.name}: {field} must be 1-D with one entry per request")
            object.__setattr__(self, field, arr)
        if np.any(np.diff(self.arrivals) < 0) or not np.all(np.isfinite(self.arrivals)):
            raise ValueError(f"workload {self.name}: arrivals must be finite and sorted ascending")
        if np.any(self.prompt_lens < 1) or np.any(self.output_lens < 1):
            raise ValueError(f"workload {self.name}: prompt_lens and output_lens must be >= 1")

    def __len__(self) -> int:
        return len(self.arrivals)

    def scaled(self, factor: float) -> Workload:
        """Stretch (factor > 1) or compress (factor < 1) time: the same requests at 1/factor times the load."""
        if not factor > 0:
            raise ValueError(f"factor must be > 0, got {factor}")
        return dataclasses.replace(self, arrivals=self.arrivals * factor)

    @property
    def rate(self) -> float:
        """Mean requests per second between the first and last arrival; inf when they coincide (or n < 2)."""
        if len(self) < 2:
            return math.inf
        span = float(self.arrivals[-1] - self.arrivals[0])
        return (len(self) - 1) / span if span > 0 else math.inf

    def head(self, n: int) -> Workload:
        """The first n requests: a shorter run with the same arrival pattern."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return dataclasses.replace(
            self, arrivals=self.arrivals[:n], prompt_lens=self.prompt_lens[:n], output_lens=self.output_lens[:n]
        )


def _check_rate(rate: float) -> None:
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a finite number > 0 (requests per second), got {rate}")


def _check_n(n: int) -> None:
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")


def _check_trace(name: str) -> None:
    if name not in _TRACE_FILES:
        raise ValueError(f"unknown trace {name!r}; known traces: {', '.join(TRACES)}")


@functools.cache
def _read_trace(name: str) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """(arrival seconds relative to the first row or None, prompt lengths, output lengths), parsed once per
    process. Shared by every caller: index into them (a copy), never write to them."""
    file, time_col, prompt_col, output_col = _TRACE_FILES[name]
    text = importlib.resources.files("jaxserve.sim.traces").joinpath(file).read_text(encoding="utf-8")
    rows = csv.DictReader(io.StringIO(text, newline=""))
    times, prompts, outputs = [], [], []
    for row in rows:
        if time_col is not None:
            # fromisoformat keeps 6 of the trace's 7 fractional digits: microsecond precision.
            times.append(datetime.datetime.fromisoformat(row[time_col]))
        prompts.append(int(row[prompt_col]))
        outputs.append(int(row[output_col]))
    arrivals = None
    if time_col is not None:
        us = datetime.timedelta(microseconds=1)
        arrivals = np.array([(t - times[0]) // us for t in times], dtype=np.int64) / 1e6
    prompt_lens = np.maximum(np.array(prompts, dtype=np.int64), 1)
    output_lens = np.maximum(np.array(outputs, dtype=np.int64), 1)
    return arrivals, prompt_lens, output_lens


def load_trace(
    name: str, rate: float | None = None, seed: int = 0, limit: int | None = None, max_len: int | None = None
) -> Workload:
    """A packaged trace as a Workload.

    Azure traces keep their recorded arrival times (relative to the trace's first request); with `rate`, time is
    rescaled so the mean rate is `rate` while the burstiness stays. The arXiv trace has no timestamps: its
    lengths are taken in file order and arrivals are a Poisson process at `rate` (required) seeded by `seed`.
    `max_len` drops requests whose prompt + output exceed it (they could never fit a replica); `limit` then keeps
    the first `limit` requests. Rescaling to `rate` happens last, so the result's `.rate` is `rate` (a single
    request has no rate to rescale).
    """
    _check_trace(name)
    return _select(name, *_read_trace(name), rate=rate, seed=seed, limit=limit, max_len=max_len)


def _select(
    name: str,
    arrivals: np.ndarray | None,
    prompt_lens: np.ndarray,
    output_lens: np.ndarray,
    rate: float | None,
    seed: int,
    limit: int | None,
    max_len: int | None,
) -> Workload:
    """load_trace's choice of requests, arrivals and rate, over a trace's columns."""
    if rate is not None:
        _check_rate(rate)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    idx = np.arange(len(prompt_lens))
    if max_len is not None:
        idx = np.flatnonzero(prompt_lens + output_lens <= max_len)
        if len(idx) == 0:
            raise ValueError(f"max_len={max_len} drops every request of trace {name!r}")
    idx = idx[:limit]
    prompt_lens, output_lens = prompt_lens[idx], output_lens[idx]
    if arrivals is None:
        if rate is None:
            raise ValueError(f"trace {name!r} has no timestamps: pass rate= (requests per second) for its arrivals")
        return Workload(poisson_arrivals(len(idx), rate, np.random.default_rng(seed)), prompt_lens, output_lens, name)
    workload = Workload(arrivals[idx], prompt_lens, output_lens, name)
    if rate is not None and math.isfinite(workload.rate):
        workload = workload.scaled(workload.rate / rate)
    return workload


def read_trace_file(
    path: str | pathlib.Path,
    rate: float | None = None,
    seed: int = 0,
    limit: int | None = None,
    max_len: int | None = None,
) -> Workload:
    """A user's trace: CSV with a header row, or JSON Lines (one object a request; `.jsonl` or `.json`), each
    request's prompt and output tokens and, optionally, its arrival (seconds, or an ISO 8601 time). Columns go by
    the names in ARRIVAL_COLUMNS, PROMPT_COLUMNS and OUTPUT_COLUMNS (any case). Arrivals count from the first;
    rows out of order are sorted. Without arrivals, `rate` gives Poisson ones. rate, limit and max_len as in
    load_trace. A bad file is refused with one line naming the file, the line and what is wrong."""
    path = pathlib.Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"trace file {path}: cannot be read ({e})") from None
    jsonl = path.suffix in (".jsonl", ".json")
    rows = list(_json_rows(path, text) if jsonl else _csv_rows(path, text))
    if not rows:
        raise ValueError(f"trace file {path}: no requests")
    first_line, first = rows[0]
    first_line = first_line if jsonl else 1  # a CSV's columns are its header's
    columns = {k.lower(): k for _, row in rows for k in row}  # JSON Lines: any request's keys

    def column(names: tuple[str, ...], required: bool) -> str | None:
        found = next((columns[n] for n in names if n in columns), None)
        if found is None and required:
            raise ValueError(
                f"{path}:{first_line}: no column of {' / '.join(names)}; it has {', '.join(first) or 'none'}"
            )
        return found

    arrival, prompt, output = (
        column(ARRIVAL_COLUMNS, False),
        column(PROMPT_COLUMNS, True),
        column(OUTPUT_COLUMNS, True),
    )
    times, prompts, outputs = [], [], []
    for line, row in rows:
        prompts.append(_tokens(path, line, row, prompt))
        outputs.append(_tokens(path, line, row, output))
        if arrival is not None:
            times.append(_seconds(path, line, row.get(arrival)))
    arrivals = None
    if arrival is not None:
        kinds = {"seconds" if isinstance(t, float) else "zoned" if t.tzinfo else "local" for t in times}
        if len(kinds) > 1:  # no common origin
            raise ValueError(f"{path}: arrivals mix {' and '.join(sorted(kinds))} times")
        start = min(times)
        arrivals = np.array(
            [(t - start).total_seconds() if isinstance(t, datetime.datetime) else t - start for t in times], np.float64
        )
    prompt_lens, output_lens = np.array(prompts, np.int64), np.array(outputs, np.int64)
    if arrivals is not None:
        order = np.argsort(arrivals, kind="stable")
        arrivals, prompt_lens, output_lens = arrivals[order], prompt_lens[order], output_lens[order]
    return _select(path.stem, arrivals, prompt_lens, output_lens, rate=rate, seed=seed, limit=limit, max_len=max_len)


def _csv_rows(path: pathlib.Path, text: str):
    reader = csv.DictReader(io.StringIO(text, newline=""))
    for row in reader:
        if None in row:
            raise ValueError(f"{path}:{reader.line_num}: more fields than the header names")
        yield reader.line_num, row


def _json_rows(path: pathlib.Path, text: str):
    for line, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"{path}:{line}: not JSON ({e})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{line}: a request must be a JSON object")
        yield line, row


def _tokens(path: pathlib.Path, line: int, row: dict, column: str) -> int:
    value = row.get(column)
    try:
        n = int(float(value)) if not isinstance(value, bool) and float(value) == int(float(value)) else None
    except (TypeError, ValueError, OverflowError):
        n = None
    if n is None or n < 1:
        raise ValueError(f"{path}:{line}: {column} must be a whole number of tokens >= 1, got {value!r}")
    return n


def _seconds(path: pathlib.Path, line: int, value: object) -> float | datetime.datetime:
    """An arrival: seconds (a number) or a time (ISO 8601)."""
    if isinstance(value, str):
        try:
            seconds = float(value)
            if math.isfinite(seconds):
                return seconds
        except ValueError:
            try:
                return datetime.datetime.fromisoformat(value)
            except ValueError:
                pass
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if math.isfinite(value):
            return float(value)
    raise ValueError(f"{path}:{line}: an arrival must be seconds or an ISO 8601 time, got {value!r}")


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """n arrival times of a Poisson process at `rate` per second (exponential gaps; the first is one gap in)."""
    _check_n(n)
    _check_rate(rate)
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def gamma_arrivals(n: int, rate: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """n arrival times with gamma gaps of mean 1/rate and coefficient of variation `cv`: cv > 1 is burstier than
    Poisson (cv = 1), cv < 1 more regular. Shape k = 1/cv^2, scale = 1/(rate*k)."""
    _check_n(n)
    _check_rate(rate)
    if not (cv > 0 and math.isfinite(cv)):
        raise ValueError(f"cv must be a finite number > 0, got {cv}")
    k = 1.0 / cv**2
    return np.cumsum(rng.gamma(k, 1.0 / (rate * k), size=n))


def _check_range(arg: str, bounds: tuple[int, int]) -> None:
    lo, hi = bounds
    if not 1 <= lo <= hi:
        raise ValueError(f"{arg} must be (lo, hi) with 1 <= lo <= hi, got {bounds}")


def synthetic_mix(
    n: int,
    rate: float,
    long_fraction: float = 0.05,
    long_range: tuple[int, int] = (131072, 1048576),
    short_trace: str = "azure_conv",
    arrival: str = "poisson",
    cv: float = 1.0,
    seed: int = 0,
    long_output: tuple[int, int] = (128, 1024),
) -> Workload:
    """ShareGPT-like short requests plus a `long_fraction` of 128K-1M-token ones: the mix where one long prefill
    can block many short requests, which long-context schedulers must handle.

    Short requests' (prompt, output) pairs are sampled with replacement from `short_trace`; each request is long
    with probability `long_fraction`, with a log-uniform prompt length in `long_range` (so every scale is
    represented) and a uniform output length in `long_output`. Arrivals are Poisson or gamma (`cv`) at `rate`.
    One seeded generator drives everything, so a seed gives identical arrays.
    """
    _check_n(n)
    _check_rate(rate)
    if not 0 <= long_fraction <= 1:
        raise ValueError(f"long_fraction must be in [0, 1], got {long_fraction}")
    _check_range("long_range", long_range)
    _check_range("long_output", long_output)
    _check_trace(short_trace)
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {ARRIVALS}, got {arrival!r}")
    rng = np.random.default_rng(seed)
    _, short_prompts, short_outputs = _read_trace(short_trace)
    pick = rng.integers(0, len(short_prompts), size=n)
    is_long = rng.random(n) < long_fraction
    lo, hi = long_range
    long_prompts = np.rint(np.exp(rng.uniform(math.log(lo), math.log(hi), size=n))).astype(np.int64)
    long_outputs = rng.integers(long_output[0], long_output[1], size=n, endpoint=True)
    prompt_lens = np.where(is_long, long_prompts, short_prompts[pick])
    output_lens = np.where(is_long, long_outputs, short_outputs[pick])
    if arrival == "poisson":
        arrivals = poisson_arrivals(n, rate, rng)
        name = f"mix{long_fraction:g}-{short_trace}"
    else:
        arrivals = gamma_arrivals(n, rate, cv, rng)
        name = f"mix{long_fraction:g}-{short_trace}-gamma{cv:g}"
    return Workload(arrivals, prompt_lens, output_lens, name)


# Tetris 7.1's production traces are not public; their ranges and means (short 4K-95K, mean 23.6K; medium
# 8K-142K, 32.8K; long 16K-190K, 50.1K) are reproduced by log-normals (sigma 0.8) truncated to the range:
# name -> (min, max, mu of log tokens).
LONG_CONTEXT = {"short": (4096, 97280, 9.836), "medium": (8192, 145408, 10.089), "long": (16384, 194560, 10.45)}


def long_context(kind: str, n: int, rate: float, seed: int = 0, output: tuple[int, int] = (64, 512)) -> Workload:
    """Long-context prompts shaped like Tetris's Short / Medium / Long traces, Poisson arrivals at `rate`."""
    if kind not in LONG_CONTEXT:
        raise ValueError(f"unknown long-context trace {kind!r}; choose from {sorted(LONG_CONTEXT)}")
    _check_n(n)
    _check_rate(rate)
    lo, hi, mu = LONG_CONTEXT[kind]
    rng = np.random.default_rng(seed)
    prompts = np.empty(0, np.int64)
    while len(prompts) < n:  # rejection: keep the draws inside the range
        draw = np.rint(rng.lognormal(mu, 0.8, size=2 * n)).astype(np.int64)
        prompts = np.concatenate([prompts, draw[(draw >= lo) & (draw <= hi)]])
    outputs = rng.integers(output[0], output[1], size=n, endpoint=True)
    return Workload(poisson_arrivals(n, rate, rng), prompts[:n], outputs, f"longctx-{kind}")
