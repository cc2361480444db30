"""The live cluster as one engine (the same interface as engine.Engine, so the servers and LLM drive either):
prompts are planned chunk by chunk onto groups of the prefill pool by a CDSP planner, each chunk runs on its
group's sub-mesh, its KV streams to the decode instance chosen at planning time, and decode instances run the
Plan-executing engine.

- Deciding (sched/cluster.py's CDSPPolicy, the simulator's too; the subclasses pass their own policy): on
  arrival, the prompt's chunks on groups of the prefill pool and its decode instance; each step, the chunks that
  start now (with the moves of their history); a finished chunk's measured end moves its devices' bookings.
- Executing: each step runs the scheduler's Plan of chunks (they may run at once, on disjoint groups); takes the
  chunks that have finished (polling briefly when no decode instance has work); then moves KV (through each
  decode instance's receive buffers) and runs one step on every decode instance with work, while the chunks
  still in flight run on.
- Observability: the latest executed chunks, transfers and decode starts are recorded with measured times
  (records, transfers, decode_started; HISTORY of each).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from typing import Callable, Protocol, Sequence

import numpy as np

from jaxserve.cluster.decode import LiveDecoder
from jaxserve.cluster.length_predictor import PromptFeatures
from jaxserve.cluster.transfer import KVMover
from jaxserve.engine.engine import RequestOutput, StepFailed
from jaxserve.sampling_params import SamplingParams
from jaxserve.engine.sp_prefill import ChunkRun, SPPrefill
from jaxserve.sched.cluster import ClusterPolicy, averaged_step
from jaxserve.sched.decode_dispatch import PromptInfo
from jaxserve.sched.decode_ledger import Transfer
from jaxserve.sched.kv_manager import PrefixCacheStats
from jaxserve.sched.plan import Outcome, WorkItem


WAIT = 0.005  # seconds an idle step polls for a finished chunk before it returns
HISTORY = 10_000  # chunk, transfer and decode-start records kept, the latest: a server runs for weeks


def refuse_resumed(generated: int) -> None:
    """A cluster takes new requests only: a part-generated one resumes on a fail-over's engine, one replica."""
    if generated:
        raise ValueError(
            f"a cluster does not resume a request with {generated} tokens generated; a fail-over resumes on one replica"
        )


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
    predicted_start: float | None  # as booked (None: a policy that books no times)
    predicted_end: float | None


@dataclasses.dataclass(frozen=True)
class KVTotals:
    """The decode instances' KV pools summed, as the server's gauges read a KVCacheManager (blocks)."""

    num_free: int
    capacity: int
    stats: PrefixCacheStats


class IdleWork(Protocol):
    """Work a cluster does while no request is in it, a step at a time (ClusterEngine.run_deferred): after a
    quick start, compiling its programs (build.py's Compiling) and measuring its pool's model (pool_profile.Later)."""

    @property
    def name(self) -> str: ...

    @property
    def done(self) -> bool: ...

    def step(self) -> None:
        """The next piece (seconds at most: a request may be waiting for the one after it)."""

    def finish(self) -> None:
        """Put what the steps made to use."""


@dataclasses.dataclass(frozen=True)
class _Prefill:
    ids: list[int]
    params: SamplingParams
    seed: int
    decoder: LiveDecoder


@dataclasses.dataclass(frozen=True)
class _Running:
    """A dispatched chunk (ChunkRun) not yet taken."""

    item: WorkItem
    run: ChunkRun
    start: float


