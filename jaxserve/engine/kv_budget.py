"""How many tokens of KV cache a device holds under vLLM's gpu_memory_utilization: the engine may use that share of
the device's memory, and the KV pool takes what the weights and the largest step's working memory leave.

On an accelerator the memory is what JAX's allocator may hand out (its bytes_limit: XLA_PYTHON_CLIENT_MEM_FRACTION
of the device, 75% by default). On a CPU it is the process's budget: the cgroup's memory limit, else the machine's
memory; what the process holds already (weights included) is its resident set.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

import jax

from jaxserve.models.config import LlamaConfig

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Budget:
    """A device's memory as the KV pool sees it, in bytes."""

    limit: int  # what the engine may use: utilization x the device's memory
    held: int  # in use now (the loaded weights included; a CPU: the process's resident set)
    weights: int  # the runner's copy of this instance's weights on the device
    activations: int  # an upper bound of the largest step's working memory

    @property
    def kv(self) -> int:
        return self.limit - self.held - self.weights - self.activations

    def describe(self, tokens: int, utilization: float) -> str:
        g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
        return (
            f"KV pool: {tokens} tokens ({g(self.kv)} a device) = gpu_memory_utilization {utilization} of the "
            f"device's memory ({g(self.limit)}) less {g(self.held)} in use, {g(self.weights)} of weights and "
            f"{g(self.activations)} for a step's activations"
        )


def activation_bytes(
    cfg: LlamaConfig, tokens: int, rows: int, key_block: int, dtype_bytes: int, tp: int = 1, quantized: bool = False
) -> int:
    """An upper bound of a step's working memory: every intermediate of one layer for `tokens` tokens held at
    once (with quantized weights, the MLP's three kernels dequantized too, where XLA does not fuse that into the
    matmul), a tile of attention scores, and the sampler's float32 logits (three copies: logits, softmax, sort) and
    its slots (engine/sampling.py: four [rows, vocab] arrays); twice that, for what XLA's buffer assignment adds."""
    heads, kv_heads = cfg.num_heads // tp, max(cfg.num_kv_heads // tp, 1)
    per_token = (
        4 * cfg.hidden_size + 2 * heads * cfg.head_dim + 2 * kv_heads * cfg.head_dim + 3 * cfg.intermediate_size // tp
    )
    layer = tokens * per_token * max(dtype_bytes, 4)
    if quantized:
        layer += 3 * cfg.hidden_size * cfg.intermediate_size // tp * dtype_bytes
    scores = tokens * key_block * heads * 4
    sampler = rows * cfg.vocab_size * (3 * 4 + 10)
    return 2 * (layer + scores + sampler)


def _cpu_memory() -> int:
    """The process's memory budget: its cgroup's limit (v2 or v1), else the machine's memory."""
    for f in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = pathlib.Path(f).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max" or a huge number: no limit
            return int(text)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def budget(device: jax.Device, utilization: float, weights: int, activations: int) -> Budget:
    """The KV budget of `device` for an instance whose weights take `weights` bytes on it. What is in use now
    counts too, the loaded weights included: the runner places its own copy of them (per layer, split over tp)
    and allocates the KV pool before the loaded copy is released, so both must fit beside the pool."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return Budget(int(utilization * stats["bytes_limit"]), stats.get("bytes_in_use", 0), weights, activations)
    return Budget(int(utilization * _cpu_memory()), _resident(), weights, activations)
