"""One entry point per attention op: the Pallas kernel on GPU, the pure-jnp reference elsewhere (float32 decode
tiles on a CPU: the C++ kernel, cpu_attention.py).

`implementation` overrides the choice: 'kernel' (compiled Pallas), 'interpret' (Pallas in interpret mode, runs on
CPU: how tests check the kernels) or 'reference'. Tile options (block_q, block_k, block_rows) reach the kernels
only; the reference has none.
"""

from __future__ import annotations

from typing import Literal

import jax
from jaxtyping import Array, Float, Int

from jaxserve.pallas_kernels import chunk_attention as chunk_kernel
from jaxserve.pallas_kernels import cpu_attention
from jaxserve.pallas_kernels import decode_attention as decode_kernel
from jaxserve.pallas_kernels import merge as merge_kernel
from jaxserve.pallas_kernels import reference
from jaxserve.pallas_kernels import tiled_paged_attention as tiled_kernel

Implementation = Literal["kernel", "interpret", "reference"]
IMPLEMENTATIONS: tuple[Implementation, ...] = ("kernel", "interpret", "reference")


def resolve(implementation: Implementation | None) -> Implementation:
    """The implementation a call runs: the override, else the kernel on GPU and the reference elsewhere."""
    if implementation is None:
        return "kernel" if jax.default_backend() == "gpu" else "reference"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {implementation!r}; one of {IMPLEMENTATIONS}")
    return implementation


def chunk_attention(
    q: Float[Array, "t h d"],
    k: Float[Array, "s kvh d"],
    v: Float[Array, "s kvh d"],
    q_pos: Int[Array, " t"],
    k_pos: Int[Array, " s"],
    window: int | None = None,
    *,
    implementation: Implementation | None = None,
    **tiles: int,
) -> tuple[Float[Array, "t h d"], Float[Array, "t h"]]:
    impl = resolve(implementation)
    if impl == "reference":
        return reference.chunk_attention(q, k, v, q_pos, k_pos, window, reference.KEY_STEP)
    return chunk_kernel.chunk_attention(q, k, v, q_pos, k_pos, window, interpret=impl == "interpret", **tiles)


def paged_decode_attention(
    q: Float[Array, "b h d"],
    k_cache: Float[Array, "slots kvh d"],
    v_cache: Float[Array, "slots kvh d"],
    block_tables: Int[Array, "b nblk"],
    kv_lens: Int[Array, " b"],
    *,
    block_size: int,
    num_splits: int,
    implementation: Implementation | None = None,
    **tiles: int,
) -> tuple[Float[Array, "b n h d"], Float[Array, "b n h"]]:
    impl = resolve(implementation)
    if impl == "reference":
        return reference.paged_decode_attention(
            q, k_cache, v_cache, block_tables, kv_lens, block_size=block_size, num_splits=num_splits
        )
    return decode_kernel.paged_decode_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        kv_lens,
        block_size=block_size,
        num_splits=num_splits,
        interpret=impl == "interpret",
        **tiles,
    )


def tiled_paged_attention(
    q: Float[Array, "n tq h d"],
    q_pos: Int[Array, "n tq"],
    k_cache: Float[Array, "slots kvh d"],
    v_cache: Float[Array, "slots kvh d"],
    tables: Int[Array, "n w"],
    *,
    block_size: int,
    key_block: int,
    window: int | None = None,
    page_pos: Int[Array, "n w"] | None = None,
    implementation: Implementation | None = None,
) -> tuple[Float[Array, "n tq h d"], Float[Array, "n tq h"]]:
    if implementation is None and cpu_attention.takes(q, k_cache):  # float32 decode tiles on a CPU: C++
        return cpu_attention.decode_attention(
            q, q_pos, k_cache, v_cache, tables, block_size=block_size, window=window, page_pos=page_pos
        )
    impl = resolve(implementation)
    if impl == "reference":
        return reference.tiled_paged_attention(
            q,
            q_pos,
            k_cache,
            v_cache,
            tables,
            block_size=block_size,
            key_block=key_block,
            window=window,
            page_pos=page_pos,
        )
    return tiled_kernel.tiled_paged_attention(
        q,
        q_pos,
        k_cache,
        v_cache,
        tables,
        block_size=block_size,
        key_block=key_block,
        window=window,
        page_pos=page_pos,
        interpret=impl == "interpret",
    )


def merge_attention(
    o: Float[Array, "n ... d"],
    lse: Float[Array, "n ..."],
    *,
    implementation: Implementation | None = None,
    **tiles: int,
) -> tuple[Float[Array, "... d"], Float[Array, "..."]]:
    impl = resolve(implementation)
    if impl == "reference":
        return reference.merge_attention(o, lse)
    return merge_kernel.merge_attention(o, lse, interpret=impl == "interpret", **tiles)
