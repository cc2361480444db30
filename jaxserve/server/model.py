"""What a server drives: a served model (jaxserve.LLM is one). The servers read its engine, its tokenizer and its
vocabulary, render chats and score prompts through it, and, across processes, fail over with it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

from jaxserve.engine.engine import TokenLogprob
from jaxserve.engine.interface import ServingEngine
from jaxserve.models.config import LlamaConfig
from jaxserve.models.tokenizer import TextTokenizer

if TYPE_CHECKING:  # the cluster layer is not the server's to import
    from jaxserve.cluster.lockstep import Leader


@runtime_checkable
class ServedModel(Protocol):
    engine: ServingEngine  # driven by the server's AsyncEngine only, once served
    tokenizer: TextTokenizer
    config: LlamaConfig  # its vocabulary size bounds token ids
    model_name: str
    max_model_len: int
    lockstep: Leader | None  # across processes: the leader's channel (None in one process)

    def chat_prompt(
        self,
        messages: Sequence[dict[str, str]],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """A conversation's token ids, rendered by the model's chat template."""

    def prompt_logprobs(self, prompt: str | Sequence[int], k: int = 0) -> list[TokenLogprob | None]:
        """Each prompt token's logprob (and the k most likely), scored outside serving."""

    def prepare_fail_over(self) -> None:
        """Across processes: compile the fail-over engine's programs in the background."""

    def fail_over(self) -> ServingEngine:
        """Across processes: an engine on this process's devices alone, for when a follower is lost."""

    def lost(self, timeout: float) -> str | None:
        """Across processes: which follower has sent no heartbeat for `timeout` seconds (None: none)."""
