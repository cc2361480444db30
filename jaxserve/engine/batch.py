"""A step's rows packed into the flat ragged arrays the compiled step reads, padded to a program's shape.

Every row (a prefill chunk or one decode token of a request) lays its new tokens end to end on one token axis.
The attention regroups them: a one-token row is a decode, any longer row is cut into tiles of `tile` tokens, each
tile from one request. Padding writes its K/V to the scratch block and is never attended. A step of decodes
alone runs in a decode program (one token per row, no tiles); any other in a mixed (tokens, rows) program. A
multi-step decode (a burst) packs its first step as a decode program's, with each row's share of the burst's
tokens (`limit`) and the stop tokens the device checks (`stop_ids`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import numpy as np
from jaxtyping import Float, Int, UInt

from jaxserve.engine.sampling import Sampling
from jaxserve.sampling_params import SamplingParams
from jaxserve.sched.kv_manager import SCRATCH_BLOCK
from jaxserve.sched.step_shapes import StepShapes, powers_of_two


class Shape(NamedTuple):
    """A step program's shape: tokens, rows, attention tiles (0 in a decode program)."""

    tokens: int
    rows: int
    tiles: int


class Row(NamedTuple):
    """One request's part of a step: `tokens` at positions start..start+len-1, cached in `block_table`."""

    tokens: Sequence[int]
    start: int
    block_table: Sequence[int]
    params: SamplingParams
    seed: int
    counter: int  # tokens the request has generated so far: the sampler's per-request step
    feed: int = -1  # a decode whose token is still in flight: its row in the previous step (tokens[0] unused)
    steps: int = 1  # in a burst: the most tokens this row may produce
    stop_ids: Sequence[int] = ()  # in a burst: tokens that end the row (the first STOP_SLOTS go to the device)
    slot: int = -1  # the request's sampling slot (sampling.Slots), where a kept token is counted; -1: none


class StepArrays(NamedTuple):
    token_ids: Int[np.ndarray, " t"]
    feed: Int[np.ndarray, " t"]  # the previous step's row whose sampled token this token is, or -1
    positions: Int[np.ndarray, " t"]
    slots: Int[np.ndarray, " t"]  # where each token's K/V is written
    tables: Int[np.ndarray, "r w"]
    decode_token: Int[np.ndarray, " r"]  # flat index of a decode row's token, t for other rows
    tile_tokens: Int[np.ndarray, "nt tq"]  # flat token indices per tile, t where padded
    tile_row: Int[np.ndarray, " nt"]
    logits_index: Int[np.ndarray, " r"]  # each row's last token
    temperature: Float[np.ndarray, " r"]
    top_k: Int[np.ndarray, " r"]
    top_p: Float[np.ndarray, " r"]
    seeds: UInt[np.ndarray, " r"]
    counters: Int[np.ndarray, " r"]
    limit: Int[np.ndarray, " r"]  # a burst's tokens per row (0: a padding row)
    stop_ids: Int[np.ndarray, "r s"]  # a burst's stop tokens per row, -1 where unused
    min_p: Float[np.ndarray, " r"]
    slot: Int[np.ndarray, " r"]
    presence: Float[np.ndarray, " r"]
    frequency: Float[np.ndarray, " r"]
    repetition: Float[np.ndarray, " r"]
    min_tokens: Int[np.ndarray, " r"]
    logprobs: Int[np.ndarray, " r"]  # top logprobs asked for, -1: none (read by the host alone)


STOP_SLOTS = 8  # stop tokens a burst's row checks on the device; the host checks them all (and stop strings)


