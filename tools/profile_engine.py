"""Profile the real jaxserve engine on this machine and fit the scheduler's cost models from the samples.

    .venv/bin/python tools/profile_engine.py [--repeats=3] [--full] [--out_dir=profiles/engine]

Single device, SP=1, TP=1, the default model. Every sample times one call of the engine's own step path,
`StepRunner.step` (host-side packing into the bucketed arrays, the jitted forward + sampling with donated KV
buffers, the sampled tokens back on the host), after a warm-up call that compiles the shape; the median of
--repeats calls is kept. What a sample covers:

- prefill (n, h): one chunk of n tokens of a sequence whose first h tokens are already in the KV cache;
- decode (batch, kv): one decode step of `batch` sequences, each attending over kv cached tokens (its new token
  included), so sum_kv = batch * kv.

The KV state is real: one sequence of fixed token ids is prefilled through the runner, and every timed call
rewrites positions with the ids they already hold, so the cache stays consistent across repeats. The other
decode rows get their own blocks (the memory traffic of a real batch) holding copies of that sequence's blocks:
what prefilling identical sequences would write, without paying for batch x kv prefill tokens.

Writes samples.csv, tetris_prefill.json (TetrisPrefill.fit) and decode.json (Decode.fit) to --out_dir and prints
fitted vs measured times.
"""

from __future__ import annotations

import csv
import dataclasses
import pathlib
import statistics
import time
from typing import Sequence

import jax
import numpy as np
from absl import app, flags, logging
from tqdm.auto import tqdm

import jaxserve
from jaxserve.engine.sampling import SamplingParams
from jaxserve.engine.steps import Row, StepRunner
from jaxserve.sched.cost_models import Decode, TetrisPrefill

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "profiles/engine", "Directory for samples.csv and the fitted models.")
flags.DEFINE_integer("repeats", 5, "Timed calls per grid point; the median is kept.")
flags.DEFINE_bool("full", False, "Profile the larger grid (longer chunks and histories, bigger batches).")

# (chunk tokens n, history tokens h) and (batch, kv tokens per sequence).
QUICK_PREFILL = [(n, h) for n in (16, 64, 256, 512) for h in (0, 256, 1024)]
QUICK_DECODE = [(b, kv) for b in (1, 4, 16) for kv in (128, 512, 1024)]
FULL_PREFILL = [(n, h) for n in (16, 32, 64, 128, 256, 512, 1024, 2048) for h in (0, 256, 1024, 2048, 4096)]
FULL_DECODE = [(b, kv) for b in (1, 2, 4, 8, 16, 32) for kv in (128, 512, 1024, 2048, 4096)]

SP, TP = 1, 1  # one device: the engine serves on one device today
BLOCK_SIZE = 16  # the engine's default KV block


@dataclasses.dataclass(frozen=True)
class Sample:
    kind: str  # "prefill" or "decode"; the other kind's columns are 0
    sp: int
    tp: int
    n: int
    h: int
    batch: int
    sum_kv: int
    seconds: float


COLUMNS = [f.name for f in dataclasses.fields(Sample)]


def _timed(runner: StepRunner, rows: Sequence[Row], repeats: int) -> float:
    """Median seconds of one engine step over `rows`; the first call compiles (or loads) the shape."""
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        runner.step(rows)  # returns host tokens, so it has waited for the forward
        jax.block_until_ready(runner.caches)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _copy_blocks(runner: StepRunner, src: Sequence[int], dst: Sequence[int]) -> None:
    """Give the blocks `dst` the K/V held in the blocks `src` (same length), in every layer, in one pass."""
    offsets = np.arange(runner.block_size)
    s = (np.asarray(src)[:, None] * runner.block_size + offsets).ravel()
    d = (np.asarray(dst)[:, None] * runner.block_size + offsets).ravel()
    runner.caches = [(k.at[d].set(k[s]), v.at[d].set(v[s])) for k, v in runner.caches]


def _longest(prefill_grid: Sequence[tuple[int, int]], decode_grid: Sequence[tuple[int, int]]) -> int:
    return max([n + h for n, h in prefill_grid] + [kv for _, kv in decode_grid])


