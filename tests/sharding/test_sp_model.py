"""CDSP chunks through the whole Llama over SP groups (engine/sp_prefill.py) equal the single-device forward
(small random Llama): one chunk over 1/2/4/8 devices in every layout, and a prefill whose chunks grow
2 -> 4 -> 8 devices with the history rebalanced in between, also with instances of 2 and 4 tensor-parallel
devices (KV heads split, and repeated when tp exceeds them). Checked: every layer's K/V in the stores (each
position exactly once) and each chunk's sampled (greedy) last token."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import CFG, random_params
from jaxserve.sampling_params import SamplingParams
from jaxserve.engine.sp_prefill import SPPrefill
from jaxserve.models.config import LlamaConfig
from jaxserve.models.llama import Llama
from jaxserve.pallas_kernels.reference import chunk_attention
from jaxserve.sharding import layouts, rebalance

# Attention itself matches to 1e-5 (test_sp_attention); through two random layers float32 rounding of the
# differently ordered reductions grows to ~1e-5 absolute on values of magnitude ~5.
TOL = dict(rtol=1e-4, atol=1e-4)
GREEDY = SamplingParams()
# 8 heads over 2 KV heads: tensor-parallel over 4 devices, each KV head held by two
CFG_8_2 = dataclasses.replace(CFG, num_heads=8, hidden_size=64, intermediate_size=128)


@dataclasses.dataclass(frozen=True)
class RecordingBackend:
    """Dense causal attention over the whole sequence that also keeps every layer's K/V (the reference)."""

    def __call__(self, q, k, v, positions, caches, layer, metadata):
        out, _ = chunk_attention(q[0], k[0], v[0], positions[0], positions[0])
        caches = tuple(
            jax.lax.dynamic_update_slice(c, x.astype(c.dtype), (layer, 0, 0, 0)) for c, x in zip(caches, (k, v))
        )
        return out[None].astype(q.dtype), caches


def reference(params, tokens, cfg: LlamaConfig = CFG):
    """Logits [n, vocab] and K/V [layers, n, kvh, d] of the whole sequence on one device."""
    n = len(tokens)
    shape = (cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    logits, (k, v) = Llama(cfg, RecordingBackend()).apply(
        params, jnp.asarray(tokens)[None], pos, (jnp.zeros(shape), jnp.zeros(shape)), None
    )
    return np.asarray(logits[0]), np.asarray(k), np.asarray(v)


def stored_kv(sp, instances):
    """Every stored row as position -> (k, v) [layers, kvh, d] in the model's head layout (as a transfer takes
    them), checking no position is held twice."""
    out = {}
    for i in instances:
        s = sp.stores[i]
        k, v = (np.asarray(x) for x in sp.take(i, 0, sp.cap))
        for row in s.valid_rows():
            assert int(s.pos[row]) not in out
            out[int(s.pos[row])] = (k[:, row], v[:, row])
    return out


def check_kv(sp, instances, ref_k, ref_v):
    held = stored_kv(sp, instances)
    assert sorted(held) == list(range(ref_k.shape[1]))
    np.testing.assert_allclose(np.stack([held[i][0] for i in sorted(held)], 1), ref_k, **TOL)
    np.testing.assert_allclose(np.stack([held[i][1] for i in sorted(held)], 1), ref_v, **TOL)


@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_one_chunk_over_an_sp_group_equals_single_device(devices, params, p, layout):
    tokens = np.random.default_rng(p).integers(0, CFG.vocab_size, 45)
    sp = SPPrefill(CFG, params, devices[:p], capacity=128, key_block=32, min_local=8, layout=layout)
    run = sp.run_chunk("r", tuple(d.id for d in devices[:p]), tokens, 0, GREEDY, 0)
    logits, ref_k, ref_v = reference(params, tokens)
    assert run.token() == int(np.argmax(logits[-1]))
    check_kv(sp, [d.id for d in devices[:p]], ref_k, ref_v)


@pytest.mark.parametrize(
    "cfg,tp,sizes",
    [(CFG, 1, (2, 4, 8)), (CFG, 2, (1, 2, 4)), (CFG_8_2, 4, (1, 2, 2))],
    ids=["tp1", "tp2", "tp4-repeated-kv"],
)
def test_chunks_on_growing_groups_with_rebalancing_equal_single_device(devices, params, cfg, tp, sizes):
    params = params if cfg is CFG else random_params(cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 61)
    logits, ref_k, ref_v = reference(params, tokens, cfg)
    sp = SPPrefill(cfg, params, devices, capacity=128, key_block=16, min_local=4, tp=tp)
    instances = sorted(sp.instances)
    start, group = 0, ()
    for size, p in zip((21, 27, 13), sizes):
        new = tuple(instances[:p])
        if group:
            before = [len(sp.stores[i].valid_rows()) for i in new]  # joiners hold none
            moved = sp.rebalance("r", new)
            held = [len(sp.stores[i].valid_rows()) for i in new]
            assert max(held) - min(held) <= 1  # balanced over the new, larger group
            assert moved == rebalance.moved_tokens(before) >= (p > len(group))  # only each one's excess moved
        group = new
        run = sp.run_chunk("r", group, tokens[start : start + size], start, GREEDY, 0)
        start += size
        assert run.token() == int(np.argmax(logits[start - 1]))
    check_kv(sp, instances, ref_k, ref_v)
    sp.release("r")
    assert all(s.owner is None and s.fill == 0 for s in sp.stores.values())
