"""Built-in cost profiles from real GPU measurements (microsoft/vidur's data/profiles, MIT):
per-layer operator timings by token count and TP degree, collective timings by message size.

Attention is not in Vidur's data. Where the GPU has an attention table measured by jaxserve
(tools/profile/attention.py; H100 only), prefill attention takes the measured kernel time for its FLOPs (see
MeasuredAttention); otherwise (A100) it runs at an assumed `mfu` of the peak FLOPs. Decode attention and the KV
reads of a chunk over a long history stay at an assumed `mbu` of the HBM bandwidth on every GPU: the table's
decode rows time XLA's non-flash attention, not a paged decode kernel (0.1-1.2 TB/s under GQA, 0.9 TB/s over 131K
keys); only their best (multi-head over 32K keys: up to 2.3 TB/s, 0.7 of the peak, near the GPU's measured copy
bandwidth of 2.3-3.0 TB/s) says what a decode kernel reaches, and it agrees with mbu = 0.7, as does vLLM's paged
attention at long contexts (70-80%).

The CSVs ship inside the package (jaxserve/sched/data/) so a pip install has them.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
import statistics
from importlib import resources
from typing import Sequence

import numpy as np

from jaxserve.sched.batch_cost import AdditiveBatchCost, PiecewiseLinear
from jaxserve.sched.cost_models import LinkModel

_LINEAR_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float  # dense bf16, per second
    hbm_bandwidth: float  # bytes per second
    memory: float  # bytes
    mfu: float = 0.5  # assumed attention utilisation of peak FLOPs (FlashAttention-2 reaches 50-70%)
    mbu: float = 0.7  # assumed utilisation of HBM bandwidth when attention is memory-bound (decode)
    attention: str | None = None  # measured attention table (replaces mfu for prefill), in data/


GPUS = {
    "a100": GPU("A100-SXM4-80GB", 312e12, 2.039e12, 80e9),
    "h100": GPU("H100-SXM5-80GB", 989e12, 3.35e12, 80e9, attention="h100_attention.csv"),
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    ffn: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def weight_bytes(self, dtype_bytes: int = 2) -> float:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.ffn
        return dtype_bytes * (self.layers * (attn + mlp) + 2 * self.vocab * self.hidden)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> float:
        return dtype_bytes * 2 * self.layers * self.kv_heads * self.head_dim


def kv_capacity(profile: str, gpus: int, memory_utilization: float = 0.9) -> int:
    """KV tokens that `gpus` GPUs of the profile hold beside one copy of the weights."""
    shape, gpu = model_shape(profile), GPUS[_profile(profile)[0]]
    free = gpus * gpu.memory * memory_utilization - shape.weight_bytes()
    if free <= 0:
        raise ValueError(f"{shape.name} does not fit {gpus} x {gpu.name}")
    return int(free // shape.kv_bytes_per_token())


# profile name -> (gpu, csv file, layer count: the CSV times one layer)
PROFILES = {
    "a100_llama3_8b": ("a100", "a100_llama3_8b_mlp.csv", 32),
    "h100_llama2_7b": ("h100", "h100_llama2_7b_mlp.csv", 32),
    "h100_llama2_70b": ("h100", "h100_llama2_70b_mlp.csv", 80),
}


def _read(name: str) -> list[dict[str, str]]:
    with resources.files("jaxserve.sched.data").joinpath(name).open() as f:
        return list(csv.DictReader(f))


@functools.cache
def model_shape(profile: str) -> ModelShape:
    _, file, layers = _profile(profile)
    row = _read(file)[0]
    return ModelShape(
        profile.split("_", 1)[1],
        layers,
        int(row["n_head"]),
        int(row["n_kv_head"]),
        int(row["n_embd"]),
        int(row["n_expanded_embd"]),
        int(row["vocab_size"]),
    )


def _profile(profile: str) -> tuple[str, str, int]:
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; built in: {sorted(PROFILES)}")
    return PROFILES[profile]


@functools.cache
def linear_ops_per_layer(profile: str, tp: int) -> PiecewiseLinear:
    """Seconds per layer for the non-attention operators, by batch token count (median of the measurements)."""
    _, file, _ = _profile(profile)
    rows = [r for r in _read(file) if int(r["num_tensor_parallel_workers"]) == tp]
    if not rows:
        raise ValueError(f"profile {profile} has no TP={tp} measurements")
    curve = PiecewiseLinear(
        [int(r["num_tokens"]) for r in rows],
        [sum(float(r[f"time_stats.{op}.median"]) for op in _LINEAR_OPS) / 1e3 for r in rows],
    )
    # measurement noise makes a few points dip below smaller batches; more tokens never take less time, and
    # the packer's bisection relies on that
    return PiecewiseLinear(curve.xs, np.maximum.accumulate(curve.ys).tolist())


@functools.cache
def all_reduce(gpu: str, workers: int) -> PiecewiseLinear:
    """Seconds for an all-reduce inside one node, by message bytes."""
    rows = [
        r
        for r in _read(f"net_{gpu}_dgx_all_reduce.csv")
        if int(r["num_workers"]) == workers and int(r["devices_per_node"]) == workers
    ]
    if not rows:
        raise ValueError(f"no {gpu} all-reduce measurements for {workers} workers in one node")
    return PiecewiseLinear(
        [int(r["size"]) for r in rows], [float(r["time_stats.all_reduce.median"]) / 1e3 for r in rows]
    )


@functools.cache
def network(gpu: str) -> LinkModel:
    """Point-to-point transfer model fitted to send/recv timings: links 'intra_node' (NVLink) and 'inter_node'."""
    samples = []
    for r in _read(f"net_{gpu}_dgx_send_recv.csv"):
        link = "inter_node" if int(r["devices_per_node"]) == 1 else "intra_node"
        samples.append((link, (int(r["size"]),), float(r["time_stats.send_recv.median"]) / 1e3))
    return LinkModel.fit(samples)


FLOOR_FLOPS = 2.0**33  # calls with at most this much work (< 15 us of it at 600 TFLOP/s) time the floor alone


@dataclasses.dataclass(frozen=True)
class MeasuredAttention:
    """Seconds of one layer's attention kernel by its FLOPs (4 * head_dim * query heads per (query, key) pair),
    from a table of tools/profile/attention.py.

    At equal FLOPs the measured calls take nearly the same time whatever the heads per GPU (64/8 to 4/4) or the
    shape (causal prompt, queries over history), so one curve serves every model and TP degree: the median call
    time at each measured power of two of FLOPs, less `floor`. Floor + curve meets every H100 prefill and
    history row within 15% from 2^38 FLOPs up (5% from 2^41, where the kernel reaches ~610 TFLOP/s), within 46%
    below (the floor's jitter).

    Each measured call pays a floor (~0.15-0.4 ms) that is JAX's dispatch and sync around a standalone call, not
    the kernel: a serving step runs each layer's attention for the whole batch inside one program. So the floor
    is never charged, per call or per sequence. Below the smallest work whose median call takes 3 floors (~2^38
    FLOPs) the floor hides the kernel, and the kernel time is taken proportional to the work at that knee's rate
    (~520 TFLOP/s on H100): optimistic for a lone short prompt (whose attention is small next to its linear
    operators), fair for a batch of them, which fills the GPU together."""

    floor: float  # seconds per standalone call outside the kernel: the median over calls of <= FLOOR_FLOPS
    kernel: PiecewiseLinear  # seconds by FLOPs from the knee up, nondecreasing

    def __call__(self, flops: float) -> float:
        x0 = self.kernel.xs[0]
        return self.kernel(flops) if flops >= x0 else flops * self.kernel.ys[0] / x0


@functools.cache
def measured_attention(file: str) -> MeasuredAttention:
    rows = [r for r in _read(file) if r["kind"] != "decode"]
    floor = statistics.median(float(r["seconds"]) for r in rows if float(r["flops"]) <= FLOOR_FLOPS)
    by_work: dict[int, list[float]] = {}
    for r in rows:  # each measured shape's FLOPs is a power of two to within 1/n
        by_work.setdefault(round(math.log2(float(r["flops"]))), []).append(float(r["seconds"]))
    knots = [(2.0**k, statistics.median(ts)) for k, ts in sorted(by_work.items())]
    knee = next(i for i, (_, t) in enumerate(knots) if t >= 3 * floor)
    # medians of different shapes can dip; more work never takes less time (the packer bisects on it)
    times = np.maximum.accumulate([t - floor for _, t in knots[knee:]])
    return MeasuredAttention(floor, PiecewiseLinear([x for x, _ in knots[knee:]], times.tolist()))


# Tetris Table 1: LLaMA3-8B prefill seconds on one A100 per SP instance (TP=1), batch 1; None = out of memory.
TETRIS_TABLE1_K = (4, 8, 16, 32, 64, 128, 256)  # prompt length, thousands of tokens
TETRIS_TABLE1 = {
    1: (0.28, 0.57, 1.29, 3.22, 9.05, 29.20, None),
    2: (0.16, 0.31, 0.69, 1.67, 4.61, 14.30, 50.07),
    4: (0.13, 0.20, 0.39, 0.92, 2.43, 7.32, 24.77),
    8: (0.21, 0.24, 0.31, 0.58, 1.37, 3.96, 12.81),
    16: (0.39, 0.43, 0.46, 0.53, 0.96, 2.31, 7.02),
}


def tetris_table1_samples() -> list[tuple[int, tuple[int, int], float]]:
    """Table 1 as cost-model samples: (SP size, (prompt tokens, history 0), seconds)."""
    return [
        (sp, (k * 1024, 0), t)
        for sp, row in TETRIS_TABLE1.items()
        for k, t in zip(TETRIS_TABLE1_K, row)
        if t is not None
    ]


def _with_all_reduce(linear: PiecewiseLinear, gpu: str, tp: int, hidden: int, layers: int) -> PiecewiseLinear:
    """One table for `layers` layers of linear ops plus, under TP, their two all-reduces of bf16 activations
    (after attention and after the MLP): the sum of two piecewise-linear curves on the union of their knots,
    so the packer's many lookups cost one bisection."""
    if tp == 1:
        return PiecewiseLinear(linear.xs, [layers * y for y in linear.ys])
    ar = all_reduce(gpu, tp)
    bytes_per_token = 2 * hidden
    xs = sorted(set(linear.xs) | {x / bytes_per_token for x in ar.xs if x >= bytes_per_token})
    return PiecewiseLinear(xs, [layers * (linear(x) + 2 * ar(x * bytes_per_token)) for x in xs])


class ProfileBatchCost(AdditiveBatchCost):
    """Iteration time on a real GPU model: measured linear operators (plus TP all-reduces) for `layers` layers
    (one pipeline stage holds layers / stages), attention from FLOPs (measured kernel times where the GPU has
    a table, else at mfu) and KV bytes (at mbu); the busier of the two sets its time.

    KV-cache parallelism (Medha 3.3): up to `kvp` worker groups (each tp x stages GPUs, on nodes of their own)
    hold one sequence's KV, `kvp_tokens` each, a new worker joining when the earlier ones are full (progressive
    scaling; the last one takes what is left once all have joined). A query is sent to every worker holding its
    context, each attends over its share, and the partial outputs merge by their log-sum-exp: attention costs the
    largest share, plus one inter-node exchange per layer for the batch's split rows (linear ops run once)."""

    def __init__(
        self, profile: str = "a100_llama3_8b", tp: int = 1, stages: int = 1, kvp: int = 1, kvp_tokens: int | None = None
    ):
        gpu_name, _, layers = _profile(profile)
        if layers % stages:
            raise ValueError(f"{layers} layers do not split into {stages} pipeline stages")
        if kvp < 1:
            raise ValueError(f"kvp must be >= 1, got {kvp}")
        self.gpu, self.shape, self.tp = GPUS[gpu_name], model_shape(profile), tp
        self.layers = layers // stages
        self._linear = _with_all_reduce(linear_ops_per_layer(profile, tp), gpu_name, tp, self.shape.hidden, self.layers)
        s = self.shape
        self._flops_per_pair = 4.0 * s.head_dim * s.heads / tp  # QK^T and PV, per (query, key) pair
        self._kv_bytes_per_token = 2.0 * 2 * s.kv_heads * s.head_dim / tp  # K and V, bf16, one layer
        self._flop_rate = self.gpu.peak_flops * self.gpu.mfu
        self._byte_rate = self.gpu.hbm_bandwidth * self.gpu.mbu
        self._measured = measured_attention(self.gpu.attention) if self.gpu.attention else None
        self.kvp = kvp
        # only KV parallelism needs a worker's share (and its default, what one group's memory holds, which
        # does not exist where one group cannot hold the weights)
        self.kvp_tokens = kvp_tokens or (kv_capacity(profile, tp * stages) if kvp > 1 else 0)
        self._network = network(gpu_name)
        # per query token and layer, on each GPU: the query out (bf16), the partial output and its lse (fp32) back
        self._exchange_bytes = (2 * s.head_dim + 4 * s.head_dim + 4) * s.heads / tp

    def linear_ops(self, tokens: int) -> float:
        return self._linear(tokens)

    def workers(self, context: int) -> int:
        """KV-parallel workers holding a sequence of `context` tokens."""
        return min(self.kvp, -(-context // self.kvp_tokens)) if self.kvp > 1 else 1

    def _share(self, context: int) -> int:
        """The most tokens of a `context`-token sequence any one worker holds (the newest one's, at most)."""
        return max(min(context, self.kvp_tokens), context - (self.kvp - 1) * self.kvp_tokens)

    def prefill_attention(self, n: int, h: int) -> float:
        # the newest worker holds the chunk after what is left of the history, each earlier one a full share:
        # the chunk's queries attend on all of them at once, the busiest sets the time
        earlier = (self.workers(h + n) - 1) * self.kvp_tokens
        history = max(h - earlier, 0)
        pairs = n * max(history + (n + 1) / 2, min(earlier, self.kvp_tokens))  # causal within the chunk
        reads = max(history + n, min(earlier, self.kvp_tokens))
        return self.layers * max(
            self._compute(pairs * self._flops_per_pair), reads * self._kv_bytes_per_token / self._byte_rate
        )

    def decode_attention(self, kv: int) -> float:
        kv = self._share(kv) if self.kvp > 1 else kv
        return self.layers * max(
            self._compute(kv * self._flops_per_pair), kv * self._kv_bytes_per_token / self._byte_rate
        )

    def _compute(self, flops: float) -> float:
        """Seconds of one layer's attention math on one GPU."""
        return self._measured(flops) if self._measured else flops / self._flop_rate

    def chunk_kvp_rows(self, n: int, context: int) -> int:
        return n if self.workers(context) > 1 else 0

    def decodes_kvp_rows(self, kvs: Sequence[int]) -> int:
        return sum(self.workers(kv) > 1 for kv in kvs) if self.kvp > 1 else 0

    def exchange(self, rows: int) -> float:
        if not rows:
            return 0.0
        return self.layers * self._network.predict("inter_node", rows * self._exchange_bytes)
