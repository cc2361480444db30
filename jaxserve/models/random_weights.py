"""Models with random weights, named `random:<shape>`: benchmarks of models too large to download here (e.g.
`LLM("random:llama3-8b", dtype="bfloat16")` on a GPU). The weights are drawn on the device in the serving dtype,
so an 8B model needs no host copy; the text side is a word-level tokenizer whose tokens are `<id>` (prompts are
token ids; outputs read as ids).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from tokenizers import Tokenizer, models, pre_tokenizers

from jaxserve.models.config import LlamaConfig, llama3_8b
from jaxserve.models.llama import param_shapes
from jaxserve.models.tokenizer import TextTokenizer

PREFIX = "random:"
SHAPES: dict[str, Callable[[], LlamaConfig]] = {
    "llama3-8b": llama3_8b,
    # small enough for a CPU test of the same path
    "tiny": lambda: LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    # the same, its positions reaching 1M tokens: long-context tests and tools/bench/long_context.py
    "tiny-1m": lambda: dataclasses.replace(SHAPES["tiny"](), max_position_embeddings=1 << 20),
}
STD = 0.02  # the initializer range of Llama checkpoints' configs


def is_random(model: str) -> bool:
    return model.startswith(PREFIX)


def config(model: str) -> LlamaConfig:
    shape = model[len(PREFIX) :]
    if shape not in SHAPES:
        raise ValueError(f"unknown random model {model!r}; one of {[PREFIX + s for s in SHAPES]}")
    return SHAPES[shape]()


def load(model: str, dtype: jnp.dtype, seed: int = 0) -> tuple[LlamaConfig, Any, TextTokenizer]:
    """Config, random device parameters (normal(0, STD); norm scales 1) and a tokenizer of `<id>` words."""
    cfg = config(model)
    shapes = param_shapes(cfg, dtype)
    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    params = [
        _draw(key, leaf.shape, leaf.dtype, any("norm" in str(getattr(k, "key", "")) for k in path))
        for (path, leaf), key in zip(leaves, keys)
    ]
    return cfg, jax.tree_util.tree_unflatten(tree, params), id_tokenizer(cfg.vocab_size)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _draw(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype, ones: bool) -> jax.Array:
    return jnp.ones(shape, dtype) if ones else STD * jax.random.normal(key, shape, dtype)


def id_tokenizer(vocab_size: int) -> TextTokenizer:
    """Token i is the word `<i>`: text in, ids out, and back, for any vocabulary size."""
    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return TextTokenizer(tok, bos_id=None, stop_ids=(), add_bos=False, chat_template=None, special_tokens={})
