"""LLM's layout arguments against the single-device engine: they build, profile and serve a cluster of
tensor-parallel instances, and serve one instance alone, tensor-parallel or as pipeline stages of KV-parallel
sets. Apart from test_live_cluster.py so that
its module's cluster is freed first (the folder's memory peak)."""

from __future__ import annotations

import numpy as np

import jaxserve
from jaxserve.models import ggml
from conftest import LAYERS, prompt, serve
from jaxserve.cluster.engine import ClusterEngine
from jaxserve.models.gguf_loader import GGUFFile
from jaxserve.models.tokenizer import TextTokenizer
from jaxserve.sampling_params import SamplingParams
from jaxserve.sched.cost_models import TetrisPrefill
from jaxserve.sched.improvement_rate import AdaptiveCDSP, RateTable
from tiny_models import CLUSTER_MODEL, gguf_tensors, write_gguf, write_tiny_model

GREEDY = SamplingParams(max_tokens=24)


def test_llm_with_a_layout_serves_through_a_cluster_it_profiled(model, llm, tmp_path):
    """LLM(tp=..., prefill_instances=...) (what serve/generate's layout flags build), in instances of 3
    tensor-parallel devices (the model's 6 heads over 3 KV heads: 2 and 1 per device), the pool CSPS's (SP-NTP
    with CSA, dropping nothing; test_live_cluster.py serves CDSP's ring): the pool's Eq. (1) is measured and
    written where asked, and generation through the cluster (a prefill pool of 2 instances, one decode instance
    KV-parallel over 2, 12 devices in all) gives the single-device engine's greedy tokens, and serves them (the
    openai client over HTTP) with its events in /metrics. The planner's improvement rate follows the load through
    a table (--improvement_rates): the first arrivals, at once, read as a high rate."""
    path, rates = tmp_path / "eq1.json", tmp_path / "rates.json"
    rates.write_text(RateTable((0.0, 1.0), (0.3, 0.05)).to_json())
    clustered = jaxserve.LLM(
        model,
        max_model_len=1024,
        kv_cache_tokens=1024,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        tp=3,
        prefill_instances=2,
        decode_instances=1,
        decode_kvp=2,
        min_chunk=256,
        sp_attention="sp_ntp",
        sparse_attention=0.0,
        prefill_profile=str(path),
        improvement_rates=str(rates),
        quick_start=False,
        progress=False,
    )
    adaptive = clustered.engine.planner
    assert isinstance(adaptive, AdaptiveCDSP) and adaptive.planner.improvement_rate == 0.3  # no load seen yet
    assert type(clustered.engine.prefill.backend(2)).__name__ == "StoreCSABackend"
    assert isinstance(clustered.engine, ClusterEngine)
    assert [len(i) for i in clustered.engine.prefill.instances.values()] == [3, 3]
    assert len(clustered.engine.decoders[0].engine.runner.devices) == 6
    fit = TetrisPrefill.from_json(path.read_text())
    # measured on a loaded CPU, where a 64- and a 512-token chunk of this tiny model take about the same time:
    # what the file must hold is a fit for the pool's one group size that prices chunks above zero
    assert set(fit.coefficients) == {2} and min(fit.predict(2, 64), fit.predict(2, 512)) > 0
    ids = [prompt(llm, 700, 3), prompt(llm, 90, 4)]
    want = llm.generate(ids, GREEDY)
    assert [c.token_ids for c in clustered.generate(ids, GREEDY)] == [c.token_ids for c in want]
    assert adaptive.planner.improvement_rate == 0.05
    texts, events = serve(clustered, ids, GREEDY.max_tokens)  # `serve` over the same cluster
    assert texts == [c.text for c in want]
    assert events == {k: float(v) for k, v in clustered.engine.events.items()} and events["transfers"] >= 2, events


def test_llm_on_one_tensor_parallel_instance_equals_one_device(model, llm):
    """LLM(tp=3) without a cluster layout: one engine whose step runs on 3 devices, each with a third of every
    layer's heads and MLP and of the KV cache's heads, gives the single-device engine's greedy tokens."""
    tp = jaxserve.LLM(
        model,
        max_model_len=1024,
        kv_cache_tokens=2048,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        tp=3,
        progress=False,
    )
    runner = tp.engine.runner
    assert len(runner.devices) == 3 and runner.caches[0].shape[2] == 3
    assert {s.data.shape[2] for s in runner.caches[0].addressable_shards} == {1}  # one KV head per device
    ids = [prompt(llm, 700, 5), prompt(llm, 90, 6), prompt(llm, 30, 7)]
    want = [c.token_ids for c in llm.generate(ids, GREEDY)]
    assert [c.token_ids for c in tp.generate(ids, GREEDY)] == want


