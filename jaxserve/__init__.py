"""jaxserve: long-context LLM serving with JAX/XLA."""

from jaxserve.api import LLM, Completion
from jaxserve.engine.sampling import SamplingParams

__all__ = ["LLM", "Completion", "SamplingParams"]
