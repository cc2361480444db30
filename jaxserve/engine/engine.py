"""The serving engine: executes the scheduler's Plans on one device.

Each `step()` asks the ReplicaScheduler (sched/) for a Plan (decodes and several prefill chunks under the
iteration's token and time budget, the KV block ids it grants, the requests it preempted), runs it as one step over
a flat ragged batch (runner.ModelRunner: a compiled forward, then the sampler), turns the sampled tokens into text
and stop decisions, and hands the Outcome back; the scheduler's state moves only from Outcomes, exactly as in the
simulator. With overlap (the default) the next step is dispatched before the last one's tokens are read, so the
device does not wait for this Python. A multi-step decode Plan (Plan.steps > 1) runs its decode steps in one device
loop; its tokens are read together, each request's up to its first stop. A step with structured output
dispatches its forward, then reads the last step's tokens, advances the grammars and sends the masks its sampler
needs (grammar.py), while the device runs the forward. A preempted request recomputes its prompt
and generated tokens (mostly from prefix-cache hits); on CPU in float32 its output is unchanged (bf16 on GPU makes
no such promise: batch shapes change the rounding).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import random
import time
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
from absl import logging

from jaxserve.engine import bad_words
from jaxserve.engine.batch import BadRow, Row
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.grammar import Grammars
from jaxserve.engine.runner import ModelRunner, Pending
from jaxserve.engine.sampling import Logprobs
from jaxserve.sampling_params import SamplingParams, excerpt, grammar_error
from jaxserve.engine.stop_strings import StopMatcher
from jaxserve.models.tokenizer import TextTokenizer
from jaxserve.sched import request as sched_request
from jaxserve.sched.plan import Outcome, Phase, Plan, WorkItem
from jaxserve.sched.scheduler import ReplicaScheduler


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"
    ERROR = "error"  # this request alone could not be run (its `error` says why); the others went on


class TokenLogprob(NamedTuple):
    """A generated token's logprob under the model, and the `SamplingParams.logprobs` most likely tokens'."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first
    rank: int | None = None  # the token's among the vocabulary's (1: the most likely); known for a prompt's


def token_logprobs(tokens: Sequence[int], lp: Logprobs, k: int) -> list[TokenLogprob]:
    """Each token's entry from its row of lp (numpy, row i for tokens[i]), with the k most likely."""
    return [
        TokenLogprob(t, float(lp.chosen[i]), tuple(zip(lp.top_ids[i, :k].tolist(), lp.top[i, :k].tolist())))
        for i, t in enumerate(tokens)
    ]


@dataclasses.dataclass
class RequestOutput:
    """What one step produced for one request: new tokens and the text they complete."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # why, when finish_reason is ERROR
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them
    stop: str | int | None = None  # what ended it with STOP: the stop string, or the stop token (EOS included)

    @classmethod
    def failed(cls, request_id: str, error: str, cached_tokens: int = 0) -> RequestOutput:
        """The request ended with an error, producing nothing more."""
        return cls(
            request_id,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason=FinishReason.ERROR,
            cached_tokens=cached_tokens,
            error=error,
        )


class StepFailed(RuntimeError):
    """A step raised. Its requests were ended; the cache was rebuilt if the failure took it (every other request
    then recomputes). `request_ids`: the requests that were in the step."""

    def __init__(self, message: str, request_ids: Sequence[str]):
        super().__init__(message)
        self.request_ids = tuple(request_ids)


@dataclasses.dataclass
class _Live:
    """The engine's side of a request: sampling, text and stop state (the scheduler holds sizes and progress)."""

    sched: sched_request.Request
    params: SamplingParams
    seed: int
    detokenizer: IncrementalDetokenizer
    stops: StopMatcher
    text: str = ""  # decoded output so far
    emitted_chars: int = 0
    slot: int | None = None  # its sampling slot on the device (runner.set_slot), while it holds one
    matcher: Any = None  # its grammar's state (llguidance.LLMatcher), with structured output
    bad_words: bad_words.BadWords | None = None  # its bad words of several tokens, following its tokens
    never: tuple[int, ...] = ()  # its one-token bad words (the slot's bias bans them)

    @property
    def guided(self) -> bool:
        """Whether its sampler waits for a mask the host makes from its tokens (engine._sample_guided)."""
        return self.matcher is not None or self.bad_words is not None


