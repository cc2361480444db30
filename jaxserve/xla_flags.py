"""XLA flags the launcher sets on a GPU machine, before JAX starts; and the options a CPU's programs compile with.

The latency-hiding scheduler (off by default in XLA; NVIDIA's JAX images and JAX's GPU performance tips turn it
on) orders a program around its asynchronous collectives by their estimated cost. The ring step's overlap does
not depend on it (sharding/ring.py orders each transfer beside its step's attention itself; tools/checks/gpu_compile.py
compiles it both ways), but the other collectives of a chunk step (the history's all-gather and reduce-scatter)
are scheduled by it.

XLA runs a program's kernels as one command buffer (a CUDA graph) by default, but not a `while` loop: each
iteration then reads its predicate back to the host and launches its kernels one by one. Multi-step decode is such
a loop, so WHILE is added to the command types.

On a CPU with AVX-512, XLA still emits 256-bit vector code by default (it avoids the clock throttling some Intel
parts apply to 512-bit code). The runner compiles a CPU's programs with 512-bit vectors there (cpu_options):
SmolLM2's one-row decode step, whose GEMVs XLA emits itself, ran 5% faster on an AMD EPYC (2 vCPU).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
from typing import Mapping, MutableMapping

# XLA's default command types, and WHILE (written out: a compile option takes no "+WHILE")
COMMAND_BUFFER = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE"
GPU_XLA_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true", f"--xla_gpu_enable_command_buffer={COMMAND_BUFFER}")


def for_gpu(environ: MutableMapping[str, str]) -> None:
    """Add GPU_XLA_FLAGS to environ's XLA_FLAGS where JAX's CUDA plugin is installed (a flag the user set keeps
    the user's value)."""
    if not any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        return
    names = _named(environ)
    given = environ.get("XLA_FLAGS", "")
    environ["XLA_FLAGS"] = " ".join([given, *(f for f in GPU_XLA_FLAGS if f.split("=")[0] not in names)]).strip()


def _named(environ: Mapping[str, str]) -> set[str]:
    """The flags environ's XLA_FLAGS sets, by name ("--xla_..."): the user's, which keep their values."""
    return {f.split("=")[0] for f in environ.get("XLA_FLAGS", "").split()}


def compiler_options(flags: tuple[str, ...] = GPU_XLA_FLAGS) -> dict[str, bool | str]:
    """XLA flags as per-compile options (`Lowered.compile(compiler_options=...)`)."""
    options: dict[str, bool | str] = {}
    for flag in flags:
        key, value = flag.lstrip("-").split("=")
        options[key] = {"true": True, "false": False}.get(value, value)
    return options


@functools.cache
def _has_avx512() -> bool:
    """Whether this host's CPU has AVX-512 (Linux's /proc/cpuinfo; False where there is none)."""
    try:
        return "avx512f" in pathlib.Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def cpu_options() -> dict[str, int]:
    """Per-compile options for a CPU's programs: 512-bit vectors where the CPU has AVX-512, unless the user's
    XLA_FLAGS set a width."""
    if not _has_avx512() or "--xla_cpu_prefer_vector_width" in _named(os.environ):
        return {}
    return {"xla_cpu_prefer_vector_width": 512}