def profile(llm: jaxserve.LLM, prefill_grid: Sequence[tuple[int, int]], decode_grid: Sequence[tuple[int, int]],
            repeats: int) -> list[Sample]:
    """Time every (n, h) prefill chunk and every (batch, kv) decode step on llm's engine; the blocks it takes
    from the engine's pool are returned at the end. Points longer than llm.max_model_len are skipped."""
    limit = llm.max_model_len
    prefill_grid = [(n, h) for n, h in prefill_grid if n + h <= limit]
    decode_grid = [(b, kv) for b, kv in decode_grid if kv <= limit]
    if not prefill_grid and not decode_grid:
        raise ValueError(f"no grid point fits max_model_len {limit}")
    runner, pool = llm.engine.runner, llm.engine.pool
    greedy = SamplingParams()
    longest = _longest(prefill_grid, decode_grid)
    history = max([h for _, h in prefill_grid] + [kv - 1 for _, kv in decode_grid])
    # Fixed ordinary token ids (above the special tokens), so rewriting a position rewrites the same K/V.
    ids = np.random.default_rng(0).integers(100, llm.config.vocab_size, size=longest).tolist()
    tables: list[list[int]] = [[]]
    samples: list[Sample] = []
    try:
        pool.grow(tables[0], longest)
        for start in range(0, history, llm.engine.prefill_chunk):
            chunk = ids[start: min(history, start + llm.engine.prefill_chunk)]
            runner.step([Row(chunk, start, tables[0], greedy, 0, 0)])
        max_batch = max((b for b, _ in decode_grid), default=1)
        used = pool.blocks_for(max((kv for _, kv in decode_grid), default=0))
        for _ in range(max_batch - 1):
            tables.append([])
            pool.grow(tables[-1], used * pool.block_size)
        if max_batch > 1:
            _copy_blocks(runner, tables[0][:used] * (max_batch - 1), [blk for t in tables[1:] for blk in t])
        with tqdm(total=len(prefill_grid) + len(decode_grid), desc="profile") as bar:
            for n, h in prefill_grid:
                t = _timed(runner, [Row(ids[h: h + n], h, tables[0], greedy, 0, 0)], repeats)
                samples.append(Sample("prefill", SP, TP, n, h, 0, 0, t))
                bar.update()
            for b, kv in decode_grid:
                rows = [Row([ids[kv - 1]], kv - 1, table, greedy, 0, 0) for table in tables[:b]]
                t = _timed(runner, rows, repeats)
                samples.append(Sample("decode", SP, TP, 0, 0, b, b * kv, t))
                bar.update()
    finally:
        for table in tables:
            pool.release(table)
    return samples


def pool_tokens(prefill_grid: Sequence[tuple[int, int]], decode_grid: Sequence[tuple[int, int]],
                block_size: int) -> int:
    """KV tokens `profile` holds at once, in whole blocks: the profiled sequence plus the other decode rows."""
    def whole_blocks(tokens: int) -> int:
        return -(-tokens // block_size) * block_size

    b, kv = max((b for b, _ in decode_grid), default=1), max((kv for _, kv in decode_grid), default=0)
    return whole_blocks(_longest(prefill_grid, decode_grid)) + (b - 1) * whole_blocks(kv)


def fit(samples: Sequence[Sample]) -> tuple[TetrisPrefill, Decode]:
    prefill = TetrisPrefill.fit((s.sp, (s.n, s.h), s.seconds) for s in samples if s.kind == "prefill")
    decode = Decode.fit(((s.sp, s.tp), (s.batch, s.sum_kv), s.seconds) for s in samples if s.kind == "decode")
    return prefill, decode


def write(samples: Sequence[Sample], out_dir: str | pathlib.Path) -> tuple[TetrisPrefill, Decode]:
    """samples.csv, tetris_prefill.json and decode.json in out_dir; returns the fitted models."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "samples.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(COLUMNS)
        writer.writerows(dataclasses.astuple(s) for s in samples)
    prefill, decode = fit(samples)
    (out / "tetris_prefill.json").write_text(prefill.to_json())
    (out / "decode.json").write_text(decode.to_json())
    return prefill, decode


def report(samples: Sequence[Sample], prefill: TetrisPrefill, decode: Decode) -> None:
    print(f"{'kind':<8}{'n':>6}{'h':>6}{'batch':>6}{'sum_kv':>8}{'measured ms':>13}{'fitted ms':>11}{'rel err':>9}")
    worst: dict[str, float] = {}
    for s in samples:
        fitted = (prefill.predict(s.sp, s.n, s.h) if s.kind == "prefill"
                  else decode.predict(s.sp, s.tp, [s.sum_kv // s.batch] * s.batch))
        err = abs(fitted - s.seconds) / s.seconds
        worst[s.kind] = max(worst.get(s.kind, 0.0), err)
        print(f"{s.kind:<8}{s.n:>6}{s.h:>6}{s.batch:>6}{s.sum_kv:>8}{1e3 * s.seconds:>13.2f}{1e3 * fitted:>11.2f}"
              f"{err:>9.1%}")
    for kind, err in worst.items():
        print(f"max relative error, {kind}: {err:.1%}")


def main(argv: list[str]) -> None:
    del argv
    prefill_grid, decode_grid = (FULL_PREFILL, FULL_DECODE) if FLAGS.full else (QUICK_PREFILL, QUICK_DECODE)
    longest = _longest(prefill_grid, decode_grid)
    llm = jaxserve.LLM(max_model_len=longest, block_size=BLOCK_SIZE,
                       kv_cache_tokens=pool_tokens(prefill_grid, decode_grid, BLOCK_SIZE))
    if llm.max_model_len < longest:
        logging.warning("the model's context (%d tokens) cuts the grid", llm.max_model_len)
    device = jax.devices()[0]
    print(f"device: {device} ({device.device_kind}); jax {jax.__version__}")
    samples = profile(llm, prefill_grid, decode_grid, FLAGS.repeats)
    prefill, decode = write(samples, FLAGS.out_dir)
    report(samples, prefill, decode)
    print(f"wrote {FLAGS.out_dir}/samples.csv, tetris_prefill.json, decode.json")


if __name__ == "__main__":
    app.run(main)
