"""The cluster simulator: executes the scheduler's Plans with a cost model (pure Python + numpy, no jax)."""
