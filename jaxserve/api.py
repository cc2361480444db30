"""Python API: `LLM(model=...)` with generate / stream / chat."""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from jaxserve.engine.engine import Engine, RequestOutput
from jaxserve.engine.kv_cache import BlockPool, allocate_caches
from jaxserve.engine.sampling import SamplingParams
from jaxserve.engine.steps import Row, StepRunner
from jaxserve.models import registry
from jaxserve.models.config import LlamaConfig
from jaxserve.models.gguf_loader import load_gguf
from jaxserve.models.hf_loader import load_hf_dir
from jaxserve.models.llama import Llama
from jaxserve.models.tokenizer import TextTokenizer

Messages = Sequence[dict[str, str]]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class Completion:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str


def _converted_dir(source: pathlib.Path, dtype: str) -> pathlib.Path:
    """Cache folder for converted weights, keyed by the source file(s) identity and dtype."""
    files = [source] if source.is_file() else sorted(source.glob("*.safetensors"))
    ident = "|".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    digest = hashlib.sha256(f"{ident}|{dtype}".encode()).hexdigest()[:16]
    return registry.cache_dir() / "converted" / f"{source.stem}-{dtype}-{digest}"


def _load(source: pathlib.Path, dtype: str) -> tuple[LlamaConfig, Any, TextTokenizer]:
    """Config, device params and tokenizer. The first start converts the source and saves the result (weights
    with orbax, config and tokenizer as JSON); later starts restore it without reading the source again."""
    ckpt_dir = _converted_dir(source, dtype)
    checkpointer = ocp.StandardCheckpointer()
    if (ckpt_dir / "params").exists() and (ckpt_dir / "config.json").exists():
        cfg = LlamaConfig.from_json((ckpt_dir / "config.json").read_text())
        abstract = jax.eval_shape(lambda: _init_shapes(cfg, _DTYPES[dtype]))
        return cfg, checkpointer.restore(ckpt_dir / "params", abstract), TextTokenizer.load(ckpt_dir)
    if source.is_file():
        cfg, host_params, gguf_file = load_gguf(source)
        tokenizer = TextTokenizer.from_gguf(gguf_file)
    else:
        cfg, host_params = load_hf_dir(source)
        tokenizer = TextTokenizer.from_hf_dir(source)
    params = jax.tree.map(lambda x: jnp.asarray(x, _DTYPES[dtype]), host_params)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    checkpointer.save(ckpt_dir / "params", params, force=True)
    checkpointer.wait_until_finished()
    tokenizer.save(ckpt_dir)
    (ckpt_dir / "config.json").write_text(cfg.to_json())  # written last: marks the folder complete
    return cfg, params, tokenizer


def _init_shapes(cfg: LlamaConfig, dtype) -> Any:
    model = Llama(cfg, dtype)
    caches = allocate_caches(cfg, 1, 1, dtype)
    one = jnp.zeros((1, 1), jnp.int32)
    return model.init(jax.random.key(0), one, one, caches, one, one, jnp.ones((1,), jnp.int32))


def _enable_compilation_cache() -> None:
    """Keep compiled step functions on disk so a restart skips XLA compilation (unless the user set a cache)."""
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(registry.cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


class LLM:
    """A model with its engine. Not thread-safe: one caller drives it at a time."""

    def __init__(self, model: str = registry.DEFAULT_MODEL, *, dtype: str = "float32",
                 max_model_len: int | None = None, kv_cache_tokens: int | None = None, block_size: int = 16,
                 max_num_seqs: int = 16, prefill_chunk: int = 512):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        source = registry.resolve(model)
        _enable_compilation_cache()
        self.model_name = model
        self.config, params, self.tokenizer = _load(source, dtype)
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        kv_tokens = kv_cache_tokens or 2 * self.max_model_len
        num_blocks = -(-kv_tokens // block_size) + 1  # + the scratch block
        pool = BlockPool(num_blocks, block_size)
        runner = StepRunner(Llama(self.config, _DTYPES[dtype], block_size), params,
                            allocate_caches(self.config, num_blocks, block_size, _DTYPES[dtype]), block_size)
        self.engine = Engine(runner, pool, self.tokenizer, max_model_len=self.max_model_len,
                             max_num_seqs=max_num_seqs, prefill_chunk=prefill_chunk)

    # ---- prompts ------------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not all(isinstance(t, (int, np.integer)) for t in ids):
            raise ValueError("a prompt must be a string or a list of token ids")
        return None, ids

    # ---- generation ---------------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: bool = False) -> list[Completion]:
        """Generate for every prompt (continuously batched); results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        prepared = [self._prompt_ids(p) for p in prompts]
        rids = [self.engine.add_request(ids, sp) for (_, ids), sp in zip(prepared, plist)]
        outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in rids}
        with tqdm(total=len(rids), disable=not progress, desc="generate") as bar:
            done = 0
            while done < len(rids):
                for out in self.engine.step():
                    if out.request_id in outputs:
                        outputs[out.request_id].append(out)
                        done += out.finished
                        bar.update(out.finished)
        return [Completion(text_prompt, ids, "".join(o.new_text for o in outputs[rid]),
                           [t for o in outputs[rid] for t in o.new_token_ids], outputs[rid][-1].finish_reason.value)
                for (text_prompt, ids), rid in zip(prepared, rids)]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield this request's new tokens and text as they are produced; aborts the request if abandoned."""
        _, ids = self._prompt_ids(prompt)
        rid = self.engine.add_request(ids, params or SamplingParams())
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort(rid)

    def render_chat(self, messages: Messages) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def chat(self, conversations: Messages | Sequence[Messages],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Reply to one conversation (a list of {'role', 'content'} messages) or to several."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.render_chat(c) for c in conversations], params)

    def prompt_logits(self, prompt: str | Sequence[int]) -> np.ndarray:
        """Logits [tokens, vocab] of every prompt position (a scoring pass; the cache blocks are returned)."""
        _, ids = self._prompt_ids(prompt)
        if not ids or len(ids) > self.max_model_len:
            raise ValueError(f"prompt must have 1..{self.max_model_len} tokens, got {len(ids)}")
        pool, table = self.engine.pool, []
        pool.grow(table, len(ids))
        try:
            return self.engine.runner.logits(Row(ids, 0, table, SamplingParams(), 0, 0))
        finally:
            pool.release(table)
