"""KV-parallel decode (Medha KVP, CSPS SP decode; call inside `shard_map` over the 'sp' axis).

A long request's KV stays split across the group's devices; the query moves instead: every device attends over
its own paged shard, and the (output, log-sum-exp) partials merge exactly. Only b*h*(d+1) values per device
cross the network (one all-gather), not the KV.
"""

from __future__ import annotations

from jaxtyping import Array, Float, Int

from jaxserve.pallas_kernels import dispatch as kernels
from jaxserve.sharding.lse import merge_gathered
from jaxserve.sharding.mesh import SP


def kv_parallel_decode(
    q: Float[Array, "b h d"],
    k_cache: Float[Array, "slots kvh d"],
    v_cache: Float[Array, "slots kvh d"],
    block_tables: Int[Array, "b nblk"],
    kv_lens: Int[Array, " b"],
    *,
    block_size: int,
    axis_name: str = SP,
    implementation: kernels.Implementation | None = None,
) -> Float[Array, "b h d"]:
    """q is the same on every device; the cache, block tables and kv_lens describe this device's shard."""
    o, lse = kernels.paged_decode_attention(
        q, k_cache, v_cache, block_tables, kv_lens, block_size=block_size, num_splits=1, implementation=implementation
    )
    return merge_gathered(o[:, 0], lse[:, 0], axis_name)[0]