def test_quantized_weights_split_over_tensor_parallel_devices(model, llm, tmp_path, monkeypatch):
    """LLM(tp=3) with weights kept quantized, each device holding its share of the values, scales and offsets:
    this folder's model as a Q4_1 GGUF, through XLA (4-bit values packed in bytes, split by columns; offsets per
    block, split with rows) and through ggml's kernels (rows of blocks, split by rows or by whole blocks within
    them), and int8 (one scale per column, whole on every device for the row-split projections). Through XLA the
    GGUF blocks give the float32 engine's greedy tokens (the same file dequantized); int8 gives its own
    single-device greedy tokens, and so does ggml up to a near-tie (it rounds each matmul's input to 8 bits, so
    partial sums added in another order may round an input the other way)."""
    settings = dict(
        max_model_len=1024, kv_cache_tokens=2048, max_num_seqs=4, max_num_batched_tokens=256, progress=False
    )
    q4 = tmp_path / "q4_1.gguf"
    write_gguf(q4, "llama", GGUF_META, _tiny_tensors(llm, tmp_path), llm.tokenizer, pre="smollm", qtype="Q4_1")
    ids = [prompt(llm, 300, 11), prompt(llm, 40, 12)]
    one, three = (jaxserve.LLM(str(q4), quantization="gguf", tp=tp, **settings) for tp in (1, 3))
    scored = SamplingParams(max_tokens=GREEDY.max_tokens, logprobs=2)
    for ours, want in zip(three.generate(ids, GREEDY), one.generate(ids, scored)):
        for token, single in zip(ours.token_ids, want.logprobs):
            if token != single.token:  # only at a near-tie: the partial sums' order moves 8-bit roundings
                assert single.top[0][1] - single.top[1][1] < 0.1
                break
    del one, three
    with monkeypatch.context() as m:
        m.setattr(ggml, "available", lambda: False)
        kept, full = (jaxserve.LLM(str(q4), **settings, **extra) for extra in (dict(quantization="gguf", tp=3), {}))
    assert [c.token_ids for c in kept.generate(ids, GREEDY)] == [c.token_ids for c in full.generate(ids, GREEDY)]
    del kept, full
    one, three = (jaxserve.LLM(model, quantization="int8", tp=tp, **settings) for tp in (1, 3))
    assert [c.token_ids for c in three.generate(ids, GREEDY)] == [c.token_ids for c in one.generate(ids, GREEDY)]


# this folder's model as llama.cpp's converter describes it
GGUF_META = {
    "embedding_length": 64,
    "feed_forward_length": CLUSTER_MODEL["mlp"],
    "block_count": LAYERS,
    "attention.head_count": CLUSTER_MODEL["heads"],
    "attention.head_count_kv": CLUSTER_MODEL["kv_heads"],
    "attention.key_length": 16,  # not hidden / heads
    "attention.value_length": 16,
    "context_length": 4096,
    "rope.freq_base": 10000.0,
    "attention.layer_norm_rms_epsilon": 1e-5,
}


def _tiny_tensors(llm, tmp_path) -> dict:
    """This folder's model's tensors (written again: its seed draws the same), by llama.cpp's names."""
    tensors = write_tiny_model(tmp_path / "again", llm.tokenizer, **CLUSTER_MODEL, tied=True)
    return gguf_tensors(tensors, "llama", heads=CLUSTER_MODEL["heads"], kv_heads=CLUSTER_MODEL["kv_heads"])


def test_llm_on_pipeline_stages_of_kv_parallel_sets_equals_one_device(model, llm):
    """LLM(stages=2, kvp=2, tp=3, kvp_tokens=256), Medha's 3D layout on 12 devices: the model's layers split over
    2 stages, each stage's KV over 2 sets of 3 tensor-parallel devices, a request filling 256 tokens on one set
    before the next joins (the long prompt's second set joins mid-prefill). The single-device engine's greedy
    tokens for a prompt many chunks long and short ones beside it."""
    pipe = jaxserve.LLM(
        model,
        max_model_len=1024,
        kv_cache_tokens=2048,
        max_num_seqs=4,
        max_num_batched_tokens=128,
        tp=3,
        stages=2,
        kvp=2,
        kvp_tokens=256,
        progress=False,
    )
    runner = pipe.engine.runner
    assert (runner.stages, runner.kvp, runner.tp, len(runner.devices)) == (2, 2, 3, 12)
    assert [c[0].shape[0] for c in runner.stage_caches] == [LAYERS // 2] * 2
    ids = [prompt(llm, 700, 8), prompt(llm, 90, 9), prompt(llm, 30, 10)]
    want = [c.token_ids for c in llm.generate(ids, GREEDY)]
    assert [c.token_ids for c in pipe.generate(ids, GREEDY)] == want
    # every device of the first stage holds K: each KV-parallel set holds part of the requests' context
    held = [np.asarray(s.data).any(axis=(0, 2, 3)).sum() for s in runner.stage_caches[0][0].addressable_shards]
    assert min(held) > 0


def test_gemma3_on_tensor_parallel_devices_and_pipeline_stages_equals_one_device(smollm2, tmp_path, monkeypatch):
    """A tiny Gemma 3 (tests/tiny_models.py: a sliding layer and a full one, each with its RoPE base) on 2
    tensor-parallel devices (a KV head each; the q/k norms whole on both) and as 2 pipeline stages (a layer each,
    which keeps its own window) generates the single-device engine's tokens. Their logprobs agree within float32
    rounding; the tokens agree up to a step whose two best candidates are closer than that."""
    tokenizer = TextTokenizer.from_gguf(GGUFFile(smollm2))
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))  # the tiny model's conversion
    write_tiny_model(tmp_path, tokenizer, family="gemma3", tied=False)
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, tokenizer.vocab_size, n).tolist() for n in (40, 13)]
    settings = dict(max_model_len=256, kv_cache_tokens=1024, max_num_seqs=4, progress=False)
    sampling = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    want = jaxserve.LLM(str(tmp_path), **settings).generate(ids, sampling)
    for layout in (dict(tp=2), dict(stages=2)):
        got = jaxserve.LLM(str(tmp_path), **settings, **layout).generate(ids, sampling)
        for a, b in zip(got, want):
            for x, y in zip(a.logprobs, b.logprobs):
                np.testing.assert_allclose([v for _, v in x.top], [v for _, v in y.top], atol=1e-4)
                if y.top[0][1] - y.top[1][1] < 1e-4:  # a near tie may go either way; past it the outputs part
                    break
                assert x.token == y.token, layout
