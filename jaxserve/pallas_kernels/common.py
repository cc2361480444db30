"""Pieces shared by the Pallas kernels: tile sizes and padding, the online-softmax update, GPU compiler options.

The kernels keep to the portable Pallas subset (BlockSpecs with index maps, ref loads/stores with `pl.ds`,
`fori_loop`/`cond`, jnp math and `lax.dot_general`), so one body runs in interpret mode on CPU and compiles on
GPU. On GPU they compile through the Triton lowering, requested explicitly with Triton compiler params: the
Mosaic GPU lowering (the default for `pl.pallas_call` since JAX 0.9) has no rule for `dot_general` and wants
kernels written with `plgpu.kernel` and wgmma instead. Triton is deprecated from JAX 0.11 but still selected by
its params; if it is removed, these kernels need that Mosaic GPU port.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

Carry = tuple[Float[Array, "r d"], Float[Array, " r"], Float[Array, " r"]]  # unnormalised output, running max, sum


def tile(n: int, block: int, minimum: int = 16) -> int:
    """Tile size for an axis of n: `block`, shrunk for short axes to a power of two of at least `minimum`.

    Triton wants power-of-two tiles, and `dot` operands with every side >= 16.
    """
    return min(block, max(minimum, pl.next_power_of_2(n)))


def pad_axis(x: Array, axis: int, size: int, value: float | int = 0) -> Array:
    """x padded with `value` at the end of `axis` up to `size` (no copy when it is already that long)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# What one Triton program may hold in shared memory, with room for Triton's own scratch: an H100 gives a block
# 227 KiB (232448 bytes), an A100 163 KiB.
SHARED_MEMORY_BUDGET = 160 * 1024


def pipeline_stages(stage_bytes: int, fixed_bytes: int, most: int = 2) -> int:
    """Software-pipelining depth for a loop that loads `stage_bytes` of tiles per step beside `fixed_bytes` held
    throughout: Triton keeps one copy of the step's tiles per stage in shared memory, so the depth is what the
    budget holds (at least 1). Measured on an H100: the engine's ragged kernel at 2 stages (key blocks of 256,
    head_dim 128, bf16, a 128-row query group) asked for 294976 bytes and failed to launch."""
    return max(1, min(most, (SHARED_MEMORY_BUDGET - fixed_bytes) // stage_bytes))


def gpu_params(head_dim: int, interpret: bool, num_stages: int = 2):
    """Triton compiler params for GPU (None in interpret mode). Warps are a first guess, to tune on H100."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pl_triton

    return pl_triton.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=num_stages)


H100 = "NVIDIA H100 80GB HBM3"
H100_SMS = 132


def gpu_cores() -> int:
    """The SMs of the GPU kernels run on; an H100's where JAX has no GPU (lowering for one from a CPU)."""
    device = jax.devices()[0]
    return (getattr(device, "core_count", None) or H100_SMS) if device.platform == "gpu" else H100_SMS


@contextlib.contextmanager
def lowering_for(platforms: Sequence[str] | None, device_kind: str = H100) -> Iterator[None]:
    """Lower for `platforms` from a machine that may lack them: a Pallas call lowered for CUDA where no GPU is
    present needs the target GPU named as an abstract device (JAX >= 0.11 raises "No supported GPU devices found"
    otherwise; 0.10 accepts both ways)."""
    if not platforms or "cuda" not in platforms or jax.default_backend() == "gpu":
        yield
        return
    gpu = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("lowering",), abstract_device=gpu)):
        yield


LOG2_E = 1.4426950408889634  # the online softmax runs in base 2: exp2 is one instruction on GPUs (ex2.approx)


def scores(q: Float[Array, "r d"], k: Float[Array, "c d"], scale: float) -> Float[Array, "r c"]:
    """Scaled q.k^T in base-2 units (times log2(e)), accumulated in float32 (inputs stay in their dtype so bf16
    runs on tensor cores)."""
    return lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * (scale * LOG2_E)


def init_carry(rows: int, d: int) -> Carry:
    return (
        jnp.zeros((rows, d), jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def online_softmax(carry: Carry, s: Float[Array, "r c"], v: Float[Array, "c d"]) -> Carry:
    """Fold one key block of base-2 scores (`scores`) into the running softmax. Masked scores are -inf; a row
    with no visible key so far keeps max -inf, so the max is replaced by 0 where it is -inf to keep exp2() free
    of inf - inf."""
    acc, m, l = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp2(s - m_safe[:, None])
    alpha = jnp.exp2(m - m_safe)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return alpha[:, None] * acc + pv, m_new, alpha * l + jnp.sum(p, axis=1)


def finish(carry: Carry) -> tuple[Float[Array, "r d"], Float[Array, " r"]]:
    """Normalised output and natural log-sum-exp; rows that saw no key get 0 and -inf (the reference's
    convention)."""
    acc, m, l = carry
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    lse = (m + jnp.log2(l_safe)) / LOG2_E
    return jnp.where(seen[:, None], acc / l_safe[:, None], 0.0), jnp.where(seen, lse, -jnp.inf)