@dataclasses.dataclass
class _Step:
    """A dispatched Plan whose tokens are not read yet."""

    plan: Plan
    items: list[WorkItem]  # the rows it runs, in order (a request that failed alone is left out)
    lives: list[_Live]  # whose rows they are (a request ended meanwhile and its id reused is not the same)
    tokens: Pending | None  # None: every row failed alone, or a guided step's sampler waits for its masks
    dispatched: float
    guided: list[_Live | None] = dataclasses.field(default_factory=list)  # a guided step's rows that wait

    def rows(self) -> dict[str, int]:
        """Each decode's row: where the next step finds its token."""
        return {i.request_id: n for n, i in enumerate(self.items) if i.phase is Phase.DECODE}


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: ReplicaScheduler,
        tokenizer: TextTokenizer,
        *,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        overlap: bool = True,
    ):
        """overlap: dispatch each step before reading the last one's tokens (False: one step at a time)."""
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        if max_model_len > scheduler.kv_capacity:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the KV cache's {scheduler.kv_capacity} "
                "tokens; give it more blocks"
            )
        self.runner, self.scheduler, self.tokenizer = runner, scheduler, tokenizer
        self.kv = scheduler.kv
        self.max_model_len = max_model_len
        self.max_num_seqs = scheduler.max_num_seqs
        self.clock = clock
        self.num_preemptions = 0
        self.last_predicted: float | None = None  # the cost model's time of the last step (None: no Plan)
        self._live: dict[str, _Live] = {}
        self._tables: dict[str, list[int]] = {}  # block tables as the Plans granted them
        self._ids = itertools.count()
        self._seed_rng = random.Random()
        self.overlap = overlap
        self._pending: _Step | None = None  # dispatched, its tokens not read
        self._failed_alone: list[RequestOutput] = []  # requests a step left out, told in this step's outputs
        self._last_end = -math.inf  # when the last step's tokens were read
        self._deferred: Callable[[Callable[[], bool]], bool] | None = None  # run_deferred's work
        self._free_slots = list(range(runner.max_rows))  # sampling slots: at most one per running request
        self.grammars = Grammars(tokenizer, runner.cfg.vocab_size)
        self._held: dict[str, list[sched_request.Request]] = {}  # siblings waiting for a request's first token

    # ---- requests -------------------------------------------------------------------------------------
    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as a list of ints, or ValueError naming what is wrong with the request."""
        if not isinstance(params, SamplingParams):  # which validated itself when it was made
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in prompt_ids):
            raise ValueError("a prompt must be a string or a list of integer token ids")
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.runner.cfg.vocab_size
        for name, given in (
            ("prompt token ids", ids),
            ("logit_bias token ids", [t for t, _ in params.logit_bias]),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            bad = sorted({t for t in given if not 0 <= t < vocab})
            if bad:  # vLLM's words: "out of vocabulary"
                raise ValueError(f"{name} must be in [0, {vocab}): {excerpt(bad, 40)} out of vocabulary")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the context holds {self.max_model_len} "
                f"(prompt plus at least one generated token; the KV pool: {self.kv.describe()})"
            )
        bad_words.sequences(params.bad_words, self.tokenizer, vocab)
        if params.structured_output is not None:
            self.grammars.compiled(params.structured_output)  # compiled (and kept) now: a bad grammar is refused
        return ids

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
        """Queue a request whose prompt and params check_request already passed (checking is O(prompt), so a
        caller that checked first does not pay for a long prompt twice). ttft_slo: seconds to the first token,
        the deadline the deadline-aware policies (edf, lrs, lars) rank by; None takes the scheduler's SLO.
        generated: a resumed request (a fail-over) whose last `generated` ids it generated already (params as it
        was sent: max_tokens counts them): their text was streamed (or is held back, as it was), so its text
        resumes where it stopped, and its draws go on from that token index. after: a sibling of that
        request (the same prompt: n > 1), held back until it has its first token, so that its prompt is
        prefilled once and the sibling finds it in the prefix cache."""
        live = self._new_live(
            ids, params, request_id if request_id is not None else f"req-{next(self._ids)}", generated
        )
        r = live.sched
        if ttft_slo is not None:
            r.ttft_deadline = r.arrival + ttft_slo
        first = self._live.get(after) if after is not None else None
        if first is not None and first.sched.generated == 0 and first is not live:
            self._held.setdefault(after, []).append(r)
        else:
            self.scheduler.add(r)
        return r.id

    def _let_go(self, request_id: str) -> None:
        """The siblings held back for this request join the queue (it has its first token, or has ended)."""
        for r in self._held.pop(request_id, ()):
            if r.id in self._live:
                self.scheduler.add(r)

    def _new_live(self, ids: list[int], params: SamplingParams, request_id: str, generated: int = 0) -> _Live:
        """The engine's side of a new request (its seed: the params' or a random one), kept in _live. With
        `generated`, the text and stop state are replayed over those last ids as _append made them."""
        prompt = ids[: len(ids) - generated]
        words = bad_words.sequences(params.bad_words, self.tokenizer, self.runner.cfg.vocab_size)
        longer = [w for w in words if len(w) > 1]
        r = sched_request.Request(
            request_id,
            self.clock(),
            len(prompt),
            min(params.max_tokens, self.max_model_len - len(prompt)),
            token_ids=list(ids),
            single_step=params.structured_output is not None or bool(longer),
            generated=generated,
        )
        if generated:  # as a preempted request: its KV recomputed, its tokens' count (the sampler's) goes on
            r.preempt()
        seed = params.draw_seed() if params.seed is not None else self._seed_rng.getrandbits(32)
        matcher = None
        if params.structured_output is not None:  # before the request is held: a grammar that fails leaves nothing
            matcher = self.grammars.matcher(params.structured_output)
            if not matcher.consume_tokens(ids[len(prompt) :]):
                raise ValueError(f"request {request_id}: its grammar refuses the tokens it generated")
        live = self._live[request_id] = _Live(
            r,
            params,
            seed,
            IncrementalDetokenizer(self.tokenizer, prompt, params.skip_special_tokens),
            StopMatcher(params.stop),
            matcher=matcher,
            bad_words=bad_words.BadWords(longer, ids[len(prompt) :]) if longer else None,
            never=tuple(w[0] for w in words if len(w) == 1),
        )
        for token in ids[len(prompt) :]:
            new = live.detokenizer.push(token)
            live.text += new
            live.stops.feed(new)
        live.emitted_chars = len(live.text) - live.stops.held  # what the stream has (the rest was held back)
        return live

    # ---- requests prefilled elsewhere (a prefill pool; cluster/) ------------------------------------------
    def expect(self, ids: list[int], params: SamplingParams, request_id: str) -> int:
        """A checked request whose prompt is prefilled elsewhere: its text and stop state live here from now;
        its first token comes from the prefill (first_token), its KV lands in blocks it reserves (reserve, then
        the runner's land), and it decodes once admitted (admit_prefilled). Returns its sampling seed, which the
        prefill's draw of the first token must use."""
        return self._new_live(ids, params, request_id).seed

    def first_token(self, request_id: str, token: int) -> RequestOutput:
        """The prefill's sampled token, turned into text and stop decisions; a request it finishes ends here."""
        live = self._live[request_id]
        out = self._append(live, token)
        self.scheduler.prefilled_elsewhere(live.sched, Outcome(self.clock(), (), {request_id: (token,)}))
        if out.finished:
            self.abort(request_id)
        return out

    def reserve(self, request_id: str, predicted: int | None = None) -> list[int] | None:
        """The block table its prompt's KV lands in (None while the blocks or the batch are full, or the
        admission policy holds it back). predicted: its predicted decode length (None: its max_tokens)."""
        blocks = self.scheduler.reserve(self._live[request_id].sched, predicted)
        if blocks is not None:
            self._tables[request_id] = list(blocks)
        return blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def admit_prefilled(self, request_id: str) -> None:
        """Its prompt's KV has landed: it decodes from the next step."""
        self.scheduler.add_prefilled(self._live[request_id].sched)

    def abort(self, request_id: str) -> bool:
        if not self._drop(request_id):
            return False
        self.scheduler.abort(request_id)
        self._let_go(request_id)
        return True

    def _drop(self, request_id: str) -> bool:
        """Forget an ended request: its state, its sampling slot, its block table. False if it was not live."""
        self._tables.pop(request_id, None)
        live = self._live.pop(request_id, None)
        if live is None:
            return False
        self._release(live)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._live)

    @property
    def has_work(self) -> bool:
        """A step would run something: a request decoding, or a prompt waiting to be prefilled here (requests
        expected from a prefill pool are unfinished but give a step nothing to do until they are admitted)."""
        return self._pending is not None or bool(self.scheduler.decoding) or len(self.scheduler.queue) > 0

    events: Mapping[str, int] = {}  # one replica has no cluster events (preemptions are counted apart)

    @property
    def num_waiting(self) -> int:
        return len(self._live) - len(self.scheduler.running)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ---- one iteration --------------------------------------------------------------------------------
    @property
    def can_step(self) -> bool:
        """False only while a failed step's cache could not be rebuilt (`recover` retries)."""
        return not self.runner.caches_lost

    def recover(self) -> None:
        """Rebuild the cache if a failed step took it: every request's KV (and every cached prefix) is gone, so
        the requests still held recompute. Raises if the rebuild fails (e.g. out of device memory)."""
        if self.runner.caches_lost:
            self._pending = None  # its requests recompute what it was computing
            self.scheduler.drop_all_kv()
            self._tables.clear()
            for live in self._live.values():  # the slots went with the cache
                self._release(live)
            self.runner.recover()

    def defer(self, work: Callable[[Callable[[], bool]], bool]) -> None:
        """Work for the device while no request is in the engine (run_deferred), e.g. measuring the cost
        profile after a quick start. work(stop) returns whether it finished; it should return early (False) as
        soon as stop() is true: a request is waiting."""
        self._deferred = work

    @property
    def has_deferred(self) -> bool:
        return self._deferred is not None

    def run_deferred(self, stop: Callable[[], bool]) -> None:
        """Run the deferred work if no request is in the engine. Stopped early, it starts again the next time.
        Raises what reading a surplus step in flight raises (StepFailed)."""
        if self._deferred is None or self._live:
            return
        if self._pending is not None:  # a stopped request's surplus step: read it (the work runs alone)
            pending, self._pending = self._pending, None
            self._finish(pending)
        try:
            done = self._deferred(stop)
        except Exception:  # noqa: BLE001 - the work only refines serving: serve without it
            logging.exception("deferred work failed; serving without it")
            done = True
        if done:
            self._deferred = None

    def step(self) -> list[RequestOutput]:
        """Run one Plan and return what it produced. With `overlap`, the next Plan is dispatched before this
        one's tokens are read, so the device runs it while the host turns them into text and an Outcome."""
        self.recover()  # a no-op unless an earlier rebuild failed
        self.last_predicted = None
        if self._pending is None:
            self._pending = self._launch(None)
        current, self._pending = self._pending, None
        if current is not None and self.overlap:
            self._pending = self._launch(current)
        outputs = self._finish(current) if current is not None else []
        if self._pending is not None and self._pending.guided:  # its guides have taken current's tokens
            self._sample_guided(self._pending)
        outputs += self._failed_alone
        self._failed_alone = []
        return outputs

    def _launch(self, previous: _Step | None) -> _Step | None:
        """Plan and dispatch a step (None: nothing to run). `previous`: the step still in flight; the new Plan
        may decode its requests again, feeding their in-flight tokens on the device."""
        plan = self.scheduler.schedule(self.clock(), lagged=previous is not None)
        if plan is None:
            return None
        self._grant(plan)
        items = list(plan.items)
        step = _Step(plan, items, [self._live[i.request_id] for i in items], None, self.clock())
        feeds = {} if previous is None else previous.rows()
        while True:
            try:
                rows = [self._row(i, feeds, plan.steps > 1) for i in step.items]
                guided = [
                    live if live.guided and self.scheduler.yields_token(i) else None
                    for i, live in zip(step.items, step.lives)
                ]
                step.guided = guided if any(g is not None for g in guided) else []
                step.tokens = self.runner.start(rows, steps=plan.steps, guided=bool(step.guided)) if rows else None
                if step.guided and previous is None:  # no step in flight: the guides are up to date
                    return self._sample_guided(step)
                return step
            except BadRow as e:  # one request's inputs: it fails alone, the step runs without it
                rid = step.items.pop(e.index).request_id
                step.lives.pop(e.index)
                logging.warning("request %s fails alone: %s", rid, e)
                self._failed_alone.append(self._error(rid, str(e)))
            except Exception as e:
                raise self._fail(e, step, previous) from e

    def _sample_guided(self, step: _Step) -> _Step | None:
        """Dispatch a guided step's sampler with its rows' masks: its grammar's, less the last tokens of the bad
        words its tokens would complete. Each guide has taken its request's tokens up to this step's (the device
        ran the step's forward meanwhile); a request that ended since gets no mask (its row's token is dropped).
        A failure ends the step's requests, told in this step's outputs."""
        guided = [
            g if g is not None and self._live.get(i.request_id) is g else None for i, g in zip(step.items, step.guided)
        ]
        try:
            masks = self.grammars.masks(
                [None if g is None else g.matcher for g in guided],
                [g.bad_words.banned() if g is not None and g.bad_words else () for g in guided],
            )
            step.tokens = self.runner.sample_guided(masks)
            step.guided = []
            return step
        except Exception as e:  # noqa: BLE001 - as a failed dispatch: the step's requests end
            failed = self._fail(e, step)
            self._failed_alone += [RequestOutput.failed(rid, str(failed)) for rid in failed.request_ids]
            return None

    def _finish(self, step: _Step) -> list[RequestOutput]:
        """Read a dispatched step's tokens, turn them into text and stop decisions, and apply its Outcome. A
        request that stopped in the step before gets no output (its surplus token is dropped)."""
        try:
            sampled = step.tokens.value() if step.tokens is not None else np.zeros(0, np.int32)
            logprobs = step.tokens.logprobs_value() if step.tokens is not None else None
        except Exception as e:
            raise self._fail(e, step, self._pending) from e
        burst = sampled.ndim == 2
        sampled = np.atleast_2d(sampled)  # [steps, rows]: one step's tokens, or a burst's
        if logprobs is not None and not burst:
            logprobs = Logprobs(*(x[None] for x in logprobs))
        end = self.clock()
        start, self._last_end = max(step.dispatched, self._last_end), end  # under overlap: end to end
        outputs, tokens, stopped = [], {}, set()
        # the Plan as it ran, less the requests that ended since it was dispatched (a stop found one step late
        # drops their tokens; a request id used again names another request)
        ran = [
            (n, item)
            for n, (item, live) in enumerate(zip(step.items, step.lives))
            if self._live.get(item.request_id) is live
        ]
        plan = dataclasses.replace(step.plan, items=tuple(item for _, item in ran))
        for n, item in ran:
            if not self.scheduler.yields_token(item):
                continue
            live = self._live[item.request_id]
            count = item.tokens if item.phase is Phase.DECODE else 1
            try:
                out = self._take(
                    live,
                    [int(t) for t in sampled[:count, n]],
                    None if logprobs is None else Logprobs(*(x[:count, n] for x in logprobs)),
                )
            except Exception as e:  # noqa: BLE001 - e.g. detokenizing: this request's own work
                logging.exception("request %s failed after its step", item.request_id)
                outputs.append(self._error(item.request_id, f"turning its token into text failed: {e}"))
                continue
            tokens[item.request_id] = tuple(out.new_token_ids)
            if out.finished:
                stopped.add(item.request_id)
            outputs.append(out)
        self.last_predicted = plan.predicted_time
        # the step's time split by token share: what a per-item duration means for one fused call
        total = max(sum(i.tokens for i in plan.items), 1)
        per_item = tuple((end - start) * i.tokens / total for i in plan.items)
        done = self.scheduler.apply(plan, Outcome(end, per_item, tokens, frozenset(stopped)))
        for rid in tokens:
            self._let_go(rid)
        for r in done:
            self._drop(r.id)
        return outputs

    def _grant(self, plan: Plan) -> None:
        self.num_preemptions += len(plan.preempted)
        for rid in plan.preempted:
            self._tables.pop(rid, None)
            self._release(self._live[rid])  # set again from its history when it next samples
        for rid, ids in plan.blocks.items():
            self._tables.setdefault(rid, []).extend(ids)

    def _row(self, item: WorkItem, feeds: dict[str, int], burst: bool) -> Row:
        """A Plan item as the runner's row. A decode whose token is still in flight (past the known ones) takes
        it from its row in the previous step, and counts the tokens in flight as generated for the sampler. In a
        burst, a decode row produces up to item.tokens tokens and stops at its stop tokens on the device."""
        live = self._live[item.request_id]
        r, table = live.sched, self._tables[item.request_id]
        steps, stops = 1, ()
        if burst:
            p = live.params
            # the device checks the first batch.STOP_SLOTS: EOS first (the host checks them all)
            eos = () if p.ignore_eos else sorted(self.tokenizer.stop_ids)
            steps, stops = item.tokens, tuple(dict.fromkeys((*eos, *p.stop_token_ids)))
        slot = self._slot(live) if self.scheduler.yields_token(item) else -1
        if item.start < len(r.token_ids):
            tokens = r.token_ids[item.start : item.start + (1 if burst else item.tokens)]
            return Row(
                tokens=tokens,
                start=item.start,
                block_table=table,
                params=live.params,
                seed=live.seed,
                counter=r.generated,
                steps=steps,
                stop_ids=stops,
                slot=slot,
            )
        flying = item.start - len(r.token_ids) + 1
        return Row(
            tokens=(0,),
            start=item.start,
            block_table=table,
            params=live.params,
            seed=live.seed,
            counter=r.generated + flying,
            feed=feeds[item.request_id],
            steps=steps,
            stop_ids=stops,
            slot=slot,
        )

    def _slot(self, live: _Live) -> int:
        """The request's sampling slot (-1 if its params need none), set from its history when it takes one: at
        its first kept token, or its first after a preemption or a rebuilt cache. Its history is whole then:
        a request is only re-admitted once the Outcome of its last step in flight has landed."""
        if not live.params.uses_history:
            return -1
        if live.slot is None:
            r, p = live.sched, live.params
            slot = self._free_slots.pop()
            banned = (*self.tokenizer.stop_ids, *p.stop_token_ids)
            self.runner.set_slot(
                slot,
                r.token_ids[: r.prompt_len],
                r.token_ids[r.prompt_len :],
                (*p.logit_bias, *((t, -math.inf) for t in live.never)),
                banned,
                p.allowed_token_ids,
            )
            live.slot = slot
        return live.slot

    def _release(self, live: _Live) -> None:
        """Give back its sampling slot. A step still in flight may count into it; the next owner's set_slot runs
        after that step on the device."""
        if live.slot is not None:
            self._free_slots.append(live.slot)
            live.slot = None

    def _error(self, request_id: str, message: str) -> RequestOutput:
        """End one request with an error; the scheduler ignores the rest of its Plan."""
        cached = self._live[request_id].sched.cached_tokens
        self.abort(request_id)
        return RequestOutput.failed(request_id, message, cached)

    def _fail(self, error: Exception, *steps: _Step | None) -> StepFailed:
        """End the requests of a failed step and of the step dispatched beside it (which read its tokens), and
        rebuild the cache if the failure took it. A failed rebuild is logged and retried before the next step;
        meanwhile `can_step` is False."""
        self._pending = None
        ids = sorted(set().union(*(s.plan.request_ids for s in steps if s is not None)))
        for rid in ids:
            self.abort(rid)
        try:
            self.recover()
        except Exception:  # noqa: BLE001 - the step's own error is what its requests see
            logging.exception("could not rebuild the KV cache after a failed step; will retry")
        return StepFailed(f"the engine step failed: {error}", ids)

    # ---- stopping and text ----------------------------------------------------------------------------
    def _take(self, live: _Live, tokens: list[int], logprobs: Logprobs | None = None) -> RequestOutput:
        """A step's tokens for one request (several from a burst), up to the first that finishes it: what
        follows a stop was computed by the device and is dropped. logprobs: the step's for these tokens."""
        outs = []
        for token in tokens:
            outs.append(self._append(live, token, ahead=len(outs)))
            if outs[-1].finished:
                break
        last = outs[-1]
        k = live.params.logprobs
        kept = None if k is None or logprobs is None else token_logprobs(tokens[: len(outs)], logprobs, k)
        return dataclasses.replace(
            last,
            new_token_ids=[o.new_token_ids[0] for o in outs],
            new_text="".join(o.new_text for o in outs),
            logprobs=kept,
        )

    def _append(self, live: _Live, token: int, ahead: int = 0) -> RequestOutput:
        """One new token; `ahead`: tokens of the same step before it."""
        p, r = live.params, live.sched
        generated = r.generated + ahead + 1  # this token included (the scheduler counts it when the Outcome lands)
        if live.matcher is not None and not live.matcher.consume_token(token):
            raise ValueError(f"token {token}: {grammar_error(live.matcher.get_error())}")
        if live.bad_words is not None:
            live.bad_words.consume_token(token)
        stop_token = generated >= p.min_tokens and (
            token in p.stop_token_ids or (token in self.tokenizer.stop_ids and not p.ignore_eos)
        )
        new = "" if stop_token else live.detokenizer.push(token)  # as vLLM: a stop token's text is never output
        live.text += new
        text = live.text
        stop_at = live.stops.feed(new)
        if generated < p.min_tokens:  # as vLLM: no stop counts before min_tokens (the device bans stop tokens)
            stop_at = None
        reason = stop = None
        if stop_at is not None:
            stop = text[stop_at : live.stops.seen]  # the string that matched (the matcher stopped at its end)
            text = text[:stop_at]
            reason = FinishReason.STOP
        elif stop_token:
            reason, stop = FinishReason.STOP, token
        elif live.matcher is not None and live.matcher.is_stopped():  # the grammar is complete
            reason = FinishReason.STOP
        elif generated >= r.output_len:
            reason = FinishReason.LENGTH
        if reason is None:  # hold back any tail that may begin a stop string
            text = text[: max(len(text) - live.stops.held, live.emitted_chars)]
        elif stop_at is None:
            text = live.text = live.text + live.detokenizer.flush()
        delta = text[live.emitted_chars :]
        live.emitted_chars = len(text)
        return RequestOutput(
            r.id,
            new_token_ids=[token],
            new_text=delta,
            finished=reason is not None,
            finish_reason=reason,
            cached_tokens=r.cached_tokens,
            stop=stop,
        )
