"""The engine behind the servers: one thread drives `Engine.step()`; asyncio handlers submit requests and read
their outputs as async streams.

The engine is not thread-safe, so only the engine thread touches it. Handlers send commands (add, abort) that
the thread applies between steps; that is why a client that leaves has its request aborted and its KV blocks
freed within one engine step. Outputs go back to each request's asyncio queue through the event loop's
call_soon_threadsafe. The steps themselves run outside the event loop, so handlers, health checks and
/metrics stay responsive while the model computes.

Fail-over (with a `fallback`): when a process the engine needs is lost, the engine thread is retired (it may be
stuck in a step that waits for that process: it is left behind, and nothing it does afterwards is delivered),
the fallback engine is built on what remains, and every open request is recomputed there from its prompt and
the tokens it has already streamed, so its stream goes on with nothing repeated or missing.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import threading
import time
from typing import Any, AsyncIterator, Callable

from absl import logging

from jaxserve.engine.engine import RequestOutput, StepFailed
from jaxserve.engine.interface import ServingEngine
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.metrics import ServerMetrics


class QueueFull(Exception):
    """Admission refused: the running batch and the waiting queue are full."""


class ShuttingDown(Exception):
    """The server is draining: new requests are refused, and unfinished ones are ended when it stops."""


NOT_ACCEPTING = "the server is shutting down and accepts no new requests"


class EngineFailed(Exception):
    """An engine step raised, or one request's part of it could not run; those requests were ended (the others
    go on)."""


class ProcessGone(Exception):
    """A process of a multi-process cluster is gone: no request can finish (the server stops)."""


def fit_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, default: int | None) -> int:
    """max_tokens for a prompt: `requested` if the context has room for it, else ValueError; unset: `default`
    (None: the whole rest of the context), capped by the room left."""
    room = max_model_len - prompt_len
    if room < 1:
        raise ValueError(
            f"prompt has {prompt_len} tokens; the context holds {max_model_len} "
            "(prompt plus at least one generated token)"
        )
    if requested is None:
        return room if default is None else min(default, room)
    if isinstance(requested, int) and not isinstance(requested, bool) and requested > room:
        raise ValueError(
            f"max_tokens {requested} does not fit: the prompt has {prompt_len} tokens and the "
            f"context holds {max_model_len}, leaving {room}"
        )
    return requested  # a bad type or value is named by SamplingParams' validation


@dataclasses.dataclass
class _TokenEvent:
    output: RequestOutput
    time: float  # time.monotonic() when the step that produced it ended


class RequestStream:
    """One request's outputs, as an async iterator. Closing it before the end aborts the request and frees its
    KV blocks; use it as `async with` so that a cancelled handler closes it."""

    def __init__(
        self,
        server: AsyncEngine,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        ttft_slo: float | None = None,
        after: str | None = None,
    ):
        self.request_id = request_id
        self.after = after  # a sibling's request id, whose prefill this one waits for (ServingEngine.enqueue)
        self.prompt_ids = prompt_ids
        self.params = params
        self.ttft_slo = ttft_slo
        self.cached_tokens = 0  # prompt tokens served from the prefix cache
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_generated = 0
        self._server = server
        self._queue: asyncio.Queue[_TokenEvent | BaseException] = asyncio.Queue()
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._end(abort=False)  # whoever queued the error also ended the request in the engine
            raise item
        out = item.output
        self.first_token_time = self.first_token_time or item.time
        self.last_token_time = item.time
        self.num_generated += len(out.new_token_ids)
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)  # a resumed request's engine hit none
        if out.finished:
            self._end(abort=False)
        return out

    def close(self) -> None:
        if not self._done:
            self._end(abort=True)

    def _end(self, abort: bool) -> None:
        self._done = True
        self._server._forget(self, abort)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()


_END = object()


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several requests as they come, with each one's index; closing this closes them all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, _END))
        except Exception as e:  # noqa: BLE001 - the stream's error (e.g. EngineFailed), raised to the reader
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        unfinished = len(streams)
        while unfinished:
            i, item = await queue.get()
            if item is _END:
                unfinished -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


@dataclasses.dataclass
class _Live:
    """The engine thread's record of a request it holds."""

    stream: RequestStream
    last_token_time: float | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)  # delivered so far (a fail-over resumes after them)


