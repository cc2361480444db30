"""The serving engine: continuous batching over a paged KV cache with chunked prefill.

Each `step()` runs at most one prefill chunk (the oldest request still prefilling) and one decode step for
every request that has finished its prefill; requests join and leave between steps. When the block pool runs
dry the newest running request is preempted: its blocks return to the pool and it later recomputes its prompt
and the tokens it already generated, so its output is unchanged.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import random
from typing import Sequence

import numpy as np

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.kv_cache import BlockPool, OutOfBlocks
from jaxserve.engine.sampling import SamplingParams
from jaxserve.engine.steps import Row, StepRunner
from jaxserve.models.tokenizer import TextTokenizer


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"


@dataclasses.dataclass
class RequestOutput:
    """What one step produced for one request: new tokens and the text they complete."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    detokenizer: IncrementalDetokenizer
    output_ids: list[int] = dataclasses.field(default_factory=list)
    block_table: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    text: str = ""  # decoded output so far
    emitted_chars: int = 0
    finish_reason: FinishReason | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefilling(self) -> bool:
        # The last known token is fed by the decode step; everything before it is prefill.
        return self.num_cached < len(self.all_ids) - (1 if self.output_ids else 0)


class Engine:
    def __init__(self, runner: StepRunner, pool: BlockPool, tokenizer: TextTokenizer, *, max_model_len: int,
                 max_num_seqs: int = 16, prefill_chunk: int = 512):
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1 or prefill_chunk & (prefill_chunk - 1):
            raise ValueError(f"prefill_chunk must be a power of two, got {prefill_chunk!r}")
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        if max_model_len > pool.capacity * pool.block_size:
            raise ValueError(f"max_model_len {max_model_len} exceeds the KV cache's "
                             f"{pool.capacity * pool.block_size} tokens; give it more blocks")
        self.runner = runner
        self.pool = pool
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk = prefill_chunk
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admission order: the last is preempted first
        self._ids = itertools.count()
        self._seed_rng = random.Random()

    # ---- requests -------------------------------------------------------------------------------------
    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as a list of ints, or ValueError naming what is wrong with the request."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in prompt_ids):
            raise ValueError("a prompt must be a string or a list of integer token ids")
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.runner.model.cfg.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context holds {self.max_model_len} "
                             "(prompt plus at least one generated token)")
        return ids

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None) -> str:
        return self.enqueue(self.check_request(prompt_ids, params), params, request_id)

    def enqueue(self, ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request whose prompt and params check_request already passed; checking is O(prompt), so a
        caller that checked first (to refuse bad input early) does not pay for a long prompt twice."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(32)
        self.waiting.append(Request(rid, ids, params, seed, IncrementalDetokenizer(self.tokenizer, ids)))
        return rid

    def abort(self, request_id: str) -> bool:
        for queue in (self.running, self.waiting):
            for r in queue:
                if r.request_id == request_id:
                    queue.remove(r)
                    self.pool.release(r.block_table)
                    return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one iteration --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._admit()
        outputs: list[RequestOutput] = []
        prefill = next((r for r in self.running if r.prefilling), None)
        if prefill is not None:
            outputs += self._run_prefill_chunk(prefill)
        decoding = [r for r in self.running if not r.prefilling]
        if decoding:
            outputs += self._run_decode(decoding)
        return outputs

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            # Admit only if the first chunk fits now; later chunks grow the table as they run.
            first = min(len(r.all_ids), self.prefill_chunk)
            if self.pool.blocks_for(first) > self.pool.num_free:
                break
            self.running.append(self.waiting.popleft())

    def _reserve(self, r: Request, tokens: int) -> bool:
        """Grow r's blocks to cover `tokens`, preempting newer requests if needed; False if r itself was."""
        while True:
            try:
                self.pool.grow(r.block_table, tokens)
                return True
            except OutOfBlocks:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is r:
                    return False

    def _preempt(self, r: Request) -> None:
        self.running.remove(r)
        self.pool.release(r.block_table)
        r.num_cached = 0
        self.waiting.appendleft(r)

    def _run_prefill_chunk(self, r: Request) -> list[RequestOutput]:
        ids = r.all_ids
        end = len(ids) - (1 if r.output_ids else 0)
        chunk = ids[r.num_cached: min(end, r.num_cached + self.prefill_chunk)]
        if not self._reserve(r, r.num_cached + len(chunk)):
            return []
        token = self.runner.step([Row(chunk, r.num_cached, r.block_table, r.params, r.seed, len(r.output_ids))])[0]
        r.num_cached += len(chunk)
        if r.prefilling or r.output_ids:
            # Mid-prompt chunk, or a recomputed request whose next token is fed by the decode step.
            return []
        return [self._append(r, int(token))]

    def _run_decode(self, batch: list[Request]) -> list[RequestOutput]:
        for r in batch:
            if r in self.running:  # reserving for an earlier row may have preempted this one
                self._reserve(r, r.num_cached + 1)
        batch = [r for r in batch if r in self.running]
        if not batch:
            return []
        rows = [Row([r.output_ids[-1]], r.num_cached, r.block_table, r.params, r.seed, len(r.output_ids))
                for r in batch]
        tokens = self.runner.step(rows)
        outputs = []
        for r, token in zip(batch, tokens):
            r.num_cached += 1
            outputs.append(self._append(r, int(token)))
        return outputs

    # ---- stopping and text ----------------------------------------------------------------------------
    def _append(self, r: Request, token: int) -> RequestOutput:
        p = r.params
        r.output_ids.append(token)
        searched = max(len(r.text) - max((len(s) for s in p.stop), default=0), 0)
        r.text += r.detokenizer.push(token)
        text = r.text
        stop_at = min((i for s in p.stop if (i := text.find(s, searched)) >= 0), default=-1)
        if stop_at >= 0:
            text = text[:stop_at]
            r.finish_reason = FinishReason.STOP
        elif token in p.stop_token_ids or (token in self.tokenizer.stop_ids and not p.ignore_eos):
            r.finish_reason = FinishReason.STOP
        elif len(r.output_ids) >= p.max_tokens or len(r.all_ids) >= self.max_model_len:
            r.finish_reason = FinishReason.LENGTH
        if r.finish_reason is None:
            # Hold back any tail that may begin a stop string.
            held = max((k for s in p.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[:max(len(text) - held, r.emitted_chars)]
        else:
            if stop_at < 0:
                text = r.text = r.text + r.detokenizer.flush()
            self.pool.release(r.block_table)
            self.running.remove(r)  # at once: a finished request must never be chosen for preemption
        delta = text[r.emitted_chars:]
        r.emitted_chars = len(text)
        return RequestOutput(r.request_id, [token], delta, r.finish_reason is not None, r.finish_reason)