@dataclasses.dataclass(frozen=True)
class Buckets(StepShapes):
    """The step's shapes (sched.step_shapes) and the block tables' width."""

    width: int  # block-table columns: max_model_len in blocks, rounded up to whole key blocks
    burst_steps: int = 1  # the most decode steps one multi-step decode runs (1: none)

    @classmethod
    def make(
        cls,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        key_block: int,
        tile: int = 32,
        min_tokens: int = 16,
        min_rows: int | None = None,
        max_prefills: int = 8,
        num_scheduler_steps: int = 1,
        min_decode_rows: int = 1,
    ) -> Buckets:
        """Decode programs for min_decode_rows, 2 min_decode_rows, ... rows up to max_num_seqs (at least one
        program); mixed programs for min_tokens, 2 min_tokens,
        ... tokens up to max_num_batched_tokens, and min_rows, 2 min_rows, ... rows (default: max_num_seqs alone).
        A mixed program's attention tiles grow with its rows (one partial tile per prefill chunk it may hold):
        the jnp attention runs every tile, padding too, while the GPU kernel skips padding tiles, where one row
        bucket means fewer programs to compile. num_scheduler_steps > 1: multi-step decodes of up to that many
        steps (a burst program per decode row bucket)."""
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens {max_num_batched_tokens} must be >= max_num_seqs "
                f"{max_num_seqs}: a step decodes every running request"
            )
        if key_block % block_size:
            raise ValueError(f"key_block {key_block} must be a multiple of block_size {block_size}")
        if max_prefills < 1:
            raise ValueError(f"max_prefills must be >= 1, got {max_prefills}")
        if not isinstance(num_scheduler_steps, int) or num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be an integer >= 1, got {num_scheduler_steps!r}")
        per_key_block = key_block // block_size
        blocks = -(-max_model_len // block_size)
        return cls(
            powers_of_two(min_tokens, max_num_batched_tokens),
            powers_of_two(min_rows or max_num_seqs, max_num_seqs),
            tile,
            min(max_prefills, max_num_seqs),
            powers_of_two(min_decode_rows, max_num_seqs),
            -(-blocks // per_key_block) * per_key_block,
            num_scheduler_steps,
        )

    def programs(self) -> list[Shape]:
        """Every program serving can run: the decode programs, then the mixed ones."""
        return [self.decode(r) for r in self.decode_rows] + [self.mixed(t, r) for t, r in self.shapes()]

    def decode(self, rows: int) -> Shape:
        return Shape(rows, rows, 0)

    def mixed(self, tokens: int, rows: int) -> Shape:
        return Shape(tokens, rows, self.tiles(tokens, rows))

    def fit_step(self, tokens: int, rows: int) -> Shape:
        """The program of a step of `rows` rows holding `tokens` tokens (a decode program when tokens == rows)."""
        return self.decode(self.fit_decode(rows)) if tokens == rows else self.mixed(*self.fit(tokens, rows))


def empty(buckets: Buckets, shape: Shape, block_size: int) -> StepArrays:
    """An all-padding step of `shape`: nothing attended, every write to the scratch block. The warm-up compiles
    with it; pack fills one in."""
    t, r, nt = shape
    return StepArrays(
        token_ids=np.zeros(t, np.int32),
        feed=np.full(t, -1, np.int32),
        positions=np.zeros(t, np.int32),
        slots=np.full(t, SCRATCH_BLOCK * block_size, np.int32),
        tables=np.full((r, buckets.width), SCRATCH_BLOCK, np.int32),
        decode_token=np.full(r, t, np.int32),
        tile_tokens=np.full((nt, buckets.tile), t, np.int32),
        tile_row=np.zeros(nt, np.int32),
        logits_index=np.zeros(r, np.int32),
        temperature=np.zeros(r, np.float32),
        top_k=np.zeros(r, np.int32),
        top_p=np.ones(r, np.float32),
        seeds=np.zeros(r, np.uint32),
        counters=np.zeros(r, np.int32),
        limit=np.zeros(r, np.int32),
        stop_ids=np.full((r, STOP_SLOTS), -1, np.int32),
        min_p=np.zeros(r, np.float32),
        slot=np.full(r, -1, np.int32),
        presence=np.zeros(r, np.float32),
        frequency=np.zeros(r, np.float32),
        repetition=np.ones(r, np.float32),
        min_tokens=np.zeros(r, np.int32),
        logprobs=np.full(r, -1, np.int32),
    )


class BadRow(ValueError):
    """One row cannot be packed (e.g. a parameter that does not fit its array's dtype): the step can run
    without it. `index`: the row's place in the step."""

    def __init__(self, index: int, cause: Exception):
        super().__init__(f"this request's step inputs cannot be packed: {type(cause).__name__}: {cause}")
        self.index = index


def pack(rows: Sequence[Row], buckets: Buckets, block_size: int) -> StepArrays:
    """The rows in one padded step; BadRow names the first row that cannot be written (the arrays are then
    discarded, and the caller may pack again without it)."""
    total = sum(len(r.tokens) for r in rows)
    prefills = sum(len(r.tokens) > 1 for r in rows)
    if prefills > buckets.max_prefills:
        raise ValueError(f"a step of {prefills} prefill chunks exceeds the {buckets.max_prefills} it has tiles for")
    a = empty(buckets, buckets.fit_step(total, len(rows)), block_size)
    at, tile = 0, 0
    for i, r in enumerate(rows):
        try:
            tile = _write_row(a, i, r, at, tile, buckets, block_size)
        except (ValueError, TypeError, OverflowError, IndexError) as e:
            raise BadRow(i, e) from e
        at += len(r.tokens)
    return a


def _write_row(a: StepArrays, i: int, r: Row, at: int, tile: int, buckets: Buckets, block_size: int) -> int:
    """Write row i, whose tokens start at flat index `at` and whose tiles at `tile`; returns the next tile."""
    n = len(r.tokens)
    tq = buckets.tile
    pos = np.arange(r.start, r.start + n)
    table = np.asarray(r.block_table, np.int32)
    a.token_ids[at : at + n] = r.tokens
    a.positions[at : at + n] = pos
    a.slots[at : at + n] = table[pos // block_size] * block_size + pos % block_size
    used = min(len(table), buckets.width)  # a table may hold blocks granted beyond this step
    a.tables[i, :used] = table[:used]
    if n == 1:
        a.decode_token[i] = at
        a.feed[at] = r.feed
    else:
        for lo in range(0, n, tq):
            hi = min(lo + tq, n)
            a.tile_tokens[tile, : hi - lo] = np.arange(at + lo, at + hi)
            a.tile_row[tile] = i
            tile += 1
    a.logits_index[i] = at + n - 1
    p = r.params
    a.temperature[i], a.top_k[i], a.top_p[i], a.min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
    a.seeds[i], a.counters[i] = r.seed, r.counter
    a.slot[i] = r.slot
    a.presence[i], a.frequency[i], a.repetition[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
    a.min_tokens[i] = p.min_tokens
    a.logprobs[i] = -1 if p.logprobs is None else p.logprobs
    a.limit[i] = r.steps
    stops = list(r.stop_ids)[:STOP_SLOTS]
    a.stop_ids[i, : len(stops)] = stops
    return tile


def to_blob(a: StepArrays) -> Int[np.ndarray, " n"]:
    """Every array of the step end to end in one int32 array (floats bit for bit): one transfer to the device."""
    return np.concatenate([np.ascontiguousarray(x).reshape(-1).view(np.int32) for x in a])


def from_blob(blob, shape: Shape, buckets: Buckets) -> StepArrays:
    """to_blob undone, for numpy or (inside the compiled step) jax arrays."""
    fields, at = [], 0
    for like in empty(buckets, shape, block_size=1):  # each field's dims and dtype
        fields.append(blob[at : at + like.size].reshape(like.shape).view(like.dtype))
        at += like.size
    return StepArrays(*fields)


def shape_of(a: StepArrays) -> Shape:
    return Shape(len(a.token_ids), len(a.tables), len(a.tile_tokens))


def sampling(a: StepArrays) -> Sampling:
    """The sampler's inputs."""
    return Sampling(
        a.temperature,
        a.top_k,
        a.top_p,
        a.seeds,
        a.counters,
        a.min_p,
        a.slot,
        a.presence,
        a.frequency,
        a.repetition,
        a.min_tokens,
    )


def sampler_kind(a: StepArrays) -> str:
    """Which sampler the rows need: "greedy" (every row: argmax alone), "cut" (a drawn row cuts by top-k or top-p:
    the costlier program that sorts the vocabulary) or "draw"."""
    drawn = a.temperature > 0
    if not drawn.any():
        return "greedy"
    return "cut" if bool(np.any(drawn & ((a.top_k > 0) | (a.top_p < 1.0)))) else "draw"


def extra(a: StepArrays) -> bool:
    """Whether a row needs the extra sampler: a slot (penalties, logit_bias, min_tokens) or logprobs."""
    return bool((a.slot >= 0).any() or (a.logprobs >= 0).any())


SAMPLER_KINDS = ("greedy", "draw", "cut")
