"""Tests of the live cluster: 8 prefill devices (groups of 2 -> 4 -> 8) and decode instances on other devices, so
12 CPU devices. tests/test_many_devices.py runs this folder in its own process with
XLA_FLAGS=--xla_force_host_platform_device_count=12 (the flag must be set before JAX starts).

The model is a small one of random weights with SmolLM2's tokenizer (tests/tiny_models.py; 4 layers, 6 query
and 3 KV heads, 192 MLP features, so it splits over 3 tensor-parallel devices and 2 pipeline stages): what these tests
check is the layouts and the cluster's decisions, against one device running the same model, and a small model compiles
and runs their many programs in a fraction of SmolLM2's time. SmolLM2 itself runs here where its file matters
(its Q4_1 blocks, test_llm_layouts.py) and in the single-device tests."""

from __future__ import annotations

import gc

import jax
import numpy as np
import pytest

import jaxserve
from jaxserve.cluster.build import build, warmup
from jaxserve.config import ParallelConfig
from jaxserve.models import registry
from jaxserve.models.gguf_loader import GGUFFile
from jaxserve.models.tokenizer import TextTokenizer
from jaxserve.sched.cost_models import TetrisPrefill
from tiny_models import CLUSTER_MODEL, write_tiny_model

MAX_MODEL_LEN = 4096
LAYERS = CLUSTER_MODEL["layers"]


@pytest.fixture(autouse=True)
def collect_garbage():
    """Clusters and servers hold GBs of device buffers behind reference cycles: collect what earlier tests and
    modules left before a test builds its own (this folder's memory peak), and after."""
    gc.collect()
    yield
    gc.collect()


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    if len(devs) < 12:
        pytest.fail(f"need 12 devices, got {len(devs)}: run through tests/test_many_devices.py")
    return devs


@pytest.fixture(scope="session")
def smollm2() -> str:
    """SmolLM2's file (the default model), fetched into the user's cache if need be."""
    return str(registry.resolve(registry.DEFAULT_MODEL))


@pytest.fixture(scope="session")
def model(tmp_path_factory, smollm2) -> str:
    """The folder of this folder's model. Its conversion, profiles and compiled programs go to a cache of this
    session's own (JAXSERVE_CACHE), so the user's cache gains nothing from a folder that is gone after the run."""
    tokenizer = TextTokenizer.from_gguf(GGUFFile(smollm2))
    root = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_model(root, tokenizer, **CLUSTER_MODEL, tied=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAXSERVE_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield str(root)


@pytest.fixture(scope="session")
def llm(devices, model):
    """The model in float32 with a small batch; its engine (on device 0) is the single-device reference."""
    return jaxserve.LLM(
        model,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_tokens=2 * MAX_MODEL_LEN,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        progress=False,
    )


def engine_maker(llm):
    """build()'s make_engine: the LLM's engines on the devices given, quietly."""
    return lambda devices, tp: llm.builder.engine(devices, progress=False, tp=tp)


def prompt(llm, n: int, seed: int) -> list[int]:
    """n tokens of real text (the tokenizer's encoding of varied English), so greedy decoding is not degenerate."""
    words = "the of and to in is was for on that with as by at from his her it an were are which this be".split()
    rng = np.random.default_rng(seed)
    ids = llm.tokenizer.encode(" ".join(rng.choice(words, 2 * n)))
    return ids[:n]


def eq1_model() -> TetrisPrefill:
    """A stand-in Eq. (1) (the planner's decisions are what these tests set up, not its accuracy): larger groups
    are faster per token, a chunk has a small fixed cost."""
    return TetrisPrefill({s: np.array([0.01, 4e-4 / s, 2e-7 / s, 1e-7 / s]) for s in (2, 4, 8)})


def make_cluster(llm, devices, decode_instances: int = 1, receive_buffers: int = 4, warm: bool = True):
    layout = ParallelConfig(
        prefill_instances=8,
        decode_instances=decode_instances,
        node_size=2,
        receive_buffers=receive_buffers,
        min_chunk=256,
    )
    cluster = build(
        llm.config,
        llm.builder.params,
        layout,
        engine_maker(llm),
        eq1_model(),
        capacity=MAX_MODEL_LEN,
        min_local=128,
        devices=devices,
    )
    if warm:
        warmup(cluster, MAX_MODEL_LEN, progress=False)
    return cluster


def busy(cluster, seconds_by_device: dict[int, float]) -> None:
    """Book prefill devices as if earlier work held them for these seconds, the others free (the queues the
    planner sees, whatever earlier tests left)."""
    now = cluster.clock()
    for k, i in enumerate(cluster.pool_ids):
        cluster.free_at[k] = now + seconds_by_device.get(i, 0.0)


def run(cluster, requests):
    """Submit (ids, params) pairs and step until all finish; each request's tokens."""
    rids = [cluster.add_request(ids, params) for ids, params in requests]
    tokens = {rid: [] for rid in rids}
    for _ in range(100_000):
        if not cluster.has_unfinished():
            break
        for out in cluster.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
    return [tokens[r] for r in rids]


def serve(clustered, prompts: list[list[int]], max_tokens: int) -> tuple[list[str], dict[str, float]]:
    """Serve `clustered` (an LLM) on loopback and send every prompt at once through the official openai client,
    the first one streamed: each prompt's greedy text, and the cluster events /metrics reports."""
    import concurrent.futures
    import re
    import urllib.request
    import weakref

    import openai

    from jaxserve.server.launch import BackgroundServer

    with BackgroundServer(clustered, grpc_port=0, http_port=0) as s:
        port = s.server.http_port
        oai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=1200)

        def complete(k: int) -> str:
            args = dict(model=clustered.model_name, prompt=prompts[k], max_tokens=max_tokens, temperature=0)
            if k:
                return oai.completions.create(**args).choices[0].text
            return "".join(c.choices[0].text for c in oai.completions.create(**args, stream=True))

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(complete, range(len(prompts))))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
            metrics = reply.read().decode()
        engine = weakref.ref(s.server.engine)
    del s
    gc.collect()
    assert engine() is None, "a stopped server still holds its engine (and the model's device buffers)"
    events = {
        m[1]: float(m[2]) for m in re.finditer(r'^jaxserve_cluster_events_total\{event="(\w+)"\} (\S+)$', metrics, re.M)
    }
    return texts, events
