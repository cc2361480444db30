"""Sequence parallelism over device meshes: layouts, ring / Ulysses / all-gather attention, KV-parallel decode,
KV rebalancing and communication volumes. Everything here runs inside `jax.shard_map` over the 'sp' axis."""
