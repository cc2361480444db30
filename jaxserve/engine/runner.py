"""The compiled step: one jitted forward runs any mix of prefill chunks and decodes (a flat ragged batch) and
writes their K/V into the paged cache; a small jitted sampler then draws one token per row on the device.

`dispatch` returns before the step runs, and its tokens are read later (`Pending.value`), so the caller can
dispatch the next step first: a decode whose token is still in flight names its row in the previous step
(`batch.Row.feed`), and the forward takes that token from the previous sampler's output on the device.

Forwards are keyed by their shape (batch.Shape: a decode program per row bucket, a mixed one per (tokens, rows)
bucket), samplers by their rows and kind (batch.sampler_kind: argmax alone when every row is greedy, a draw, or a
draw cut by top-k / top-p; the host picks), plain or extra (batch.extra: penalties, logit_bias and min_tokens from
per-request slots on the device, which the extra sampler updates, and logprobs). A multi-step decode (a burst: `steps`
decode steps in one device loop, each step's sampled tokens fed to the next) is one program with its sampler inside,
keyed by rows and the sampler's kind (Burst); its steps are a loop bound on the device, so any count up to the
configured most runs in the same program. `warmup` compiles every program a configuration uses before the first request
(in parallel threads: XLA compiles outside the GIL), and nothing compiles while serving; or a program compiles the first
time a step needs it (`generate` starts at once). Nothing in them branches on the device but a burst's loop, which ends
on a device value (on a GPU its predicate reaches the host once a step: a small sync, once per token, not per layer).

The layers run unrolled over per-layer weights (models/llama.py), so each GEMM reads its weights in place. A layer
scan's dynamic slice copies every layer's weights out of the stacked arrays first: on a GPU more than half of an 8B
decode step (tools/checks/gpu_compile.py --decode checks the compiled step); on a 2-core CPU a SmolLM2 decode step of 16
rows ran about twice as long, and one of a row longer too (docs/BENCHMARKS.md, "Generation vs Hugging Face
transformers"). The price is compile time, several times a scanned program's on that CPU. So on a CPU only the
decode programs (bound by reading the weights) are unrolled, and the mixed programs (bound by their chunk's compute)
scan over a second, stacked copy of the weights; on a GPU every program is unrolled and the weights are held once.
Weights kept quantized (models/quantize.py) scan in every program on a CPU: unrolled, XLA dequantizes all the
layers' weights at once.

The cache buffers are donated so XLA updates them in place; a step that fails inside the compiled call leaves
them deleted, and `recover` allocates fresh ones (their contents are gone: the caller recomputes whatever they
held).

On several devices the step runs under shard_map over an ('sp', 'tp') mesh: consecutive runs of `tp` devices
are tensor-parallel (sharding/tp.py: each holds a slice of every layer's heads, its KV heads' share of the
cache, and the step sums two projections over them), and the `len(devices) / tp` such sets form a KV-parallel
group (kv_cache.py: the cache's blocks spread over them). Its interface is the same as on one device.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import threading
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jaxtyping import Array, Float, Int
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from jaxserve import xla_flags
from jaxserve.engine import batch, grammar
from jaxserve.engine.kv_cache import RaggedPagedBackend, RaggedPagedMetadata, allocate_caches, cache_dtype
from jaxserve.engine.sampling import MAX_LOGPROBS, Logprobs, Sampling, Slots, sample_step
from jaxserve.models import quantize
from jaxserve.models.config import LlamaConfig
from jaxserve.models.llama import Llama, stage_layers, stage_params, unstack_layers
from jaxserve.pallas_kernels.common import lowering_for
from jaxserve.pallas_kernels.dispatch import Implementation
from jaxserve.sharding import processes, rows, tp as tensor_parallel
from jaxserve.sched.kv_manager import SCRATCH_BLOCK
from jaxserve.sharding.mesh import SP, TP, make_mesh


def forward(
    model: Llama, params: Any, caches: Any, a: batch.StepArrays, inputs: Int[Array, " m"] | Float[Array, "t e"]
) -> tuple[Float[Array, "r v"] | Float[Array, "t e"], Any]:
    """The model over the flat batch, writing its K/V into the caches: the logits of each row's last token.
    inputs: the last step's sampled tokens, which the tokens marked in `a.feed` are; on a pipeline stage after the
    first, the previous stage's hidden states (and a stage before the last returns its own)."""
    metadata = model.backend.local(RaggedPagedMetadata(a.slots, a.tables, a.decode_token, a.tile_tokens, a.tile_row))
    if model.layers is None or model.layers[0] == 0:
        inputs = jnp.where(a.feed >= 0, inputs[jnp.maximum(a.feed, 0)], a.token_ids)
    out, caches = model.apply(params, inputs[None], a.positions[None], caches, metadata, a.logits_index[None])
    return out[0], caches


def forward_packed(model: Llama, buckets: batch.Buckets, spread: Callable | None = None) -> Callable:
    """What the runner compiles for a step: (params, caches, blob, previous, shape) -> (logits, caches, the
    sampler's inputs). The step's arrays arrive as one blob (batch.to_blob: one transfer), and the sampler takes
    its inputs from here, already on the device. spread: wraps the per-device part for several devices (a
    shard_map); None on one."""

    def one(params, caches, arrays, previous):
        logits, caches = forward(model, params, caches, arrays, previous)
        return logits, caches, batch.sampling(arrays)

    run = spread(one) if spread is not None else one

    def step(params, caches, blob, previous, shape):
        return run(params, caches, batch.from_blob(blob, shape, buckets), previous)

    return step


