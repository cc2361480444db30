"""The scheduler's iteration-time model measured on this engine: every timing is one call of the compiled step
(ModelRunner.execute: packing, the forward with sampling, the tokens back on the host), so the packer plans
with what this device, model and dtype actually cost.

Measured before serving (the blocks it writes are free, and hold no cached prefix), cached on disk per device
kind, model, dtype and bucket set, or loaded from an explicit file (--cost_profile).
"""

from __future__ import annotations

import json
import pathlib
import statistics
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxserve.engine.batch import Row
from jaxserve.engine.runner import ModelRunner
from jaxserve.engine.sampling import SamplingParams
from jaxserve.sched.batch_cost import BucketedBatchCost

_GREEDY = SamplingParams(max_tokens=1)
VERSION = 2  # of the step and of how it is measured: a change to either must not load an older profile


def _time(runner: ModelRunner, rows: list[Row], repeats: int) -> float:
    """Median seconds of one step over rows (a first call warms caches)."""
    runner.execute(rows)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.execute(rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _row(n: int, history: int, first_block: int, block_size: int, num_blocks: int) -> Row:
    """n tokens after `history` cached ones, in consecutive blocks from first_block (wrapping past the last)."""
    count = -(-(history + n) // block_size)
    blocks = [1 + (b - 1) % (num_blocks - 1) for b in range(first_block, first_block + count)]
    return Row(np.ones(n, np.int32).tolist(), history, blocks, _GREEDY, 0, 0)


def measure(runner: ModelRunner, max_model_len: int, repeats: int = 3, progress: bool = True) -> BucketedBatchCost:
    bs, buckets = runner.block_size, runner.buckets
    blocks = runner.num_blocks - 1
    # the prefill slope from a chunk of whole query tiles (the attention's unit of work), as serving chunks are,
    # after as long a history as fits beside it
    chunk_bucket = next((b for b, t in enumerate(buckets.tokens) if buckets.tile <= t <= max_model_len // 2), 0)
    n = buckets.tokens[chunk_bucket]
    history = max(min(max_model_len - n, blocks * bs - n), 0)  # the longest history one row can have
    rows = buckets.rows[-1]
    kv = max(min(max_model_len, blocks // rows * bs), 2)  # per decode row, in blocks of its own where they suffice
    steps = len(buckets.tokens) + 3
    with tqdm(total=steps, desc="profile the step", unit="step", disable=not progress) as bar:
        def timed(rs: list[Row]) -> float:
            t = _time(runner, rs, repeats)
            bar.update()
            return t

        nb = runner.num_blocks
        step_times = [timed([_row(t, 0, 1, bs, nb)]) for t in buckets.tokens]
        flat, long = step_times[chunk_bucket], timed([_row(n, history, 1, bs, nb)])
        per_row = -(-kv // bs)
        short_kv = [_row(1, 0, 1 + i * per_row, bs, nb) for i in range(rows)]
        long_kv = [_row(1, kv - 1, 1 + i * per_row, bs, nb) for i in range(rows)]
        short, full = timed(short_kv), timed(long_kv)
    pair = max(long - flat, 0.0) / (n * history) if history else 0.0  # no history fits: attention never grows
    return BucketedBatchCost(buckets.tokens, step_times, prefill_pair=pair,
                             decode_key=max(full - short, 0.0) / (rows * (kv - 1)))


def default_path(model_name: str, dtype: str, runner: ModelRunner) -> pathlib.Path:
    from jaxserve.models import registry

    b = runner.buckets
    kind = jax.devices()[0].device_kind.replace(" ", "_").replace("/", "_")
    shape = f"t{b.tokens[-1]}-r{b.rows[-1]}-w{b.width}-bs{runner.block_size}"
    key = f"{kind}-{pathlib.Path(model_name).stem}-{dtype}-{shape}-v{VERSION}"
    return registry.cache_dir() / "profiles" / f"{key}.json"


def load_or_measure(path: pathlib.Path, runner: ModelRunner, max_model_len: int,
                    progress: bool = True) -> BucketedBatchCost:
    """The profile in `path`, measured (and written there) first if the file does not exist."""
    if path.exists():
        return BucketedBatchCost.from_dict(json.loads(path.read_text()))
    cost = measure(runner, max_model_len, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cost.to_dict(), indent=1))
    return cost
