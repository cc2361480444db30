"""The batched sampler that runs on the device after each step's forward.

A step's rows carry their sampling parameters (`Sampling`). Penalties, logit_bias and min_tokens read a request's
own history, kept on the device in a slot per request (`Slots`: its generated tokens' counts, its prompt's
tokens, its bias, the tokens min_tokens holds back); the sampler counts each kept token into its row's slot, so
the history is right however far the host lags. Logprobs are of the model's own distribution (before penalties
and temperature, as vLLM's default), the chosen token's and the MAX_LOGPROBS most likely. The extra sampler also
takes each row's mask of allowed tokens (structured output: engine/grammar.py fills it on the host).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Key

MAX_LOGPROBS = 20  # top logprobs a row may ask for (OpenAI's limit)


class Sampling(NamedTuple):
    """Each row's sampling parameters, as the step's arrays hold them."""

    temperature: Float[Array, " r"]
    top_k: Int[Array, " r"]
    top_p: Float[Array, " r"]
    seeds: Int[Array, " r"]
    counters: Int[Array, " r"]
    min_p: Float[Array, " r"]
    slot: Int[Array, " r"]  # the request's slot (-1: none, or a token the request does not keep)
    presence: Float[Array, " r"]
    frequency: Float[Array, " r"]
    repetition: Float[Array, " r"]
    min_tokens: Int[Array, " r"]  # the slot's banned tokens are held back while counters < min_tokens


class Slots(NamedTuple):
    """What sampling remembers of each request that needs it, one row per slot."""

    counts: Int[Array, "s v"]  # generated tokens, counted
    prompt: Bool[Array, "s v"]  # tokens of the prompt (the repetition penalty's too)
    bias: Float[Array, "s v"]  # logit_bias
    banned: Bool[Array, "s v"]  # EOS and stop_token_ids, held back until min_tokens


class Logprobs(NamedTuple):
    chosen: Float[Array, " r"]
    top: Float[Array, "r k"]  # the MAX_LOGPROBS highest, best first
    top_ids: Int[Array, "r k"]


def sample_step(
    logits: Float[Array, "r v"], p: Sampling, slots: Slots | None, mask: Int[Array, "r w"] | None = None, *, kind: str
) -> tuple[Int[Array, " r"], Slots | None, Logprobs | None]:
    """One token per row by `kind` (batch.SAMPLER_KINDS: argmax alone when every row is greedy; a draw, cut by
    top-k / top-p or not). With `slots` (the extra sampler): penalties, logit_bias and min_tokens first, then
    the `mask`, the kept tokens counted into their slots, and the logprobs."""
    raw = logits
    if slots is not None:
        logits = adjust(logits, p, slots)
    if mask is not None:
        logits = allowed(logits, mask)
    if kind == "greedy":
        tokens = argmax(logits)
    else:
        tokens = sample(logits, p.temperature, p.top_k, p.top_p, p.seeds, p.counters, cut=kind == "cut", min_p=p.min_p)
    if slots is None:
        return tokens, None, None
    counts = slots.counts.at[jnp.maximum(p.slot, 0), tokens].add((p.slot >= 0).astype(slots.counts.dtype))
    return tokens, slots._replace(counts=counts), logprobs_of(raw, tokens)


def adjust(logits: Float[Array, "r v"], p: Sampling, slots: Slots) -> Float[Array, "r v"]:
    """vLLM's order: logit_bias, min_tokens' ban, then the repetition penalty (over the prompt's and the
    generated tokens: positive logits divided, negative multiplied), the frequency penalty (times each
    generated token's count) and the presence penalty (once per generated token). Rows without a slot pass."""
    has = (p.slot >= 0)[:, None]
    s = jnp.maximum(p.slot, 0)
    counts = slots.counts[s].astype(logits.dtype)
    x = logits + jnp.where(has, slots.bias[s], 0.0)
    x = jnp.where(has & (p.counters < p.min_tokens)[:, None] & slots.banned[s], -jnp.inf, x)
    seen = has & (slots.prompt[s] | (counts > 0))
    rep = p.repetition[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
    penalty = p.frequency[:, None] * counts + p.presence[:, None] * (counts > 0)
    return jnp.where(has, x - penalty, x)


def allowed(logits: Float[Array, "r v"], mask: Int[Array, "r w"]) -> Float[Array, "r v"]:
    """-inf where a row's bitmask clears the token's bit (token i: bit i % 32 of word i // 32)."""
    ids = jnp.arange(logits.shape[-1])
    bits = jnp.right_shift(mask[:, ids // 32], (ids % 32).astype(mask.dtype)) & 1
    return jnp.where(bits != 0, logits, -jnp.inf)


def logprobs_of(logits: Float[Array, "r v"], tokens: Int[Array, " r"]) -> Logprobs:
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top, ids = jax.lax.top_k(lp, MAX_LOGPROBS)
    return Logprobs(jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0], top, ids.astype(jnp.int32))


def sample(
    logits: Float[Array, "b v"],
    temperature: Float[Array, " b"],
    top_k: Int[Array, " b"],
    top_p: Float[Array, " b"],
    seeds: Int[Array, " b"],
    counters: Int[Array, " b"],
    *,
    cut: bool,
    min_p: Float[Array, " b"] | None = None,
) -> Int[Array, " b"]:
    """One token per row. A row's randomness depends only on (seed, counter), never on its batch neighbours.

    Nothing branches on the device (a branch makes a GPU wait for the host): every row's greedy and drawn tokens
    are both computed, and the draw is `gumbel_max`'s, a few passes over the vocabulary. `cut` (static: the host
    picks the program) adds the top-k / top-p cut, which sorts the whole vocabulary."""
    greedy = argmax(logits)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    if cut:
        scaled = _cut(scaled, top_k, top_p)
    if min_p is not None:  # p >= min_p p_max, as logits: log(0) = -inf keeps every token
        floor = jnp.max(scaled, axis=-1) + jnp.log(min_p)
        scaled = jnp.where(scaled >= floor[:, None], scaled, -jnp.inf)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds.astype(jnp.uint32), counters)
    drawn = jnp.minimum(gumbel_max(scaled, keys), logits.shape[-1] - 1)
    return jnp.where(temperature > 0, drawn, greedy)


BLOCK = 256


def argmax(logits: Float[Array, "b v"]) -> Int[Array, " b"]:
    """jnp.argmax over the last axis (the first of equal maxima; the first NaN, unless a +inf comes before it), in
    two levels: the best block of BLOCK tokens, then the best token in it. XLA's CPU backend runs a one-level
    argmax (a variadic reduce) over SmolLM2's 49,152 tokens far slower than these two levels (docs/BENCHMARKS.md,
    "Generation vs Hugging Face transformers")."""
    b, v = logits.shape
    blocks = -(-v // BLOCK)
    padded = jnp.pad(logits, ((0, 0), (0, blocks * BLOCK - v)), constant_values=-jnp.inf)
    padded = padded.reshape(b, blocks, BLOCK)
    best = jnp.argmax(jnp.where(jnp.isnan(padded), jnp.inf, padded).max(-1), axis=-1)  # XLA's CPU max drops NaN
    inside = jnp.take_along_axis(padded, best[:, None, None], axis=1)[:, 0]
    return (best * BLOCK + jnp.argmax(inside, axis=-1)).astype(jnp.int32)


def gumbel_max(scaled: Float[Array, "b v"], keys: Key[Array, " b"]) -> Int[Array, " b"]:
    """Per row, token i with probability softmax(scaled)_i: the argmax of scaled plus Gumbel noise, in two levels.
    A block of BLOCK tokens is drawn by its log-mass (logsumexp) plus one Gumbel number per block, then a
    token inside it by its logit plus one per token: exact up to float32 Gumbel numbers (mode "high": their
    large values, which draw the far tail, are resolved too), and about 450 random numbers a row, not 49,152.

    Why not a running sum's inverse CDF: logits that differ in their last bits (a matmul blocked differently at
    another batch shape) shift the running sum, and a uniform number near a tail token's edge then lands on its
    neighbour, a few draws in a hundred. Here a draw moves only when its two best noisy scores are as close as
    the logits' difference (tests/engine/test_sampling.py: 1 draw in 4,000 at 1e-4)."""
    b, v = scaled.shape
    nb = -(-v // BLOCK)
    blocks = jnp.pad(scaled, ((0, 0), (0, nb * BLOCK - v)), constant_values=-jnp.inf).reshape(b, nb, BLOCK)
    pick, inner = jax.vmap(lambda k: tuple(jax.random.split(k)))(keys)
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (nb,), jnp.float32, mode="high"))(pick)
    j = jnp.argmax(jax.nn.logsumexp(blocks, axis=-1) + noise, axis=-1)
    inside = jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0]  # [b, BLOCK]
    k = jnp.argmax(
        inside + jax.vmap(lambda k: jax.random.gumbel(k, (BLOCK,), jnp.float32, mode="high"))(inner), axis=-1
    )
    return (j * BLOCK + k).astype(jnp.int32)


def _cut(scaled: Float[Array, "b v"], top_k: Int[Array, " b"], top_p: Float[Array, " b"]) -> Float[Array, "b v"]:
    """-inf outside each row's top-k and top-p nucleus (no cut where top_k is 0 and top_p is 1)."""
    vocab = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
    desc = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted entry
    kept = jnp.maximum(jnp.sum(before < top_p[:, None], axis=-1), 1)
    pth = jnp.take_along_axis(desc, (kept - 1)[:, None], axis=-1)
    pth = jnp.where(top_p[:, None] < 1.0, pth, -jnp.inf)  # the running sum may round past 1 before the tail
    return jnp.where(scaled >= jnp.maximum(kth, pth), scaled, -jnp.inf)
