"""Python API: `LLM(model=...)` with generate / stream / chat."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxserve import config
from jaxserve.cluster import lockstep
from jaxserve.cluster.build import build_cluster
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import scoring
from jaxserve.engine.build import EngineBuilder, enable_compilation_cache, load_model
from jaxserve.engine.engine import RequestOutput, TokenLogprob, token_logprobs
from jaxserve.engine.interface import ServingEngine
from jaxserve.models import registry
from jaxserve.sampling_params import SamplingParams

Messages = Sequence[dict[str, str]]


@dataclasses.dataclass
class Completion:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None  # one per token, when SamplingParams.logprobs asked for them


class LLM:
    """A model with its engine: the scheduler in sched/ drives one compiled step per iteration.

    Several generate/stream callers may interleave (e.g. two open streams): every engine step's outputs are
    routed to per-request queues, so no caller loses another's tokens. Not thread-safe: one thread drives it.
    """

    def __init__(self, model: str | EngineConfig = registry.DEFAULT_MODEL, *, progress: bool = True, **settings: Any):
        """model: a registered name, a .gguf file or a Hugging Face folder, or a whole EngineConfig. settings: any
        of EngineConfig's settings by name (e.g. max_num_seqs=32), over it; jaxserve/config.py says what each does.

        Start-up: with `warmup` (serve) every step program compiles here, and a cost model not cached is measured.
        Without it (generate, notebooks) a program compiles when a step first needs it, and steps are bounded by
        max_num_batched_tokens alone until a cost model is known. `quick_start` compiles only the first
        requests' programs here, the rest in the background. With prefill_instances > 0 the engine is a live
        cluster (cluster/): a CDSP prefill pool, then decode instances. The engine is built by `builder`
        (engine/build.py; a cluster's by cluster/build.py)."""
        base = model if isinstance(model, EngineConfig) else EngineConfig(model=ModelConfig(model=model))
        self.engine_config = cfg = config.replace(base, **settings)
        enable_compilation_cache()
        if jax.process_index() != lockstep.LEADER:
            raise RuntimeError("LLM runs on the leader (process 0); other processes call jaxserve.api.follow")
        loaded = load_model(cfg.model, on_host=jax.process_count() > 1)
        # the device layer: in one process made here; with several, made here and in every follower (lockstep)
        self.lockstep = lockstep.Leader(loaded.params) if jax.process_count() > 1 else None
        self.builder = EngineBuilder(cfg, loaded, self.lockstep.new if self.lockstep else None)
        self.model_name, self.config, self.tokenizer = loaded.name, loaded.config, loaded.tokenizer
        self.max_model_len = self.builder.max_model_len
        self.engine: ServingEngine = (
            build_cluster(self.builder, progress)
            if cfg.parallel.prefill_instances
            else self.builder.replica(None, progress)
        )
        if self.lockstep is not None:  # ready when every process is (followers compile their devices' programs)
            self.lockstep.sync()
        self._queues: dict[str, collections.deque[RequestOutput]] = {}

    def prepare_fail_over(self) -> None:
        """Compile the fail-over engine's step programs in the background (EngineBuilder.prepare_fail_over)."""
        self.builder.prepare_fail_over()

    def fail_over(self) -> ServingEngine:
        """After a follower process is lost: the engine becomes one replica on this process's first devices
        (the cluster's layout spanned the lost process), and the lockstep ends (nothing is published any more).
        What the old engine held is dropped. Returns the new engine."""
        self.lockstep = None  # the follower is gone: publish nothing (a stop would wait for no one)
        self.engine = self.builder.fail_over()
        return self.engine

    def lost(self, timeout: float) -> str | None:
        """Why a follower process counts as gone (no heartbeat for `timeout` seconds), or None."""
        return self.lockstep.lost(timeout) if self.lockstep is not None else None

    def close(self) -> None:
        """Release the followers (with several processes; they return from `follow`)."""
        if self.lockstep is not None:
            self.lockstep.stop()
            self.lockstep = None

    # ---- prompts ------------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def chat_prompt(
        self,
        messages: Messages,
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template (which carries its own BOS), with
        the tools it offers (OpenAI's shape) if any; text in a message that spells a control token stays plain
        text. add_generation_prompt: open the assistant's turn; continue_final_message: end inside the last
        message instead (a prefilled reply the model continues; needs add_generation_prompt false)."""
        return self.tokenizer.encode_chat(messages, add_generation_prompt, tools, continue_final_message)

    def render_chat(self, messages: Messages) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    # ---- driving the engine -------------------------------------------------------------------------
    def _submit(self, requests: Sequence[tuple[list[int], SamplingParams]]) -> list[list[str]]:
        """Queue all requests, or none: every one is checked before the first is added. Each request's ids: one
        per sample (SamplingParams.siblings), the later ones held back until the first has prefilled."""
        checked = [(self.engine.check_request(ids, sp), sp) for ids, sp in requests]
        rids = []
        for ids, sp in checked:
            first, *rest = sp.siblings()
            rids.append([self.engine.enqueue(ids, first)])
            rids[-1] += [self.engine.enqueue(ids, p, after=rids[-1][0]) for p in rest]
        self._queues.update({rid: collections.deque() for group in rids for rid in group})
        return rids

    def _next_output(self, rid: str) -> RequestOutput:
        """This request's next output, stepping the engine (for every request) until there is one."""
        queue = self._queues[rid]
        while not queue:
            if not self.engine.has_unfinished():
                raise RuntimeError(f"request {rid} is no longer in the engine")
            for out in self.engine.step():
                if out.request_id in self._queues:
                    self._queues[out.request_id].append(out)
        out = queue.popleft()
        if out.error is not None:
            raise RuntimeError(f"request {rid} failed: {out.error}")
        return out

    def _forget(self, rids: Sequence[str]) -> None:
        """Drop the queues of rids and abort whichever of them is still in the engine."""
        for rid in rids:
            self._queues.pop(rid, None)
            self.engine.abort(rid)

    def _stream(self, ids: list[int], params: SamplingParams) -> Iterator[RequestOutput]:
        if params.n > 1 or params.best_of is not None:
            raise ValueError("stream() yields one sample: n and best_of are for generate()")
        ((rid,),) = self._submit([(ids, params)])
        try:
            while True:
                out = self._next_output(rid)
                yield out
                if out.finished:
                    return
        finally:  # also when the consumer stops early
            self._forget([rid])

    # ---- generation ---------------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[Completion]:
        """Generate for every prompt (continuously batched); results in prompt order, SamplingParams.n of them
        per prompt (with best_of: the n of the highest total logprob, best first)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        prepared = [self._prompt_ids(p) for p in prompts]
        groups = self._submit([(ids, sp) for (_, ids), sp in zip(prepared, plist)])
        rids = [rid for group in groups for rid in group]
        outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in rids}
        try:
            for rid in tqdm(rids, disable=not progress, desc="generate"):
                outs = outputs[rid]
                while not outs or not outs[-1].finished:
                    outs.append(self._next_output(rid))
        finally:
            self._forget(rids)  # aborts whatever an exception left unfinished
        completions = []
        for (text_prompt, ids), group, sp in zip(prepared, groups, plist):
            samples = [
                Completion(
                    text_prompt,
                    ids,
                    "".join(o.new_text for o in outs),
                    [t for o in outs for t in o.new_token_ids],
                    outs[-1].finish_reason.value,
                    [x for o in outs for x in o.logprobs or ()],
                )
                for outs in (outputs[rid] for rid in group)
            ]
            for i in sp.kept([c.logprobs for c in samples]):
                completions.append(
                    dataclasses.replace(samples[i], logprobs=samples[i].logprobs if sp.logprobs is not None else None)
                )
        return completions

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield this request's new tokens and text as they are produced; aborts the request if abandoned.

        Bad input raises here; the request is queued when iteration starts."""
        _, ids = self._prompt_ids(prompt)
        params = params or SamplingParams()
        return self._stream(self.engine.check_request(ids, params), params)

    def chat(
        self,
        conversations: Messages | Sequence[Messages],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Reply to one conversation (a list of {'role', 'content'} messages) or to several."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        texts = [self.render_chat(c) for c in conversations]
        completions = self.generate([self.chat_prompt(c) for c in conversations], params)
        plist = params if isinstance(params, Sequence) else [params or SamplingParams()] * len(texts)
        for c, text in zip(completions, (t for t, sp in zip(texts, plist) for _ in range(sp.n))):
            c.prompt = text
        return completions

    def prompt_logits(self, prompt: str | Sequence[int]) -> np.ndarray:
        """Logits [tokens, vocab] of every prompt position: a scoring pass outside the serving path."""
        _, ids = self._prompt_ids(prompt)
        ids = self.engine.check_request(ids, SamplingParams())
        return scoring.prompt_logits(self.config, self.builder.params, self.builder.model.dtype, ids)

    def prompt_logprobs(self, prompt: str | Sequence[int], k: int = 0) -> list[TokenLogprob | None]:
        """Each prompt token's logprob given the ones before it, with the k most likely there (k <= 20); None for
        the first token, which has nothing before it. A scoring pass outside the serving path (what echo with
        logprobs returns, and what evaluation harnesses score by)."""
        _, ids = self._prompt_ids(prompt)
        ids = self.engine.check_request(ids, SamplingParams(logprobs=k))
        lp, ranks = scoring.prompt_logprobs(self.config, self.builder.params, self.builder.model.dtype, ids)
        return [None] + [x._replace(rank=int(r)) for x, r in zip(token_logprobs(ids[1:], lp, k), ranks)]


def follow(model: ModelConfig = ModelConfig()) -> None:
    """A follower's life (jax.distributed, every process but the leader): load the same weights as the leader's
    LLM, then make the device-layer calls the leader publishes until it stops (cluster/lockstep.py)."""
    enable_compilation_cache()
    lockstep.follow(load_model(model, on_host=True).params)
