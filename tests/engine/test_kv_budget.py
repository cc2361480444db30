"""--gpu_memory_utilization: the KV pool takes what the weights and the largest step leave of a device's share."""

from __future__ import annotations

import types

import jax

import pytest

import jaxserve
from jaxserve.config import CacheConfig
from jaxserve.engine import kv_budget
from jaxserve.models.config import llama3_8b

GIB = 2**30


def test_an_accelerators_pool_is_its_share_less_weights_and_activations():
    device = types.SimpleNamespace(
        platform="gpu", memory_stats=lambda: {"bytes_limit": 80 * GIB, "bytes_in_use": 17 * GIB}
    )
    act = kv_budget.activation_bytes(llama3_8b(), 512, 16, 256, 2)
    b = kv_budget.budget(device, 0.9, weights=8 * GIB, activations=act)  # tp=2: the runner holds half here
    # the loaded weights (in use now) stay while the runner places its copy and the pool: both count
    assert (b.limit, b.held, b.weights) == (int(0.9 * 80 * GIB), 17 * GIB, 8 * GIB)
    assert b.kv == b.limit - 17 * GIB - 8 * GIB - act
    assert 0.1 * GIB < act < 2 * GIB  # a 512-token step of an 8B model: hundreds of MB, not GBs
    assert kv_budget.activation_bytes(llama3_8b(), 1024, 16, 256, 2) > act
    assert "gpu_memory_utilization 0.9" in b.describe(1000, 0.9)


def test_a_cpu_pool_is_sized_from_the_process_budget(caplog, monkeypatch):
    """The pool is the share of the process's memory less what it holds (a fixed 16 GiB and 1 GiB here: the
    real ones move while a test suite runs) less the weights and a step's activations."""
    caplog.set_level("INFO", logger="absl")  # absl's own level: a command line run in this process may have raised it
    monkeypatch.setattr(kv_budget, "_cpu_memory", lambda: 16 * GIB)
    monkeypatch.setattr(kv_budget, "_resident", lambda: 1 * GIB)
    llm = jaxserve.LLM("random:tiny", gpu_memory_utilization=0.075, max_model_len=256, progress=False)
    cfg, kv = llm.config, llm.engine.kv
    token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    weights = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.params))
    act = kv_budget.activation_bytes(cfg, 512, 16, 256, 4)
    want = (int(0.075 * 16 * GIB) - GIB - weights - act) // token_bytes
    assert kv.num_blocks * kv.block_size - want in range(0, 2 * kv.block_size)  # rounded up to a block, + scratch
    assert any(f"KV pool: {want} tokens" in r.getMessage() for r in caplog.records)
    # measured once: an engine built later (a fail-over, beside the live one's pool) gets as many tokens
    assert llm.builder.kv_pool_tokens(llm.engine_config.parallel.instance) == llm.builder.kv_tokens


def test_too_small_a_share_is_refused_and_bad_values_too():
    with pytest.raises(ValueError, match="leaves no room for the KV cache"):
        jaxserve.LLM("random:tiny", gpu_memory_utilization=1e-6, progress=False)
    for bad in (0, 1.5, -0.1, True):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            CacheConfig(gpu_memory_utilization=bad)
