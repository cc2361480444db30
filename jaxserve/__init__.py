"""jaxserve: long-context LLM serving with JAX/XLA.

`LLM`, `Completion` and `SamplingParams` load lazily, so that importing a jax-free part of the package (the
scheduler in `jaxserve.sched`) does not start JAX.
"""

__all__ = ["LLM", "Completion", "SamplingParams"]


def __getattr__(name: str):
    if name in ("LLM", "Completion"):
        from jaxserve import api

        return getattr(api, name)
    if name == "SamplingParams":
        from jaxserve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
