"""The Llama forward with ring attention over SP groups equals the single-device forward (small random Llama):
one chunk over 1/2/4/8 devices in every layout, and a CDSP prefill whose chunks grow 2 -> 4 -> 8 devices with
the history rebalanced in between."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.scoring import DenseCausalBackend, prompt_logits
from jaxserve.engine.sp_prefill import ShardedHistory, move_to, prefill_chunk
from jaxserve.models.config import LlamaConfig
from jaxserve.models.llama import Llama
from jaxserve.pallas_kernels.reference import NO_POSITION
from jaxserve.sharding import layouts
from jaxserve.sharding.mesh import make_mesh

CFG = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6, num_kv_heads=2,
                  head_dim=8, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False)
# Attention itself matches to 1e-5 (test_sp_attention); through two random layers float32 rounding of the
# differently ordered reductions grows to ~1e-5 absolute on logits of magnitude ~5.
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def params():
    one = jnp.zeros((1, 1), jnp.int32)
    variables = Llama(CFG, DenseCausalBackend()).init(jax.random.key(1), one, one, (), one[0])
    # Flax's default init leaves norms at 1: randomise everything so every weight matters (norm weights, stacked
    # [layers, e] in the scanned layers or [e] for the final norm, at scale 1; matrices at 0.3).
    leaves, tree = jax.tree_util.tree_flatten_with_path(variables)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    return jax.tree.unflatten(tree, [jax.random.normal(k, x.shape) * (1.0 if path[-1].key == "weight" else 0.3)
                                     for k, (path, x) in zip(keys, leaves)])


def single_device_logits(params, tokens):
    return prompt_logits(CFG, params, jnp.float32, tokens.tolist())


@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_one_chunk_over_an_sp_group_equals_single_device(devices, params, p, layout):
    tokens = np.random.default_rng(p).integers(0, CFG.vocab_size, 45)
    history = ShardedHistory.empty(CFG, make_mesh(devices[:p]))
    logits, history = prefill_chunk(CFG, params, history, tokens, 0, layout)
    np.testing.assert_allclose(logits, single_device_logits(params, tokens), **TOL)
    assert history.tokens == len(tokens)


def test_chunks_on_growing_groups_with_rebalancing_equal_single_device(devices, params):
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, 61)
    history = ShardedHistory.empty(CFG, make_mesh(devices[:2]))
    pieces, start = [], 0
    for size, p in ((21, 2), (27, 4), (13, 8)):
        if p != history.mesh.shape["sp"]:
            history = move_to(history, make_mesh(devices[:p]))
            held = (history.pos != NO_POSITION).sum(axis=1)
            assert held.max() - held.min() <= 1  # balanced over the new, larger group
        logits, history = prefill_chunk(CFG, params, history, tokens[start:start + size], start)
        pieces.append(logits)
        start += size
    np.testing.assert_allclose(np.concatenate(pieces), single_device_logits(params, tokens), **TOL)
    assert sorted(history.pos[history.pos != NO_POSITION].tolist()) == list(range(len(tokens)))