class ClusterEngine:
    def __init__(
        self,
        prefill: SPPrefill,
        scheduler: ClusterPolicy,
        decoders: Sequence[LiveDecoder],
        mover: KVMover,
        *,
        clock: Callable[[], float] = time.monotonic,
        features: PromptFeatures | None = None,
    ):
        """features: what the length predictor reads of a prompt (None: its length alone)."""
        self.pool_ids = tuple(sorted(prefill.instances))
        if scheduler.pool_ids != self.pool_ids:
            raise ValueError(
                f"the scheduler's pool is devices {scheduler.pool_ids}; the prefill pool's {self.pool_ids}"
            )
        if scheduler.predictor is None:
            raise ValueError("a live cluster predicts decode lengths (e.g. ObservedLengths); it cannot know them")
        self.prefill, self.scheduler, self.decoders = prefill, scheduler, list(decoders)
        self.mover, self.clock, self.features = mover, clock, features
        # the engine that checks requests: the one serving the longest context (ESP's multi-master group)
        self._front = max((d.engine for d in self.decoders), key=lambda e: e.max_model_len)
        self.tokenizer, self.max_model_len = self._front.tokenizer, self._front.max_model_len
        self.max_num_seqs = sum(d.engine.max_num_seqs for d in self.decoders)
        self.events: collections.Counter[str] = collections.Counter()  # chunks, rebalances, transfers
        self._idle: list[IdleWork] = []  # what to do while no request is in (defer)
        self.records: collections.deque[ChunkRecord] = collections.deque(maxlen=HISTORY)
        self.transfers: collections.deque[tuple[int, Transfer]] = collections.deque(maxlen=HISTORY)  # (decode
        # instance, landed transfer)
        self.decode_started: collections.deque[tuple[str, float]] = collections.deque(maxlen=HISTORY)  # (request,
        # when its first decode step began)
        self.arrivals: collections.deque[tuple[str, float, int]] = collections.deque(maxlen=HISTORY)  # (request,
        # when the policy saw it, prompt tokens): a replay's trace (sim/replay.py)
        self._decoding: set[str] = set()  # live requests that have begun decoding
        self.last_predicted: float | None = None
        self.decode_seconds = 0.0  # a decode instance's step, measured (moving average; 0 before the first)
        self._prefills: dict[str, _Prefill] = {}
        self._inflight: list[_Running] = []  # chunks dispatched, in dispatch order
        # every live request's decode instance (None: not chosen yet)
        self._owner: dict[str, LiveDecoder | None] = {}
        self._generated: dict[str, int] = {}
        self._ids = itertools.count()
        self._arrival: float | None = None  # the arrival time of requests enqueued since the last step began

    def _arrived(self, request_id: str, prompt_len: int) -> float:
        """The request's arrival, recorded: the time of the first request enqueued since the last step began, so
        requests enqueued between two steps arrive together (the policy plans with them all at the next step,
        and a replay sees them at once)."""
        if self._arrival is None:
            self._arrival = self.clock()
        self.arrivals.append((request_id, self._arrival, prompt_len))
        return self._arrival

    def prompt_info(self, ids: Sequence[int]) -> PromptInfo:
        """What the length predictor reads of a prompt."""
        return PromptInfo(len(ids), None if self.features is None else self.features(ids))

    @property
    def planner(self):
        return self.scheduler.planner

    def chunk_shapes(self, max_tokens: int) -> list[tuple[tuple[int, ...], int]]:
        """Every (group, local bucket) a chunk can run as: the planner's groups, chunks up to max_tokens."""
        groups = [tuple(self.pool_ids[i] for i in g) for g in self.planner.groups()]
        return [(g, b) for g in groups for b in self.prefill.buckets(len(g), max_tokens)]

    @property
    def free_at(self) -> np.ndarray:
        """When each prefill device's bookings end (the scheduler's, in the clock's time)."""
        return self.scheduler.free_at

    # ---- the Engine interface -----------------------------------------------------------------------------
    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        # the prefill instances draw the first token with temperature, top-k and top-p alone
        if (
            params.uses_history
            or params.min_p > 0
            or params.logprobs is not None
            or params.structured_output is not None
        ):
            raise ValueError(
                "penalties, logit_bias, min_tokens, min_p, logprobs, allowed_token_ids, bad_words and "
                "structured output are not supported with prefill instances yet (one engine serves "
                "them)"
            )
        return self._front.check_request(prompt_ids, params)

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        ttft_slo: float | None = None,
    ) -> str:
        return self.enqueue(self.check_request(prompt_ids, params), params, request_id, ttft_slo)

    def enqueue(
        self,
        ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        ttft_slo: float | None = None,
        generated: int = 0,
        after: str | None = None,
    ) -> str:
        """Plan the prompt's chunks and choose its decode instance now (ttft_slo and after: accepted for the
        interface, generated: refused; the CDSP planner minimises every prompt's TTFT, and siblings are prefilled
        each in turn)."""
        refuse_resumed(generated)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._owner:
            raise ValueError(f"request id {rid} is already in use")
        now = self._arrived(rid, len(ids))
        arrival = self.scheduler.arrive(
            self.prompt_info(ids), now, dict(enumerate(self.decoders)), params.max_tokens, request_id=rid
        )
        decoder = self.decoders[arrival.dispatch.decoder]
        seed = decoder.engine.expect(ids, params, rid)
        self.scheduler.add(rid, arrival, now)
        self._prefills[rid] = _Prefill(ids, params, seed, decoder)
        self._owner[rid] = decoder
        return rid

    def abort(self, request_id: str) -> bool:
        if request_id not in self._owner:
            return False
        decoder = self._owner[request_id]
        self._end(request_id, observe=False)
        if decoder is not None:
            decoder.engine.abort(request_id)
        return True

    def _drop_prefill(self, request_id: str) -> None:
        """Forget a request's prefill, a chunk in flight included (a later chunk on its stores runs after it:
        the stores are the programs' donated inputs and outputs)."""
        if self._prefills.pop(request_id, None) is not None:
            self._inflight = [f for f in self._inflight if f.item.request_id != request_id]
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
    def pools(self) -> list[LiveDecoder]:
        """The decode instances that own KV pools (ESP's multi-master group takes its blocks from theirs)."""
        return self.decoders

    @property
    def kv(self) -> KVTotals:
        kvs = [d.engine.kv for d in self.pools]
        return KVTotals(
            sum(k.num_free for k in kvs),
            sum(k.capacity for k in kvs),
            PrefixCacheStats(sum(k.stats.query_tokens for k in kvs), sum(k.stats.hit_tokens for k in kvs)),
        )

    @property
    def num_preemptions(self) -> int:
        return sum(d.engine.num_preemptions for d in self.decoders)

    @property
    def can_step(self) -> bool:
        return all(d.engine.can_step for d in self.decoders)

    def recover(self) -> None:
        for d in self.decoders:
            d.engine.recover()

    def defer(self, work: IdleWork, first: bool = False) -> None:
        """Work to do while no request is in the cluster: after the work queued (first: before it)."""
        self._idle.insert(0 if first else len(self._idle), work)

    @property
    def has_deferred(self) -> bool:
        return bool(self._idle) or any(d.engine.has_deferred for d in self.decoders)

    def run_deferred(self, stop: Callable[[], bool]) -> None:
        """While no request is in the cluster: the decode instances' deferred work (their step profiles, once
        their programs compile), then the cluster's own a step at a time, returning between steps once stop() is
        true (a request waits: the next call goes on from there); each finished work is put to use. A failed one
        is dropped: the cluster serves on without it."""
        if self._owner:
            return
        for d in self.decoders:
            if d.engine.has_deferred:  # it returns as soon as stop() is true
                d.engine.run_deferred(stop)
        while self._idle and not self._owner:
            work = self._idle[0]
            try:
                while not work.done:
                    if stop():
                        return
                    work.step()
                work.finish()
            except Exception:  # noqa: BLE001 - the work only refines serving: serve without it
                logging.exception("%s failed; the cluster serves on without it", work.name)
            self._idle.pop(0)

    # ---- one iteration ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._arrival = None
        outputs = self._run_chunks()  # counted there
        for i, d in enumerate(self.decoders):
            for t in d.pump(self.clock):
                self.transfers.append((i, t))
                self.events["transfers"] += 1
            d.admit_ready(lambda rid: rid in self._prefills)
        predicted = []
        for i, d in enumerate(self.decoders):
            if not d.engine.has_work or self._paused(i):  # has_work: also a step left in flight
                continue
            before = self.clock()
            try:
                outs = d.engine.step()
            except StepFailed as e:
                for rid in e.request_ids:
                    self._end(rid)
                raise
            took = self.clock() - before
            self.decode_seconds = averaged_step(self.decode_seconds, took)
            if d.engine.last_predicted is not None:
                predicted.append(d.engine.last_predicted)
            for out in outs:
                if out.request_id not in self._decoding:
                    self._decoding.add(out.request_id)
                    self.decode_started.append((out.request_id, before))
            self._count(outs)
            outputs += outs
        self.last_predicted = max(predicted) if predicted else None
        return outputs

    def _check_decoders_on_pool(self, policy: str) -> None:
        """Where the pool's instances decode too: decoders[k] must run on pool instance k."""
        if [d.engine.runner.device.id for d in self.pools] != list(self.pool_ids):
            raise ValueError(
                f"{policy} instances prefill and decode: one decode engine per pool instance, on its "
                "devices, in pool order"
            )

    def _paused(self, index: int) -> bool:
        """Whether decode instance `index` skips this step (its devices prefill, under ESP)."""
        del index
        return False

    def _end(self, request_id: str, observe: bool = True) -> None:
        decoder = self._owner.pop(request_id, None)
        self._decoding.discard(request_id)
        if decoder is not None:
            decoder.forget(request_id)
        self._drop_prefill(request_id)
        generated = self._generated.pop(request_id, 0)
        self.scheduler.finish(request_id, generated if observe else 0)

    def _count(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._generated[out.request_id] = self._generated.get(out.request_id, 0) + len(out.new_token_ids)
            if out.finished:
                self._end(out.request_id)

    def _finished(self, wait: float) -> list[_Running]:
        """The chunks in flight that have finished (polling up to `wait` seconds while none has)."""
        return self._poll(lambda: [f for f in self._inflight if f.run.ready()], wait)

    @staticmethod
    def _poll(find: Callable[[], list], wait: float) -> list:
        """find()'s result once it is not empty, polling up to `wait` seconds (polled, not blocked on, so that
        the step returns and a request arriving meanwhile is started on free devices)."""
        end = time.perf_counter() + wait
        while True:
            found = find()
            if found or time.perf_counter() >= end:
                return found
            time.sleep(WAIT / 20)

    def _run_chunks(self) -> list[RequestOutput]:
        """Start the chunks the scheduler plans now, then take the finished ones: the step never blocks on a
        chunk, so decode steps and new arrivals' chunks go on while a long chunk runs on its group."""
        plan = self.scheduler.plan(self.clock())
        moves = {m.request_id: m for m in plan.moves}
        for item in plan.items:
            p, start = self._prefills[item.request_id], self.clock()
            if item.request_id in moves:
                self.prefill.rebalance(item.request_id, moves[item.request_id].dst)
                self.events["rebalances"] += 1
            run = self.prefill.run_chunk(
                item.request_id, item.group, p.ids[item.start : item.end], item.history, p.params, p.seed
            )
            self._inflight.append(_Running(item, run, start))
            self.events["chunks"] += 1
        idle = self._inflight and not any(d.engine.has_work for d in self.decoders)  # wait a little for a chunk
        outputs = []
        for f in self._finished(WAIT if idle else 0.0):
            self._inflight.remove(f)
            item, rid = f.item, f.item.request_id
            p, token, end = self._prefills[rid], f.run.token(), self.clock()
            booked_start, booked_end = self.scheduler.booked(item)
            self.records.append(
                ChunkRecord(
                    rid, item.chunk_index, item.group, item.tokens, item.history, f.start, end, booked_start, booked_end
                )
            )
            last = bool(self.scheduler.apply(item.group, (item,), Outcome(end, (), {rid: (token,)})))
            staged = self.mover.stage((rid, item.chunk_index), f.run.written)
            p.decoder.ledger.offer(Transfer(rid, item.chunk_index, last, staged, end))
            if last:
                del self._prefills[rid]
                self.prefill.release(rid)
                outputs.append(p.decoder.engine.first_token(rid, token))
        self._count(outputs)
        return outputs