def burst(
    model: Llama,
    params: Any,
    caches: Any,
    a: batch.StepArrays,
    previous: Int[Array, " m"],
    slots: Slots | None,
    *,
    size: int,
    kind: str,
    block_size: int,
) -> tuple[Any, Int[Array, "n r"], Int[Array, " r"], Slots | None, Logprobs | None]:
    """Decode steps of a decode program's rows in one loop on the device, each step sampling the token the next
    feeds, until every row is done: a row stops after `a.limit` tokens (at most `size`) or at one of its
    `a.stop_ids` (sampled, or fed to it), and from then on writes to the scratch block at its first position
    (its output is ignored). With `slots`: the extra sampler, counting only live rows' tokens.
    Returns the caches, every step's tokens ([size, r]: rows of steps not run are zeros), each row's last
    token (what a following step feeds), the slots, and every step's logprobs ([size, r, ...]; with slots)."""
    r = a.tables.shape[0]
    rows = jnp.arange(r)
    first = jnp.where(a.feed >= 0, previous[jnp.maximum(a.feed, 0)], a.token_ids)  # row i's token is token i
    no_feed = jnp.full_like(a.feed, -1)
    stops = lambda token: jnp.any(token[:, None] == a.stop_ids, axis=-1)  # noqa: E731
    logprobs = (
        None
        if slots is None
        else Logprobs(
            jnp.zeros((size, r)), jnp.zeros((size, r, MAX_LOGPROBS)), jnp.zeros((size, r, MAX_LOGPROBS), jnp.int32)
        )
    )

    def one(carry):
        j, caches, token, live, out, slots, logprobs = carry
        positions = jnp.where(live, a.positions + j, a.positions)
        slots_at = jnp.where(
            live,
            a.tables[rows, positions // block_size] * block_size + positions % block_size,
            SCRATCH_BLOCK * block_size,
        )
        step = a._replace(
            token_ids=token,
            feed=no_feed,
            positions=positions,
            slots=slots_at,
            counters=a.counters + j,
            slot=jnp.where(live, a.slot, -1),
        )
        logits, caches = forward(model, params, caches, step, previous)
        new, slots, lp = sample_step(logits, batch.sampling(step), slots, kind=kind)
        if lp is not None:
            logprobs = jax.tree.map(lambda all_, x: all_.at[j].set(x), logprobs, lp)
        token = jnp.where(live, new, token)
        live = live & (j + 1 < a.limit) & ~stops(new)
        return j + 1, caches, token, live, out.at[j].set(new), slots, logprobs

    # a row fed a stop token (one in flight when this burst was planned) belongs to a finished request
    start = (
        jnp.int32(0),
        caches,
        first,
        (a.limit > 0) & ~stops(first),
        jnp.zeros((size, r), jnp.int32),
        slots,
        logprobs,
    )
    _, caches, last, _, out, slots, logprobs = jax.lax.while_loop(lambda c: jnp.any(c[3]), one, start)
    return caches, out, last, slots, logprobs


def burst_packed(
    model: Llama, buckets: batch.Buckets, block_size: int, size: int, spread: Callable | None = None
) -> Callable:
    """What the runner compiles for a burst: (params, caches, blob, previous, slots, shape, kind) -> (caches,
    tokens [buckets.burst_steps, size], last tokens [size], slots, logprobs), rows padded with zeros to `size` as
    the samplers' are."""

    def one(params, caches, arrays, previous, slots, kind):
        return burst(
            model, params, caches, arrays, previous, slots, size=buckets.burst_steps, kind=kind, block_size=block_size
        )

    def step(params, caches, blob, previous, slots, shape, kind):
        run = functools.partial(one, kind=kind)
        if spread is not None:
            run = spread(run)
        caches, out, last, slots, logprobs = run(params, caches, batch.from_blob(blob, shape, buckets), previous, slots)
        pad = size - last.shape[0]
        return caches, jnp.pad(out, ((0, 0), (0, pad))), jnp.pad(last, (0, pad)), slots, logprobs

    return step


def sample_padded(
    logits: Float[Array, "r v"],
    sampling: Sampling,
    slots: Slots | None,
    mask: Int[Array, "r w"] | None,
    *,
    kind: str,
    size: int,
) -> tuple[Int[Array, " m"], Slots | None, Logprobs | None]:
    """`sample_step`, its tokens padded with zeros to `size` rows: every sampler's output can feed every
    forward."""
    tokens, slots, logprobs = sample_step(logits, sampling, slots, mask, kind=kind)
    return jnp.pad(tokens, (0, size - tokens.shape[0])), slots, logprobs


def set_slot(slots: Slots, slot: Int[Array, ""], row: Slots) -> Slots:
    """Slot `slot` of every array set to `row`'s (one slot's arrays, [1, v] each)."""
    return jax.tree.map(lambda all_, x: jax.lax.dynamic_update_slice_in_dim(all_, x, slot, axis=0), slots, row)


class Sampler(NamedTuple):
    """The sampler's program for `rows` rows, of a batch.SAMPLER_KINDS kind; `extra`: with penalties, logit_bias,
    min_tokens, logprobs (batch.extra) and the masks of structured output."""

    rows: int
    kind: str
    extra: bool = False


@dataclasses.dataclass(frozen=True)
class Burst:
    """A multi-step decode's program: up to Buckets.burst_steps decode steps of `rows` rows, its sampler of a
    batch.SAMPLER_KINDS kind. A dataclass, not a tuple: it must never equal a Sampler."""

    rows: int
    kind: str
    extra: bool = False


@dataclasses.dataclass(frozen=True)
class SlotWrite:
    """The program that sets one sampling slot (ModelRunner.set_slot)."""


Program = batch.Shape | Sampler | Burst | SlotWrite


class _Forward(NamedTuple):
    """A dispatched forward whose sampler waits for its masks (structured output)."""

    logits: jax.Array
    sampling: Sampling
    rows: int
    kind: str


class Pending(NamedTuple):
    """A dispatched step's sampled tokens (and logprobs, from the extra sampler), on their way to the host."""

    tokens: processes.Later | processes.Here
    logprobs: Logprobs | None = None  # of Later | Here

    def value(self) -> Int[np.ndarray, " m"]:
        """Every row's token (padding included, up to the runner's `max_rows`), waiting for the step."""
        return self.tokens.value()

    def logprobs_value(self) -> Logprobs | None:
        """The rows' logprobs as numpy arrays ([rows] and [rows, MAX_LOGPROBS]; a burst's with a leading step
        axis), or None when the step's sampler made none."""
        return None if self.logprobs is None else Logprobs(*(x.value() for x in self.logprobs))


FIRST_TOKENS = 128  # the chunks first_programs covers: a short prompt (a chat template's system prompt included)


def _with_samplers(shapes: list[batch.Shape], extra: tuple[bool, ...] = (False, True)) -> list[Program]:
    """The forwards, then the sampler of each kind for each of their row counts (plain, then extra)."""
    rows = sorted({s.rows for s in shapes})
    return [*shapes, *(Sampler(r, kind, x) for x in extra for kind in batch.SAMPLER_KINDS for r in rows)]


class _Loop(NamedTuple):
    """One way through the layers: its weights on the devices, its model, its jitted step."""

    params: Any
    model: Llama
    step: Any
    burst: Any  # the multi-step decode (used with unrolled layers)


@dataclasses.dataclass
class _Stage:
    """A pipeline stage (the whole model without stages): its devices, its layers, its ways through them and its
    part of the cache (its layers' K/V)."""

    devices: list[jax.Device]
    layers: tuple[int, int]
    mesh: jax.sharding.Mesh
    loops: dict[bool, _Loop]
    caches: Any = None

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @property
    def cache_sharding(self) -> NamedSharding:
        return cache_sharding(self.mesh)


def cache_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    """Where a cache on `mesh` lives: its slots split over the KV-parallel sets, its heads over tensor-parallel
    devices."""
    return NamedSharding(mesh, P(None, SP, TP))


class ModelRunner:
    def __init__(
        self,
        cfg: LlamaConfig,
        params: Any,
        dtype: jnp.dtype,
        *,
        num_blocks: int,
        block_size: int,
        buckets: batch.Buckets,
        key_block: int,
        devices: Sequence[jax.Device] | None = None,
        tp: int = 1,
        stages: int = 1,
        attention: Implementation | None = None,
        kv_cache_dtype: str = "auto",
        caches: Any = None,
        placed: bool = True,
        compiled: Mapping[Program, Any] | None = None,
    ):
        """devices: where the weights, the cache and the step run (default: JAX's first tp x stages devices),
        consecutive runs of tp devices tensor-parallel; several such runs form a KV-parallel group holding the
        num_blocks blocks between them. stages: pipeline stages, each an equal consecutive share of the devices
        running an even share of the layers (its hidden states moved on to the next stage's devices).
        attention: the attention's implementation (default: the Pallas kernel on GPU, the jnp reference
        elsewhere). kv_cache_dtype: CacheConfig's (kv_cache.cache_dtype). caches: (k, v) arrays to serve as the
        cache of a runner without pipeline stages, in its cache_sharding (default: zeroed ones). placed=False:
        the weights and the cache are shapes and shardings only (only the few int32s of `previous` are placed): a
        runner that only compiles (`compiled_programs`, e.g. a fail-over's engine prepared while another serves),
        never steps. compiled: such a runner's programs, taken as compiled (the same devices, settings and
        buckets)."""
        self.devices = list(devices or jax.devices()[: tp * stages])
        if len(self.devices) % (tp * stages):
            raise ValueError(
                f"{len(self.devices)} devices do not form {stages} pipeline stages of tensor-parallel sets of {tp}"
            )
        per_stage = len(self.devices) // stages
        self.device, self.tp, kvp = self.devices[0], tp, per_stage // tp
        self.share = cfg.split(tp)
        if num_blocks % kvp:
            raise ValueError(f"{num_blocks} KV blocks do not split over a KV-parallel group of {kvp} device sets")
        if stages > 1 and buckets.burst_steps > 1:
            raise ValueError(
                "multi-step decode runs on one pipeline stage: num_scheduler_steps must be 1 with pipeline stages"
            )
        self.cfg, self.dtype = cfg, dtype
        self.num_blocks, self.block_size, self.buckets, self.key_block = num_blocks, block_size, buckets, key_block
        backend = RaggedPagedBackend(block_size, key_block, kvp, attention, cfg.uniform_window)
        self.cpu = self.device.platform == "cpu"
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_dtype = cache_dtype(dtype, self.device.platform, kv_cache_dtype)
        # quantized weights scan on a CPU: unrolled, XLA dequantizes every layer's weights at once (a float copy of
        # all of them as working memory: docs/BENCHMARKS.md, "Weights kept quantized"); layers that differ
        # (Gemma 3) unroll everywhere
        self.unrolled = cfg.per_layer or not (self.cpu and stages == 1 and quantize.kept(params))
        self.placed = placed
        self.blocks = quantize.has_blocks(params)  # their programs compile with quantize.UNMERGED_DOTS off a CPU
        self.max_rows = max(s.rows for s in buckets.programs())
        self._stages = []
        for k, layers in enumerate(stage_layers(cfg.num_layers, stages)):
            devices = self.devices[k * per_stage : (k + 1) * per_stage]
            stage = _Stage(devices, layers, make_mesh(devices, tp), {})
            own = params if stages == 1 else stage_params(params, cfg, layers)
            stage.loops[self.unrolled] = self._loop(own, backend, stage, self.unrolled)
            stage.caches = self._allocate(stage) if caches is None else caches
            self._stages.append(stage)
        # on a CPU a mixed program is bound by its chunk's compute, beside which the scan's weight copies are small,
        # and it compiles in a fraction of the time: those scan over a second, stacked copy of the weights, placed
        # when a mixed program is first needed (a decode instance never needs one); a pipeline's stages unroll all
        self.scan_mixed = self.cpu and stages == 1 and self.unrolled and not cfg.per_layer
        self._stacked = (
            functools.partial(self._loop, params, backend, self._stages[0], False) if self.scan_mixed else None
        )
        self.params = self._stages[0].loops[self.unrolled].params  # the first stage's
        self._replicated = self._stages[-1].replicated  # where the sampler runs and its tokens are
        self._sample = jax.jit(
            sample_padded, static_argnames=("kind", "size"), donate_argnames=("slots",), out_shardings=self._replicated
        )
        self._set_slot = jax.jit(set_slot, donate_argnums=(0,), out_shardings=self._replicated)
        self._slots: Slots | None = None  # allocated when a request first needs one (set_slot)
        self._everything: dict[int, jax.Array] = {}  # masks allowing every token, by rows
        self._waiting: _Forward | None = None  # a guided step's forward (start), until sample_guided
        self._previous = self._no_tokens()
        self._unfed = self._no_tokens(self._stages[0].replicated)
        self._programs: dict[Program, tuple[jax.stages.Compiled, ...]] = dict(compiled or {})
        self._compiling: dict[Program, threading.Lock] = {}
        self._lock = threading.Lock()

    @property
    def stages(self) -> int:
        return len(self._stages)

    @property
    def kvp(self) -> int:
        """KV-parallel sets of tp devices in each stage."""
        return len(self._stages[0].devices) // self.tp

    @property
    def caches(self) -> Any:
        """The first stage's (k, v) cache arrays (the whole cache without pipeline stages)."""
        return self._stages[0].caches

    @caches.setter
    def caches(self, caches: Any) -> None:
        """Serve from other (k, v) arrays of the same shapes, in cache_sharding (a runner without pipeline stages:
        a multi-master group joining its instances' caches, cluster/multi_master.py)."""
        (stage,) = self._one_stage("other cache arrays")
        if any(
            new.shape != old.shape or new.sharding != stage.cache_sharding for new, old in zip(caches, stage.caches)
        ):
            raise ValueError(
                f"cache arrays of shapes {[c.shape for c in caches]} for a runner of "
                f"{[c.shape for c in stage.caches]} in {stage.cache_sharding}"
            )
        stage.caches = tuple(caches)

    @property
    def cache_sharding(self) -> NamedSharding:
        """Where the cache of a runner without pipeline stages lives."""
        return self._one_stage("one cache sharding")[0].cache_sharding

    @property
    def stage_caches(self) -> list[Any]:
        """Each pipeline stage's (k, v) cache arrays, in stage order: its layers' K/V."""
        return [stage.caches for stage in self._stages]

    def _loop(self, params: Any, backend: RaggedPagedBackend, stage: _Stage, unrolled: bool) -> _Loop:
        """The forward of the stage's layers unrolled (per-layer weights) or scanned (stacked weights), its
        weights placed."""
        params, specs = tensor_parallel.shard_params(unstack_layers(params) if unrolled else params, self.cfg, self.tp)
        mesh, layers = stage.mesh, stage.layers if len(self.devices) > len(stage.devices) else None
        model = Llama(self.cfg, backend, self.dtype, TP if self.tp > 1 else None, unrolled=unrolled, layers=layers)

        spread = spread_burst = None
        if len(stage.devices) > 1:  # every device runs the same batch: inputs replicated, weights and cache split
            cache = P(None, SP, TP)
            spread = functools.partial(
                jax.shard_map,
                mesh=mesh,
                in_specs=(specs, cache, P(), P()),
                out_specs=(P(), cache, P()),
                check_vma=False,
            )
            spread_burst = functools.partial(
                jax.shard_map,
                mesh=mesh,
                in_specs=(specs, cache, P(), P(), P()),
                out_specs=(cache, P(), P(), P(), P()),
                check_vma=False,
            )
        step = forward_packed(model, self.buckets, spread)
        multi = burst_packed(model, self.buckets, self.block_size, self.max_rows, spread_burst)
        shardings = tensor_parallel.shardings(mesh, specs)
        placed = (
            jax.device_put(params, shardings)
            if self.placed
            else jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings)
        )
        return _Loop(
            placed,
            model,
            jax.jit(step, donate_argnums=(1,), static_argnames=("shape",)),
            jax.jit(multi, donate_argnums=(1, 4), static_argnames=("shape", "kind")),
        )

    def _loop_of(self, stage: _Stage, shape: batch.Shape) -> _Loop:
        unrolled = self.unrolled and (shape.tiles == 0 or not self.scan_mixed)
        with self._lock:
            if unrolled not in stage.loops:
                stage.loops[unrolled] = self._stacked()
            return stage.loops[unrolled]

    def programs(self, mixed: bool = True) -> list[Program]:
        """Every program serving can run (without `mixed`: what decodes alone run): the forwards, then the
        sampler of each kind for each of their row counts, then the bursts."""
        return [
            *_with_samplers([s for s in self.buckets.programs() if mixed or s.tiles == 0]),
            *self._bursts(),
            SlotWrite(),
        ]

    def _bursts(self) -> list[Burst]:
        """The multi-step decode programs (none unless Buckets.burst_steps > 1), greedy first."""
        b = self.buckets
        return (
            [Burst(r, kind, x) for x in (False, True) for kind in batch.SAMPLER_KINDS for r in b.decode_rows]
            if b.burst_steps > 1
            else []
        )

    def warmup(
        self, programs: Sequence[Program] | None = None, *, progress: bool = True, threads: int | None = None
    ) -> None:
        """Compile (or load from the persistent cache) `programs` (default: every one serving can run), `threads`
        at a time (default: one per CPU core)."""
        todo = [p for p in (self.programs() if programs is None else programs) if p not in self._programs]
        threads = threads or os.cpu_count() or 1
        with (
            concurrent.futures.ThreadPoolExecutor(threads) as pool,
            tqdm(total=len(todo), desc="compile step programs", unit="program", disable=not progress) as bar,
        ):
            for done in concurrent.futures.as_completed([pool.submit(self._program, p) for p in todo]):
                done.result()
                bar.update()

    def first_programs(self, mixed: bool = True) -> list[Program]:
        """What the first few requests run: programs of at most the smallest mixed row bucket's rows, decodes
        and (with `mixed`; a cluster's decode instance gets its prompts as KV) chunks of up to FIRST_TOKENS tokens
        (a short prompt), and their plain samplers."""
        b = self.buckets
        return _with_samplers(
            [
                s
                for s in b.programs()
                if s.rows <= b.rows[0] and (s.tiles == 0 or mixed and s.tokens <= max(FIRST_TOKENS, b.tokens[0]))
            ],
            extra=(False,),
        )

    def later_programs(self, first: Sequence[Program] | None = None) -> list[Program]:
        """The rest of programs() after `first` (default: first_programs()), fewest tokens and rows first, each
        forward followed by its samplers, then the bursts."""
        first = set(self.first_programs() if first is None else first)
        shapes = sorted((s for s in self.buckets.programs() if s not in first), key=lambda s: (s.tokens, s.rows))
        later = [p for s in shapes for p in (s, *(Sampler(s.rows, kind) for kind in batch.SAMPLER_KINDS))]
        extra = [p for p in _with_samplers(list(self.buckets.programs())) if isinstance(p, Sampler) and p.extra]
        return [p for p in dict.fromkeys(later + extra) if p not in first] + self._bursts() + [SlotWrite()]

    def compile_in_background(
        self, programs: Sequence[Program], stop: threading.Event | None = None
    ) -> concurrent.futures.Future:
        """Compile `programs` in a daemon thread, in order, one at a time (the step thread keeps a core). A step
        that needs one first waits for its compile, or compiles it itself if it has not started. Resolves when
        all are, or once `stop` is set, after the one compiling then."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                for p in programs:
                    if stop is not None and stop.is_set():
                        break
                    self._program(p)
                future.set_result(None)
            except BaseException as e:  # noqa: BLE001 - a step that needs the program compiles it again
                logging.exception("compiling step programs in the background failed")
                future.set_exception(e)

        threading.Thread(target=run, name="jaxserve-compile", daemon=True).start()
        return future

    def compiled_programs(self) -> dict[Program, tuple[jax.stages.Compiled, ...]]:
        """The programs compiled so far, for another runner of the same devices, settings and buckets."""
        with self._lock:
            return dict(self._programs)

    def is_compiled(self, program: Program) -> bool:
        with self._lock:
            return program in self._programs

    def _program(self, program: Program) -> tuple[jax.stages.Compiled, ...]:
        """The compiled `program` (a forward: one per pipeline stage), compiled now if it is not yet; one thread
        compiles each."""
        with self._lock:
            if program in self._programs:
                return self._programs[program]
            lock = self._compiling.setdefault(program, threading.Lock())
        with lock:
            if program not in self._programs:
                stages = self._stages if isinstance(program, batch.Shape) else self._stages[-1:]
                compiled = tuple(self._compile(self._trace(program, self._abstract, stage=s).lower()) for s in stages)
                with self._lock:
                    self._programs[program] = compiled
        return self._programs[program]

    def _compile(self, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
        options = xla_flags.cpu_options() if self.cpu else quantize.UNMERGED_DOTS if self.blocks else {}
        if not options:
            return lowered.compile()
        try:
            return lowered.compile(compiler_options=options)
        except jax.errors.JaxRuntimeError as e:  # an XLA without the option: its defaults
            if "No such compile option" not in str(e):
                raise
            logging.warning("XLA does not know %s; programs keep its defaults", options)
            return lowered.compile()

    def _abstract(self, tree: Any) -> Any:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)

    def _trace(
        self, program: Program, abstract, kv_dtype: jnp.dtype | None = None, stage: _Stage | None = None
    ) -> jax.stages.Traced:
        """program traced on `stage` (a forward's; the first by default), for shapes `abstract` gives."""
        kv_dtype, stage = kv_dtype or self.kv_dtype, stage or self._stages[0]
        caches = jax.tree.map(lambda x: abstract(x).update(dtype=kv_dtype), stage.caches)
        slots = abstract(self._slot_shapes()) if getattr(program, "extra", False) else None
        if isinstance(program, SlotWrite):
            one = jax.tree.map(lambda x: x.update(shape=(1, *x.shape[1:])), self._slot_shapes())
            slot = jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated)
            return self._set_slot.trace(abstract(self._slot_shapes()), abstract(slot), abstract(one))
        if isinstance(program, Sampler):
            sampling = batch.sampling(batch.empty(self.buckets, self.buckets.decode(program.rows), self.block_size))
            replicated = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._replicated)  # noqa: E731
            logits = replicated(jax.ShapeDtypeStruct((program.rows, self.cfg.vocab_size), np.float32))
            mask = (
                abstract(replicated(jax.ShapeDtypeStruct((program.rows, grammar.words(self.cfg.vocab_size)), np.int32)))
                if program.extra
                else None
            )
            return self._sample.trace(
                abstract(logits),
                abstract(jax.tree.map(replicated, sampling)),
                slots,
                mask,
                kind=program.kind,
                size=self.max_rows,
            )
        if isinstance(program, Burst):
            loop, shape = stage.loops[self.unrolled], self.buckets.decode(program.rows)
            blob = batch.to_blob(batch.empty(self.buckets, shape, self.block_size))
            return loop.burst.trace(
                abstract(loop.params), caches, blob, abstract(self._previous), slots, shape=shape, kind=program.kind
            )
        loop, empty = self._loop_of(stage, program), batch.empty(self.buckets, program, self.block_size)
        if stage.layers[0] == 0:  # the last step's tokens
            inputs = abstract(
                jax.ShapeDtypeStruct(self._previous.shape, self._previous.dtype, sharding=stage.replicated)
            )
        else:  # the previous stage's hidden states
            inputs = abstract(
                jax.ShapeDtypeStruct(
                    (len(empty.token_ids), self.cfg.hidden_size), self.dtype, sharding=stage.replicated
                )
            )
        return loop.step.trace(abstract(loop.params), caches, batch.to_blob(empty), inputs, shape=program)

    def lower(self, program: Program, platforms: Sequence[str] | None = None) -> jax.stages.Lowered:
        """`program` lowered for `platforms` (default: this backend), e.g. to read what a GPU would run from a
        machine without one. One device only (shapes without placement); the cache takes the target's dtype."""
        if self.stages > 1:
            raise ValueError("lower() reads one program: a runner without pipeline stages")
        abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
        kv_dtype = cache_dtype(self.dtype, platforms[0], self.kv_cache_dtype) if platforms else None
        with lowering_for(platforms):
            traced = self._trace(program, abstract, kv_dtype)
            return traced.lower(lowering_platforms=tuple(platforms) if platforms else None)

    def execute(self, rows: Sequence[batch.Row]) -> np.ndarray:
        """Run the rows, update the cache, and return the sampled next token of each row."""
        return self.start(rows).value()[: len(rows)]

    def start(self, rows: Sequence[batch.Row], steps: int = 1, guided: bool = False) -> Pending | None:
        """Pack the rows (BadRow names one that cannot be) and dispatch their step. steps > 1: a multi-step
        decode (every row a decode, each producing up to its Row.steps tokens). guided: dispatch the forward
        alone; its sampler waits for the rows' masks (sample_guided), which the host computes meanwhile."""
        arrays = batch.pack(rows, self.buckets, self.block_size)
        if guided:
            if steps != 1:
                raise ValueError("a guided step (structured output) samples one token a row: steps must be 1")
            self._waiting = self._forward(arrays)
            return None
        if steps == 1:
            return self.dispatch(arrays)
        if not 1 < steps <= self.buckets.burst_steps or any(len(r.tokens) != 1 or r.steps > steps for r in rows):
            raise ValueError(
                f"a multi-step decode of {steps} steps (at most {self.buckets.burst_steps}) runs "
                "decodes of at most that many tokens"
            )
        return self.dispatch_burst(arrays)

    def execute_arrays(self, arrays: batch.StepArrays) -> np.ndarray:
        """Run a packed step and wait for it: `max_rows` tokens, padding included."""
        return self.dispatch(arrays).value()

    def dispatch(self, arrays: batch.StepArrays) -> Pending:
        """Dispatch a packed step; it runs after the steps dispatched before it. Its arrays go to the device as
        one blob (one transfer). The forward and the sampler are two programs dispatched back to back (the device
        runs them without waiting for the host): each forward serves both samplers, so half as many large
        programs compile. The forward hands the sampler its inputs, already on the device."""
        forward = self._forward(arrays)
        extra = batch.extra(arrays)
        return self._sampled(forward, extra, self._all_allowed(forward.rows) if extra else None)

    def sample_guided(self, masks: Int[np.ndarray, "n w"]) -> Pending:
        """Dispatch the sampler of the guided step `start` dispatched, with its rows' masks (engine.grammar; the
        padding rows' allow every token)."""
        forward, self._waiting = self._waiting, None
        if forward is None:
            raise ValueError("no guided step waits for its masks")
        w = grammar.words(self.cfg.vocab_size)
        if masks.ndim != 2 or masks.shape[0] > forward.rows or masks.shape[1] != w or masks.dtype != np.int32:
            raise ValueError(f"masks of shape {masks.shape} ({masks.dtype}) for a step of {forward.rows} rows")
        padded = np.concatenate([masks, grammar.everything(forward.rows - len(masks), self.cfg.vocab_size)])
        return self._sampled(forward, True, jax.device_put(padded, self._replicated))

    def _forward(self, arrays: batch.StepArrays) -> _Forward:
        """Dispatch a packed step's forward (a new one: a guided forward whose sampler never ran is dropped)."""
        self._waiting = None
        shape, blob = batch.shape_of(arrays), batch.to_blob(arrays)
        # A step no row of which feeds from the previous one does not wait for it: with pipeline stages its first
        # stage runs while the previous step is still in the later ones (Medha's SPP: chunk i + 1 enters stage 1
        # while chunk i is in stage 2).
        x = self._previous if (arrays.feed >= 0).any() else self._unfed
        for stage, forward in zip(self._stages, self._program(shape)):
            if self.stages > 1:  # the tokens to the first stage, each stage's hidden states to the next
                x = processes.move(x, stage.replicated)
            x, stage.caches, sampling = forward(self._loop_of(stage, shape).params, stage.caches, blob, x)
        return _Forward(x, sampling, shape.rows, batch.sampler_kind(arrays))

    def _sampled(self, forward: _Forward, extra: bool, mask: jax.Array | None) -> Pending:
        """Dispatch a forward's sampler (the extra one with the masks)."""
        (sampler,) = self._program(Sampler(forward.rows, forward.kind, extra))
        self._previous, slots, logprobs = sampler(forward.logits, forward.sampling, self._slots_for(extra), mask)
        return self._pending(self._previous, slots, logprobs)

    def _all_allowed(self, rows: int) -> jax.Array:
        """Masks allowing every token, for the extra sampler's steps that have no grammar (placed once)."""
        if rows not in self._everything:
            self._everything[rows] = jax.device_put(grammar.everything(rows, self.cfg.vocab_size), self._replicated)
        return self._everything[rows]

    def dispatch_burst(self, arrays: batch.StepArrays) -> Pending:
        """Dispatch a packed multi-step decode (each row's Row.steps in `arrays.limit`). Its Pending reads
        [Buckets.burst_steps, max_rows] tokens: step j's in row j (rows of steps not run are zeros)."""
        shape, (stage,) = batch.shape_of(arrays), self._stages  # no bursts with pipeline stages
        self._waiting = None
        extra = batch.extra(arrays)
        (program,) = self._program(Burst(shape.rows, batch.sampler_kind(arrays), extra))
        stage.caches, out, self._previous, slots, logprobs = program(
            stage.loops[self.unrolled].params,
            stage.caches,
            batch.to_blob(arrays),
            self._previous,
            self._slots_for(extra),
        )
        return self._pending(out, slots, logprobs)

    def _slots_for(self, extra: bool) -> Slots | None:
        """The slots an extra sampler updates (allocated at first use), None for a plain one."""
        if extra and self._slots is None:
            self._slots = self._no_slots()
        return self._slots if extra else None

    def _pending(self, tokens: jax.Array, slots: Slots | None, logprobs: Logprobs | None) -> Pending:
        if slots is not None:
            self._slots = slots
        return Pending(
            processes.read_later(tokens), None if logprobs is None else Logprobs(*map(processes.read_later, logprobs))
        )

    def set_slot(
        self,
        slot: int,
        prompt: Sequence[int],
        generated: Sequence[int],
        bias: Sequence[tuple[int, float]],
        banned: Sequence[int],
        allowed: Sequence[int] | None = None,
    ) -> None:
        """Fill sampling slot `slot` for a request (before its first step that uses it): its prompt's tokens,
        the counts of the tokens it generated so far, its logit_bias (-inf bans a token), the tokens min_tokens
        holds back, and with `allowed` the only tokens it may sample (the others' bias is -inf). Runs after the
        steps dispatched before it, so a step still in flight that counted into the slot is overwritten."""
        if not 0 <= slot < self.max_rows:
            raise ValueError(f"sampling slot {slot} is not in [0, {self.max_rows})")
        v = self.cfg.vocab_size
        row = Slots(
            np.bincount(np.asarray(generated, np.int64), minlength=v)[None].astype(np.int32),
            np.zeros((1, v), bool),
            np.zeros((1, v), np.float32),
            np.zeros((1, v), bool),
        )
        row.prompt[0, np.asarray(prompt, np.int64)] = True
        if allowed is not None:
            row.bias[0] = -np.inf
            row.bias[0, np.asarray(allowed, np.int64)] = 0.0
        for token, value in bias:
            row.bias[0, token] = value
        row.banned[0, np.asarray(banned, np.int64)] = True
        (program,) = self._program(SlotWrite())
        self._slots = program(self._slots_for(True), np.int32(slot), jax.device_put(row, self._replicated))

    def _slot_shapes(self) -> Slots:
        v, n = self.cfg.vocab_size, self.max_rows
        return Slots(
            *(
                jax.ShapeDtypeStruct((n, v), d, sharding=self._replicated)
                for d in (jnp.int32, jnp.bool_, jnp.float32, jnp.bool_)
            )
        )

    def _no_slots(self) -> Slots:
        """Every sampling slot empty: one per row the step programs hold (from the host: nothing to compile)."""
        return jax.device_put(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), self._slot_shapes()), self._replicated)

    def warmup_land(self, max_rows: int) -> None:
        """Compile what `land` runs for pieces of up to max_rows rows (powers of two, as rows.pieces cuts them),
        writing only to scratch blocks. In a group: a whole piece to each KV-parallel rank (every device's
        writes) and each split of a piece between two ranks (every selection of rows)."""
        self._one_stage("KV from a prefill pool")
        sizes = [1 << i for i in range(max_rows.bit_length()) if 1 << i <= max_rows]
        kvp, bs = len(self.devices) // self.tp, self.block_size
        for n in sizes:
            k = jax.device_put(
                np.zeros((self.cfg.num_layers, n, self.cfg.num_kv_heads, self.cfg.head_dim), self.dtype), self.device
            )
            splits = [(d, n) for d in range(kvp)] + [(i % kvp, m) for i, m in enumerate(sizes) if m < n and kvp > 1]
            for d, m in splits:  # m rows to rank d's scratch block (global block d), the rest to the next's
                self.land(k, k, np.where(np.arange(n) < m, d, (d + 1) % kvp) * bs)

    def land(self, k_rows: jax.Array, v_rows: jax.Array, slots: np.ndarray) -> None:
        """Write KV computed elsewhere (a prefill pool's rows in the model's head layout, [layers, n, kvh, d], on
        the runner's first device) into the cache's `slots`. Each device gets only the rows of the blocks its
        KV-parallel rank owns, and of those only its tensor-parallel share of the heads."""
        (stage,) = self._one_stage("KV from a prefill pool")
        if len(self.devices) == 1:
            stage.caches = rows.scatter(*stage.caches, k_rows, v_rows, slots)
            return
        tp, kvp, bs = self.tp, len(self.devices) // self.tp, self.block_size
        block = np.asarray(slots) // bs
        owner, local = block % kvp, (block // kvp) * bs + np.asarray(slots) % bs
        shards = [{s.device: s.data for s in c.addressable_shards} for c in stage.caches]
        for d in range(kvp):
            idx = np.flatnonzero(owner == d)
            if not len(idx):
                continue
            # a power-of-two count (one small program per size): padding repeats the last row, written twice
            idx = np.concatenate([idx, np.full((1 << (len(idx) - 1).bit_length()) - len(idx), idx[-1])])
            picked = rows.select(k_rows, v_rows, idx)
            for j, device in enumerate(self.devices[d * tp : (d + 1) * tp]):
                heads = (
                    tensor_parallel.heads_of(*picked, self.share.kv_start(j), size=self.share.kv_heads)
                    if tp > 1
                    else picked
                )  # this device's heads only
                k_own, v_own = (processes.move(x, SingleDeviceSharding(device)) for x in heads)
                if processes.is_local(device):
                    shards[0][device], shards[1][device] = rows.scatter(
                        shards[0][device], shards[1][device], k_own, v_own, local[idx]
                    )
        stage.caches = tuple(
            jax.make_array_from_single_device_arrays(
                c.shape, stage.cache_sharding, [s[d] for d in self.devices if d in s], dtype=c.dtype
            )
            for c, s in zip(stage.caches, shards)
        )

    def _one_stage(self, what: str) -> list[_Stage]:
        if self.stages > 1:
            raise ValueError(f"a runner with pipeline stages takes no {what}")
        return self._stages

    @property
    def caches_lost(self) -> bool:
        """A failed step deleted the donated cache buffers (or the sampling slots): `recover`."""
        slots = () if self._slots is None else self._slots
        return any(x.is_deleted() for x in (*slots, *(x for stage in self._stages for x in stage.caches)))

    def recover(self) -> None:
        """Fresh (zeroed) cache buffers after a failed step deleted the donated ones (every stage's: a failed
        pipeline step leaves the stages' caches out of step)."""
        if self.caches_lost:
            for stage in self._stages:
                stage.caches = self._allocate(stage)
            self._previous = self._no_tokens()  # the failed step's may hold its error
            self._waiting = None
            self._slots = None  # every request's slot is set again before it next samples

    def _no_tokens(self, sharding: NamedSharding | None = None) -> Int[Array, " m"]:
        """What a forward reads as the previous step's tokens when none ran or no row feeds from them: zeros where
        the sampler's tokens are (or on `sharding`: the first stage's, for steps that feed on nothing)."""
        return jax.device_put(np.zeros(self.max_rows, np.int32), sharding or self._replicated)

    def _allocate(self, stage: _Stage):
        layers = stage.layers[1] - stage.layers[0]
        zeros = jax.jit(
            lambda: allocate_caches(self.cfg, self.num_blocks, self.block_size, self.kv_dtype, self.tp, layers),
            out_shardings=stage.cache_sharding,
        )
        return zeros() if self.placed else jax.eval_shape(zeros)
