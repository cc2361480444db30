"""Attention kernels: arrays in, arrays out; each beside a pure-jnp reference of the same signature."""
