"""The batched sampler that runs inside the compiled step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def sample(
    logits: Float[Array, "b v"],
    temperature: Float[Array, "b"],
    top_k: Int[Array, "b"],
    top_p: Float[Array, "b"],
    seeds: Int[Array, "b"],
    counters: Int[Array, "b"],
    *,
    cut: bool,
) -> Int[Array, "b"]:
    """One token per row. A row's randomness depends only on (seed, counter), never on its batch neighbours.

    Nothing branches on the device (a branch makes a GPU wait for the host): every row's greedy and drawn tokens
    are both computed, and the draw is one uniform number per row against the softmax's running sum (inverse
    CDF), a few passes over the vocabulary. `cut` (static: the host picks the program) adds the top-k / top-p
    cut, which sorts the whole vocabulary."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    if cut:
        scaled = _cut(scaled, top_k, top_p)
    probs = jax.nn.softmax(scaled, axis=-1)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds.astype(jnp.uint32), counters)
    # in (0, 1): a zero would pick a leading token of probability zero
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32, minval=2.0**-24))(keys)
    drawn = jnp.minimum(inverse_cdf(probs, u), logits.shape[-1] - 1)
    return jnp.where(temperature > 0, drawn, greedy)


CDF_BLOCK = 256


def inverse_cdf(probs: Float[Array, "b v"], u: Float[Array, "b"]) -> Int[Array, "b"]:
    """Per row, the first token where the running sum of probs passes u x the total. In two levels: the running
    sum over blocks of CDF_BLOCK tokens picks a block, then the running sum inside it. A running sum over the
    whole vocabulary (49,152 tokens) took 11.3 ms for 16 rows on a 2-core CPU, this 3.3 ms (one row: 1.5 and
    0.5 ms)."""
    b, v = probs.shape
    nb = -(-v // CDF_BLOCK)
    blocks = jnp.pad(probs, ((0, 0), (0, nb * CDF_BLOCK - v))).reshape(b, nb, CDF_BLOCK)
    ends = jnp.cumsum(blocks.sum(-1), axis=-1)  # [b, nb]: the running sum at each block's end
    target = u * ends[:, -1]
    j = jnp.minimum(jnp.sum(ends < target[:, None], axis=-1), nb - 1)
    before = jnp.where(j > 0, jnp.take_along_axis(ends, jnp.maximum(j - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    inside = jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0]  # [b, CDF_BLOCK]
    k = jnp.sum(before[:, None] + jnp.cumsum(inside, axis=-1) < target[:, None], axis=-1)
    return (j * CDF_BLOCK + k).astype(jnp.int32)


def _cut(scaled: Float[Array, "b v"], top_k: Int[Array, "b"], top_p: Float[Array, "b"]) -> Float[Array, "b v"]:
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
