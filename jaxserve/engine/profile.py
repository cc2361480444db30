"""The scheduler's iteration-time model measured on this engine (sched.batch_cost.EngineStepCost): every timing is
one step (packing, the forward and the sampler, the tokens back on the host), so the packer
plans with what this device, model and dtype actually cost.

What is measured follows the step's structure: each program without attention (an all-padding step: no key
block is read), then the attention's cost per tile and per decode row and key block, from one prefill chunk and
one full decode program each at a short and a long context (at most LONG tokens: the cost per key block is what
is solved for, and a longer context only makes the profile slower). Measured before serving (the blocks it
writes are free, and hold no cached prefix), cached on disk per device kind, model, dtype and bucket set, or
loaded from an explicit file (--cost_profile).
"""

from __future__ import annotations

import json
import pathlib
import statistics
import time
from typing import Callable, TypeVar

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxserve import disk_cache
from jaxserve.engine import batch
from jaxserve.engine.batch import Row
from jaxserve.engine.runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from jaxserve.sched.batch_cost import EngineStepCost, tile_key_blocks
from jaxserve.sched.step_shapes import StepShapes

# steps are timed with the drawing sampler (a batch of greedy rows runs the cheaper argmax alone): priced so, a
# step of sampled rows stays within the budget
_DRAWN = SamplingParams(max_tokens=1, temperature=1.0)
VERSION = 11  # of the step and of how it is measured: a change to either must not load an older profile
LONG = 2048  # tokens of context at the long points


T = TypeVar("T")


class Interrupted(Exception):
    """A measurement stopped early (its `stop` said so); nothing of it is kept."""