class AsyncEngine:
    """Runs a ServingEngine (one replica's or a cluster's) in its own thread for asyncio servers. Capacity: the
    engine's running batch (max_num_seqs) plus `max_queue` waiting requests; beyond that `submit` raises QueueFull."""

    def __init__(
        self,
        engine: ServingEngine,
        *,
        max_queue: int,
        metrics: ServerMetrics | None = None,
        stall_timeout: float = 60.0,
        lost: Callable[[], str | None] = lambda: None,
        fallback: Callable[[], ServingEngine] | None = None,
        loss_grace: float = 30.0,
    ):
        """stall_timeout: seconds the engine thread may go without coming round its loop while requests are
        open before health says it is stalled (a watchdog: one step or one request's work stuck for everyone).
        lost: why a process the engine needs is gone, or None (LLM.lost; checked from the event loop, which a
        step stuck waiting for that process cannot hold up). fallback: builds an engine on what remains after
        such a loss (LLM.fail_over); None: every open request ends with ProcessGone. loss_grace: with a
        fallback, how long a failed step waits to learn whether it failed for a lost process (more than the time
        a loss takes to notice) before it fails its requests."""
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.stall_timeout = stall_timeout
        self._lost, self.lost = lost, None  # lost: the reason, once a process is gone
        self._fallback, self.loss_grace = fallback, loss_grace
        self.failed_over = False  # serving on the fallback engine (health: degraded)
        self._generation = 0  # of the engine thread: a retired thread's work is dropped
        self._lock = threading.Lock()  # the engine thread's bookkeeping against a fail-over's swap
        # What health reads, written by the engine thread only between steps: reading the engine itself from
        # another thread would see a step's donated cache buffers as deleted while it runs.
        self._alive_at = time.monotonic()  # when the engine thread last came round its loop
        self._waiting = False  # the engine thread is idle, waiting for work (alive, however long that lasts)
        self._can_step = True
        self.engine = engine
        self.capacity = engine.max_num_seqs + max_queue
        self.metrics = metrics or ServerMetrics()
        self.accepting = True
        self.closing = asyncio.Event()  # set with accepting = False: a request still arriving is refused at once
        self.steps = 0  # engine iterations run (tests read it to bound how soon an abort lands)
        self._prefix = (0, 0)  # prefix-cache (queries, hits) already counted in the metrics
        self._preemptions = 0
        self._events: dict[str, int] = {}  # the engine's event counts already in the metrics
        self._open: dict[str, RequestStream] = {}  # event-loop side: submitted, not yet ended
        self._live: dict[str, _Live] = {}  # engine-thread side: in the engine
        self._commands: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake = threading.Event()
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []  # the engine thread, after those a fail-over retired
        self._update_gauges()

    # ---- lifecycle (event-loop side) ------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the streams."""
        self._loop = asyncio.get_running_loop()
        self._start_thread()

    def _start_thread(self) -> None:
        self._threads.append(
            threading.Thread(target=self._run, args=(self._generation,), name="jaxserve-engine", daemon=True)
        )
        self._threads[-1].start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the engine thread after its current step (a thread a fail-over retired ends after its own),
        waiting at most `timeout` seconds (None: for as long as it takes) for them all; a thread still in its step
        then is left to end with the process (it is a daemon). Unfinished requests should be ended first."""
        self._command("stop", None)
        end = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if end is None else max(end - time.monotonic(), 0.0))
            if thread.is_alive():
                logging.warning("an engine thread is still in a step after %g s; not waiting for it", timeout)

    @property
    def threads_alive(self) -> int:
        return sum(t.is_alive() for t in self._threads)

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (draining); call from the event loop."""
        self.accepting = False
        self.closing.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until every submitted request has ended; False if `timeout` seconds passed first."""
        deadline = time.monotonic() + timeout
        while self._open and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self._open

    def abort_all(self, error: BaseException) -> None:
        """End every open request with `error` (raised to its reader) and abort it in the engine."""
        for stream in list(self._open.values()):
            stream._queue.put_nowait(error)
            self._command("abort", stream.request_id)

    @property
    def num_open(self) -> int:
        return len(self._open)

    @property
    def stalled(self) -> bool:
        """Requests are open and the engine thread has made no progress for stall_timeout seconds (not idle:
        a request submitted to an idle thread is picked up at once)."""
        return bool(self._open) and not self._waiting and time.monotonic() - self._alive_at > self.stall_timeout

    @property
    def healthy(self) -> bool:
        """The engine can step and is stepping: false while a failed step's cache could not be rebuilt, or
        while the engine is stalled."""
        return self._can_step and not self.stalled and (self.lost is None or self.failed_over)

    def check_lost(self) -> str | None:
        """Whether a process is gone (event-loop side). The first time, with a fallback, the engine fails over
        (requests wait meanwhile, health says NOT_SERVING until the fallback serves); without one, every open
        request ends with ProcessGone and no more are accepted. Returns the reason."""
        if self.lost is None and (reason := self._lost()) is not None:
            if self._fallback is not None:
                with self._lock:
                    self._generation += 1  # the engine thread stops at its next look
                    self.lost = reason
                self._wake.set()
                threading.Thread(target=self._fail_over, name="jaxserve-failover", daemon=True).start()
            else:
                self.lost = reason
                self._give_up(ProcessGone(f"the server lost a process of its cluster: {reason}"))
        return self.lost

    def _give_up(self, error: ProcessGone) -> None:
        """Nothing can serve: every open request ends with `error`, and no more are accepted."""
        self.accepting = False
        self.closing.set()
        self.abort_all(error)

    def _fail_over(self) -> None:
        """Build the fallback engine, recompute every request the lost engine held on it, and start its thread.
        If it cannot be built, every open request ends with ProcessGone."""
        try:
            engine = self._fallback()
        except Exception as e:  # noqa: BLE001 - nothing left to serve with
            logging.exception("the fallback engine could not be built")
            self._loop.call_soon_threadsafe(
                self._give_up,
                ProcessGone(f"the server lost a process of its cluster ({self.lost}) and cannot go on: {e}"),
            )
            return
        with self._lock:
            self.capacity += engine.max_num_seqs - self.engine.max_num_seqs  # the same queue beyond its batch
            self.engine, self._can_step = engine, True
            self._events, self._prefix, self._preemptions = {}, (0, 0), 0  # its counts start from zero
            for rid, live in list(self._live.items()):  # the scheduler puts those with tokens first
                stream = live.stream
                engine.enqueue(
                    stream.prompt_ids + live.tokens,
                    stream.params,
                    request_id=rid,
                    ttft_slo=stream.ttft_slo,
                    generated=len(live.tokens),
                )
            self.failed_over = True
            self._start_thread()
        logging.warning(
            "serving on the fallback engine after losing a process (%s); %d requests resumed",
            self.lost,
            len(self._live),
        )

    # ---- requests (event-loop side) -------------------------------------------------------------------
    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        ttft_slo: float | None = None,
        after: RequestStream | None = None,
    ) -> RequestStream:
        """Queue a request; ValueError names what is wrong with it, QueueFull / ShuttingDown refuse it.
        ttft_slo: seconds to its first token (the deadline edf / lrs / lars rank by); None: the server's SLO.
        after: a sibling of the same prompt whose prefill it waits for (ServingEngine.enqueue)."""
        if not self.accepting:
            raise ShuttingDown(NOT_ACCEPTING)
        ids = self.engine.check_request(prompt_ids, params)  # reads only the model's fixed config
        if ttft_slo is not None and not (
            isinstance(ttft_slo, (int, float)) and not isinstance(ttft_slo, bool) and 0 < ttft_slo < float("inf")
        ):
            raise ValueError(f"ttft_slo must be a positive number of seconds, got {ttft_slo!r}")
        if len(self._open) >= self.capacity:
            raise QueueFull(f"the server is at capacity ({len(self._open)} requests running or queued); retry later")
        stream = RequestStream(
            self, f"req-{next(self._ids)}", ids, params, ttft_slo, None if after is None else after.request_id
        )
        self._open[stream.request_id] = stream
        self._command("add", stream)
        return stream

    def _forget(self, stream: RequestStream, abort: bool) -> None:
        self._open.pop(stream.request_id, None)
        if abort:
            self._command("abort", stream.request_id)

    def _command(self, kind: str, arg: Any) -> None:
        self._commands.append((kind, arg))
        self._wake.set()

    # ---- the engine thread ----------------------------------------------------------------------------
    def _run(self, generation: int) -> None:
        while True:
            self._alive_at = time.monotonic()
            with self._lock:
                if generation != self._generation or not self._apply_commands():
                    return
                # this pass steps the engine of its generation: a thread a fail-over retires meanwhile must not
                # step the fallback (it would drop outputs the fallback's scheduler has applied)
                engine = self.engine
            if not self._recovered(engine):
                self._wake.wait(self.RECOVER_RETRY_S)
                self._wake.clear()
                continue
            if not engine.has_unfinished():
                self._waiting = True
                try:
                    engine.run_deferred(stop=lambda: bool(self._commands))
                except Exception:  # noqa: BLE001 - e.g. the surplus step it reads first failed: serve on
                    logging.exception("the engine's deferred work failed")
                # deferred work not done (it waits for something, or yielded): look again in a while
                self._wake.wait(self.DEFERRED_RETRY_S if engine.has_deferred else None)
                self._alive_at, self._waiting = time.monotonic(), False
                self._wake.clear()  # commands queued meanwhile are applied at the top of the loop
                continue
            self._alive_at = time.monotonic()
            start = time.monotonic()
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - a failed step must not take the server down
                if self._retired(generation):  # it failed for a lost process: the fail-over resumes its requests
                    return
                with self._lock:
                    if generation != self._generation:
                        return
                    if isinstance(e, StepFailed):  # the engine ended that step's requests and rebuilt what it lost
                        logging.exception("engine step failed; ending the requests in it")
                        failed = e.request_ids
                    else:
                        logging.exception("engine step failed outside the compiled call; dropping every request")
                        failed = list(self._live)
                    self._fail(failed, EngineFailed(f"the engine failed while running this request: {e}"))
                continue
            now = time.monotonic()
            with self._lock:
                if generation != self._generation:
                    return
                self.steps += 1
                for out in outputs:
                    self._deliver(out, now)
                self._update_gauges()
            if engine.last_predicted is not None:  # the step ran a Plan
                self.metrics.step_seconds.observe(time.monotonic() - start)
                self.metrics.step_predicted.inc(engine.last_predicted)

    RECOVER_RETRY_S = 1.0  # between attempts to rebuild a lost cache
    DEFERRED_RETRY_S = 1.0  # between looks at deferred work while idle

    def _retired(self, generation: int) -> bool:
        """After a failed step: whether this thread is retired by a fail-over, waiting (with a fallback) up to
        loss_grace seconds for the loss to be noticed: a step that needed the lost process fails before its
        heartbeat times out."""
        end = time.monotonic() + (self.loss_grace if self._fallback is not None and self.lost is None else 0.0)
        while True:
            if generation != self._generation:
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.1)

    def _recovered(self, engine: ServingEngine) -> bool:
        """Try to make the engine able to step again. False: still cannot step."""
        try:
            engine.recover()
        except Exception:  # noqa: BLE001 - e.g. out of device memory: retried, health says NOT_SERVING
            logging.exception("could not rebuild the KV cache; retrying in %g s", self.RECOVER_RETRY_S)
        self._can_step = engine.can_step
        return self._can_step

    def _apply_commands(self) -> bool:
        """Apply queued commands in order; False on stop."""
        while self._commands:
            kind, arg = self._commands.popleft()
            if kind == "stop":
                return False
            if kind == "add":  # submit checked the request
                self.engine.enqueue(
                    arg.prompt_ids, arg.params, request_id=arg.request_id, ttft_slo=arg.ttft_slo, after=arg.after
                )
                self._live[arg.request_id] = _Live(arg)
                self.metrics.prompt_tokens.inc(len(arg.prompt_ids))
            elif kind == "abort" and self._live.pop(arg, None) is not None:
                self.engine.abort(arg)
                self.metrics.finished.labels("abort").inc()
        self._update_gauges()
        return True

    def _deliver(self, out: RequestOutput, now: float) -> None:
        live = self._live.get(out.request_id)
        if live is None:
            return
        if out.error is not None:  # this request failed alone
            self._fail([out.request_id], EngineFailed(f"the engine could not run this request: {out.error}"))
            return
        m = self.metrics
        live.tokens += out.new_token_ids
        m.generated_tokens.inc(len(out.new_token_ids))
        if live.last_token_time is None:
            m.ttft.observe(now - live.stream.arrival)
        else:
            m.itl.observe(now - live.last_token_time)
        for _ in out.new_token_ids[1:]:  # a multi-step decode's tokens arrive together
            m.itl.observe(0.0)
        live.last_token_time = now
        if out.finished:
            del self._live[out.request_id]
            m.finished.labels(out.finish_reason.value).inc()
            m.e2e.observe(now - live.stream.arrival)
        self._post(live.stream, _TokenEvent(out, now))

    def _fail(self, request_ids, error: EngineFailed) -> None:
        for rid in request_ids:
            live = self._live.pop(rid, None)
            if live is None:
                continue
            self.engine.abort(rid)
            self.metrics.finished.labels("error").inc()
            self._post(live.stream, error)
        self._update_gauges()

    def _post(self, stream: RequestStream, item: _TokenEvent | BaseException) -> None:
        try:
            self._loop.call_soon_threadsafe(stream._queue.put_nowait, item)
        except RuntimeError:  # the event loop has closed: nobody is reading any more
            pass

    def _update_gauges(self) -> None:
        engine, m = self.engine, self.metrics
        kv = engine.kv
        m.waiting.set(engine.num_waiting)
        m.running.set(engine.num_running)
        m.kv_free.set(kv.num_free)
        m.kv_used.set(kv.capacity - kv.num_free)
        queries, hits = kv.stats.query_tokens, kv.stats.hit_tokens
        m.prefix_queries.inc(queries - self._prefix[0])
        m.prefix_hits.inc(hits - self._prefix[1])
        self._prefix = (queries, hits)
        m.preemptions.inc(engine.num_preemptions - self._preemptions)
        self._preemptions = engine.num_preemptions
        for event, count in engine.events.items():
            m.cluster_events.labels(event).inc(count - self._events.get(event, 0))
            self._events[event] = count
