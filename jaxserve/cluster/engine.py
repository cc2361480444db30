"""The live cluster as one engine (the same interface as engine.Engine, so the servers and LLM drive either):
prompts are planned chunk by chunk onto groups of the prefill pool by a CDSP planner, each chunk runs on its
group's sub-mesh, its KV streams to the decode instance chosen at planning time, and decode instances run the
Plan-executing engine.

- Planning (Tetris 5.1-5.2): on arrival, the planner sees every prefill device's booked time (the predicted end
  of its booked chunks, moved by how late or early the executed ones really ended) and returns the chunks
  (tokens, group); the decode instance is chosen then, by freeness with virtual usage or power of two, from the
  predicted decode length (never the true one).
- Executing: each step starts the next chunks, in booked order, whose groups are free and disjoint (they may run
  at once), rebalancing a request's history before a chunk on a larger group; takes the chunks that have
  finished (polling briefly when no decode instance has work); then moves KV (ReceiveBuffers) and runs one
  step on every decode instance with work, while the chunks still in flight run on.
- Observability: every executed chunk and transfer is recorded with measured times (records, transfers).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from typing import Callable, Sequence

import numpy as np

from jaxserve.cluster.decode import DecodeInstance
from jaxserve.cluster.transfer import KVMover, Transfer
from jaxserve.engine.engine import RequestOutput, StepFailed
from jaxserve.sampling_params import SamplingParams
from jaxserve.engine.sp_prefill import ChunkRun, SPPrefill
from jaxserve.sched.cdsp import Chunk, ChunkPlan
from jaxserve.sched.kv_manager import PrefixCacheStats
from jaxserve.sched.decode_dispatch import (HEAVY_DECODE, LengthPredictor, ObservedLengths, by_freeness,
                                             power_of_two)
from jaxserve.sim.prefill_pool import Planner


WAIT = 0.005  # seconds an idle step polls for a finished chunk before it returns


@dataclasses.dataclass(frozen=True)
class ChunkRecord:
    """One executed chunk; times in seconds of the cluster's clock: start when it was dispatched, end when the
    loop took its token (the chunk had finished by then; between steps, that can be later)."""

    request_id: str
    index: int
    group: tuple[int, ...]
    tokens: int
    history: int
    start: float
    end: float
    predicted_start: float
    predicted_end: float


@dataclasses.dataclass(frozen=True)
class KVTotals:
    """The decode instances' KV pools summed, as the server's gauges read a KVCacheManager (blocks)."""

    num_free: int
    capacity: int
    stats: PrefixCacheStats


@dataclasses.dataclass
class _Prefill:
    request_id: str
    ids: list[int]
    params: SamplingParams
    seed: int
    decoder: DecodeInstance
    chunks: tuple[Chunk, ...]
    planned_at: float
    done: int = 0  # chunks executed
    group: tuple[int, ...] = ()  # instances holding its history


@dataclasses.dataclass(frozen=True)
class _Running:
    """A dispatched chunk (ChunkRun) not yet taken."""

    prefill: _Prefill
    chunk: Chunk
    run: ChunkRun
    start: float


class ClusterEngine:
    def __init__(self, prefill: SPPrefill, planner: Planner, decoders: Sequence[DecodeInstance], mover: KVMover, *,
                 dispatch: str = "freeness", predictor: LengthPredictor | None = None,
                 clock: Callable[[], float] = time.monotonic, seed: int = 0):
        if dispatch not in ("freeness", "power_of_two"):
            raise ValueError(f"dispatch must be freeness or power_of_two, got {dispatch!r}")
        cdsp = getattr(planner, "planner", planner)  # AdaptiveCDSP wraps a CDSPPlanner
        self.pool, self.sizes = cdsp.pool, cdsp.sizes
        self.pool_ids = tuple(sorted(prefill.instances))
        if self.pool.size != len(self.pool_ids):
            raise ValueError(f"the planner's pool has {self.pool.size} instances; the prefill pool "
                             f"{len(self.pool_ids)}")
        self.prefill, self.planner, self.decoders = prefill, planner, list(decoders)
        self.dispatch, self.mover, self.clock = dispatch, mover, clock
        self.predictor = predictor or ObservedLengths()
        first = self.decoders[0].engine
        self.tokenizer, self.max_model_len = first.tokenizer, first.max_model_len
        self.max_num_seqs = sum(d.engine.max_num_seqs for d in self.decoders)
        self.free_at = np.zeros(len(self.pool_ids))  # absolute clock time each prefill device's bookings end
        self.records: list[ChunkRecord] = []
        self.transfers: list[tuple[int, Transfer]] = []  # (decode instance, landed transfer)
        self.decode_started: dict[str, float] = {}
        self.plans: dict[str, ChunkPlan] = {}
        self.last_predicted: float | None = None
        self._prefills: dict[str, _Prefill] = {}
        self._inflight: list[_Running] = []  # chunks dispatched, in dispatch order
        self._owner: dict[str, DecodeInstance] = {}  # every live request's decode instance
        self._generated: dict[str, int] = {}
        self._ids = itertools.count()
        self._rng = random.Random(seed)

    # ---- the Engine interface -----------------------------------------------------------------------------
    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        return self.decoders[0].engine.check_request(prompt_ids, params)

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                    ttft_slo: float | None = None) -> str:
        return self.enqueue(self.check_request(prompt_ids, params), params, request_id, ttft_slo)

    def enqueue(self, ids: list[int], params: SamplingParams, request_id: str | None = None,
                ttft_slo: float | None = None) -> str:
        """Plan the prompt's chunks and choose its decode instance now (ttft_slo: accepted for the interface;
        the CDSP planner minimises every prompt's TTFT)."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._owner:
            raise ValueError(f"request id {rid} is already in use")
        now = self.clock()
        on_arrival = getattr(self.planner, "on_arrival", None)
        if on_arrival is not None:
            on_arrival(now)
        hi = min(self.predictor.predict(len(ids))[1], params.max_tokens)
        decoder = self._choose_decoder(len(ids), hi)
        queues = np.maximum(self.free_at - now, 0.0)
        plan = self.planner.plan(len(ids), queues)
        self.free_at = now + plan.commit(queues)
        seed = decoder.engine.expect(ids, params, rid)
        decoder.expect(rid, len(ids), hi, hi > HEAVY_DECODE)
        # the planner's instance i is the pool's i-th device; a group runs on its devices in id order
        chunks = tuple(dataclasses.replace(c, group=tuple(sorted(self.pool_ids[i] for i in c.group)))
                       for c in plan.chunks)
        self._prefills[rid] = _Prefill(rid, ids, params, seed, decoder, chunks, now)
        self._owner[rid] = decoder
        self.plans[rid] = plan
        return rid

    def _choose_decoder(self, prompt_len: int, predicted: int) -> DecodeInstance:
        loads = [d.load() for d in self.decoders]
        if self.dispatch == "freeness":
            return self.decoders[by_freeness(loads)]
        return self.decoders[power_of_two(loads, prompt_len + predicted, predicted > HEAVY_DECODE, self._rng)]

    def abort(self, request_id: str) -> bool:
        decoder = self._owner.pop(request_id, None)
        if decoder is None:
            return False
        self._drop_prefill(request_id)
        decoder.forget(request_id)
        decoder.engine.abort(request_id)
        return True

    def _drop_prefill(self, request_id: str) -> None:
        """Forget a request's prefill, a chunk in flight included (a later chunk on its stores runs after it:
        the stores are the programs' donated inputs and outputs)."""
        if self._prefills.pop(request_id, None) is not None:
            self._inflight = [f for f in self._inflight if f.prefill.request_id != request_id]
            self.prefill.release(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._owner)

    @property
    def num_running(self) -> int:
        return sum(d.engine.num_running for d in self.decoders) + len(self._prefills)

    @property
    def num_waiting(self) -> int:
        return len(self._owner) - self.num_running

    @property
    def kv(self) -> KVTotals:
        kvs = [d.engine.kv for d in self.decoders]
        return KVTotals(sum(k.num_free for k in kvs), sum(k.capacity for k in kvs),
                        PrefixCacheStats(sum(k.stats.query_tokens for k in kvs), sum(k.stats.hit_tokens for k in kvs)))

    @property
    def num_preemptions(self) -> int:
        return sum(d.engine.num_preemptions for d in self.decoders)

    @property
    def can_step(self) -> bool:
        return all(d.engine.can_step for d in self.decoders)

    def recover(self) -> None:
        for d in self.decoders:
            d.engine.recover()

    has_deferred = False  # a cluster warms up in full: no work waits for it to be idle

    def run_deferred(self, stop) -> None:
        del stop

    # ---- one iteration ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = self._run_chunks()  # counted there
        for i, d in enumerate(self.decoders):
            for t in d.pump(self.clock):
                self.transfers.append((i, t))
            for rid in [rid for rid in d.incoming if d.ready(rid) and rid not in self._prefills]:
                d.admit(rid)
        predicted = []
        for d in self.decoders:
            if not d.engine.has_work:  # also reads a step left in flight after its requests ended
                continue
            before = self.clock()
            try:
                outs = d.engine.step()
            except StepFailed as e:
                for rid in e.request_ids:
                    self._end(rid)
                raise
            if d.engine.last_predicted is not None:
                predicted.append(d.engine.last_predicted)
            for out in outs:
                self.decode_started.setdefault(out.request_id, before)
            self._count(outs)
            outputs += outs
        self.last_predicted = max(predicted) if predicted else None
        return outputs

    def _end(self, request_id: str) -> None:
        decoder = self._owner.pop(request_id, None)
        if decoder is not None:
            decoder.forget(request_id)
        self._drop_prefill(request_id)
        generated = self._generated.pop(request_id, 0)
        observe = getattr(self.predictor, "observe", None)  # a predictor that learns from what it served
        if observe is not None and generated:
            observe(generated)

    def _count(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._generated[out.request_id] = self._generated.get(out.request_id, 0) + len(out.new_token_ids)
            if out.finished:
                self._end(out.request_id)

    def _next_chunks(self) -> list[_Prefill]:
        """The requests whose next chunk can start now: in booked order, each chunk's devices free of any chunk
        running or booked before it, groups disjoint."""
        taken = {i for f in self._inflight for i in f.chunk.group}
        running = {f.prefill.request_id for f in self._inflight}
        pending = sorted((p for p in self._prefills.values() if p.request_id not in running),
                         key=lambda p: (p.planned_at + p.chunks[p.done].start, p.planned_at))
        chosen = []
        for p in pending:
            group = set(p.chunks[p.done].group)
            if not group & taken:
                chosen.append(p)
            taken |= group
        return chosen

    def _finished(self, wait: float) -> list[_Running]:
        """The chunks in flight that have finished, polling up to `wait` seconds while none has (polled, not
        blocked on, so that the step returns and a request arriving meanwhile is started on free devices)."""
        end = time.perf_counter() + wait
        while True:
            done = [f for f in self._inflight if f.run.ready()]
            if done or time.perf_counter() >= end:
                return done
            time.sleep(WAIT / 20)

    def _run_chunks(self) -> list[RequestOutput]:
        """Start every chunk that can start, then take the finished ones: the step never blocks on a chunk, so
        decode steps and new arrivals' chunks go on while a long chunk runs on its group."""
        for p in self._next_chunks():
            chunk = p.chunks[p.done]
            start = self.clock()
            if chunk.group != p.group and p.group:
                self.prefill.rebalance(p.request_id, chunk.group)
            run = self.prefill.run_chunk(p.request_id, chunk.group, p.ids[chunk.history:chunk.history + chunk.tokens],
                                         chunk.history, p.params, p.seed)
            p.group = chunk.group
            self._inflight.append(_Running(p, chunk, run, start))
        idle = self._inflight and not any(d.engine.has_work for d in self.decoders)  # wait a little for a chunk
        outputs = []
        for f in self._finished(WAIT if idle else 0.0):
            self._inflight.remove(f)
            p, chunk = f.prefill, f.chunk
            token = f.run.token()
            end = self.clock()
            predicted_end = p.planned_at + chunk.end
            self.records.append(ChunkRecord(p.request_id, p.done, chunk.group, chunk.tokens, chunk.history, f.start,
                                            end, p.planned_at + chunk.start, predicted_end))
            idx = [self.pool_ids.index(i) for i in chunk.group]
            self.free_at[idx] = np.maximum(self.free_at[idx] + (end - predicted_end), end)
            p.done += 1
            last = p.done == len(p.chunks)
            positions = self.mover.stage((p.request_id, p.done - 1), f.run.written)
            p.decoder.buffers.offer(Transfer(p.request_id, p.done - 1, last, positions, end))
            if last:
                del self._prefills[p.request_id]
                self.prefill.release(p.request_id)
                outputs.append(p.decoder.engine.first_token(p.request_id, token))
        self._count(outputs)
        return outputs