def median_time(run: Callable[[], object], repeats: int, stop: Callable[[], bool] = lambda: False) -> float:
    """Median seconds of one call over `repeats` (a first call warms caches). stop: asked before each call;
    True raises Interrupted."""
    times = []
    for _ in range(1 + repeats):
        if stop():
            raise Interrupted
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def synthetic_row(n: int, history: int, first_block: int, block_size: int, num_blocks: int) -> Row:
    """n tokens after `history` cached ones, in consecutive blocks from first_block (wrapping past the last)."""
    count = -(-(history + n) // block_size)
    blocks = [1 + (b - 1) % (num_blocks - 1) for b in range(first_block, first_block + count)]
    return Row(np.ones(n, np.int32).tolist(), history, blocks, _DRAWN, 0, 0)


def measure(
    runner: ModelRunner,
    max_model_len: int,
    repeats: int = 3,
    progress: bool = True,
    stop: Callable[[], bool] = lambda: False,
) -> EngineStepCost:
    """stop: asked before each run of a step; True ends the measurement with Interrupted (a request waits)."""
    bs, nb, buckets, key_block = runner.block_size, runner.num_blocks, runner.buckets, runner.key_block
    shapes, decode_rows = buckets.shapes(), buckets.decode_rows
    longest = min(max_model_len, LONG)
    # a prefill chunk of whole tiles, short of the largest bucket so it can have a history (where one fits)
    n = max(t for t in buckets.tokens if t <= max(longest // 2, buckets.tokens[0]))
    history = max(min(longest - n, (nb - 1) * bs - n), 0)
    rows = decode_rows[-1]
    kv = max(min(longest, (nb - 1) // rows * bs), 1)  # per decode row, in blocks of its own
    per_row = -(-kv // bs)
    blocks = lambda span: -(-span // key_block)  # noqa: E731 - the attention's loop trip count
    with tqdm(
        total=len(shapes) + len(decode_rows) + 5, desc="profile the step", unit="step", disable=not progress
    ) as bar:

        def timed(run: Callable[[], object]) -> float:
            t = median_time(run, repeats, stop)
            bar.update()
            return t

        def step(rs: list[Row]) -> float:
            return timed(lambda: runner.execute(rs))

        def padding(shape: batch.Shape) -> float:
            arrays = batch.empty(buckets, shape, bs)
            arrays.temperature[:] = _DRAWN.temperature
            return timed(lambda: runner.execute_arrays(arrays))

        measured = {(t, r): padding(buckets.mixed(t, r)) for t, r in shapes}
        base = [[measured[buckets.fit(t, r)] for r in buckets.rows] for t in buckets.tokens]
        decode_base = [padding(buckets.decode(r)) for r in decode_rows]

        # the chunk's tiles, each over its own key blocks (the program's padding tiles read none)
        tiles = -(-n // buckets.tile)
        short_blocks, long_blocks = (tile_key_blocks(n, h, buckets.tile, key_block) for h in (0, history))
        short, long = step([synthetic_row(n, 0, 1, bs, nb)]), step([synthetic_row(n, history, 1, bs, nb)])
        prefill_base = measured[buckets.fit(n, 1)]
        tile_block = max(long - short, 0.0) / max(long_blocks - short_blocks, 1)
        tile_fixed = max((short - prefill_base - tile_block * short_blocks) / tiles, 0.0)

        # decode rows: all short, all long, one long beside short ones (the others then read padding blocks);
        # per row fixed + per block of its own context + per padding block, solved from the three
        kvs = ([1] * rows, [kv] * rows, [kv] + [1] * (rows - 1))
        times = [
            step([synthetic_row(1, k - 1, 1 + i * per_row, bs, nb) for i, k in enumerate(ks)]) - decode_base[-1]
            for ks in kvs
        ]
        own = [sum(ks) / key_block for ks in kvs]
        terms = np.array([[rows, o, rows * blocks(max(ks)) - o] for ks, o in zip(kvs, own)])
        decode_fixed, decode_block, decode_pad_block = np.maximum(np.linalg.lstsq(terms, times, rcond=None)[0], 0.0)
    return EngineStepCost(
        _shapes(buckets),
        key_block,
        base,
        decode_base,
        tile_fixed,
        tile_block,
        float(decode_fixed),
        float(decode_block),
        float(decode_pad_block),
    )


def unmeasured(runner: ModelRunner) -> EngineStepCost:
    """A cost model that prices every step at zero, for an engine started without measuring one: its steps are
    bounded by tokens alone (the packer's budget must then be unbounded)."""
    b = runner.buckets
    return EngineStepCost(
        _shapes(b),
        runner.key_block,
        [[0.0] * len(b.rows) for _ in b.tokens],
        [0.0] * len(b.decode_rows),
        0.0,
        0.0,
        0.0,
        0.0,
        0.0,
    )


def _shapes(b: batch.Buckets) -> StepShapes:
    return StepShapes(b.tokens, b.rows, b.tile, b.max_prefills, b.decode_rows)


def cache_file(model_name: str, dtype: str, shape: str, version: int) -> pathlib.Path:
    """Where a measured profile is cached: per device kind, model, dtype and what else the timings depend on."""
    from jaxserve.models import registry

    kind = jax.devices()[0].device_kind.replace(" ", "_").replace("/", "_")
    return registry.cache_dir() / "profiles" / f"{kind}-{pathlib.Path(model_name).stem}-{dtype}-{shape}-v{version}.json"


def default_path(model_name: str, dtype: str, runner: ModelRunner) -> pathlib.Path:
    b = runner.buckets
    shape = (
        f"t{b.tokens[-1]}-r{b.rows[-1]}-p{b.max_prefills}-w{b.width}-tile{b.tile}-bs{runner.block_size}"
        f"-kb{runner.key_block}"
        f"-tp{runner.tp}"
        + (f"-pp{runner.stages}" if runner.stages > 1 else "")
        + (f"-kvp{runner.kvp}" if runner.kvp > 1 else "")
    )
    return cache_file(model_name, dtype, shape, VERSION)


def load(path: pathlib.Path, runner: ModelRunner) -> EngineStepCost:
    """The profile in `path`, checked against the runner's step shapes."""
    cost = EngineStepCost.from_dict(json.loads(path.read_text()))
    b = runner.buckets
    if cost.shapes != _shapes(b) or cost.key_block != runner.key_block:
        raise ValueError(
            f"the cost profile {path} was measured for other step shapes ({cost.shapes}, key block "
            f"{cost.key_block}) than this engine's ({_shapes(b)}, key block {runner.key_block})"
        )
    return cost


def load_or_measure(
    path: pathlib.Path,
    runner: ModelRunner,
    max_model_len: int,
    progress: bool = True,
    stop: Callable[[], bool] = lambda: False,
) -> EngineStepCost:
    """The profile in `path`, measured (and written there) first if the file does not exist. stop: as measure's."""
    return cached(
        path,
        lambda: load(path, runner),
        lambda: measure(runner, max_model_len, progress=progress, stop=stop),
        lambda cost: json.dumps(cost.to_dict(), indent=1),
    )


def read_kept(path: pathlib.Path, read: Callable[[], T]) -> T | None:
    """A profile on disk by `read` (None: none there). One in the cache folder is a cache: a bad one is moved
    aside (None: measure again). A file of the user's own (--cost_profile, --prefill_profile) is read as it is:
    a bad one is refused."""
    from jaxserve.models import registry

    if registry.cache_dir().resolve() in path.resolve().parents:
        return disk_cache.read_file(path, read)
    if not path.exists():
        return None
    try:
        return read()
    except Exception as e:  # noqa: BLE001 - whatever the parser raises, said in one line naming the file
        if isinstance(e, ValueError) and str(path) in str(e):
            raise
        raise ValueError(f"{path}: not a usable profile ({type(e).__name__}: {e})") from e


def cached(path: pathlib.Path, read: Callable[[], T], take: Callable[[], T], dumps: Callable[[T], str]) -> T:
    """A measured profile kept on disk: read if `path` holds a good one (a bad one is moved aside), else taken
    (measured) and written there (where it can be)."""
    profile = read_kept(path, read)
    if profile is None:
        profile = take()
        disk_cache.write_text(path, dumps(profile))
    return profile
