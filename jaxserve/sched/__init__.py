"""The scheduler: pure Python + numpy, never imports jax (docs/ARCHITECTURE.md, the layers' rules)."""
