"""The scheduler: pure Python + numpy, never imports jax (see ../shared/DESIGN.md)."""
