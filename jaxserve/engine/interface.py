"""The engine interface the front ends drive (LLM, AsyncEngine and the servers behind it). Two executors implement
it: engine.Engine (one replica) and cluster.engine.ClusterEngine (a prefill pool and decode instances)."""

from __future__ import annotations

from typing import Callable, Mapping, Protocol, Sequence, runtime_checkable

from jaxserve.engine.engine import RequestOutput
from jaxserve.models.tokenizer import TextTokenizer
from jaxserve.sampling_params import SamplingParams
from jaxserve.sched.kv_manager import PrefixCacheStats


class KVUsage(Protocol):
    """What the metrics read of the KV cache, in blocks."""

    num_free: int
    capacity: int
    stats: PrefixCacheStats


@runtime_checkable
class ServingEngine(Protocol):
    tokenizer: TextTokenizer
    max_model_len: int
    max_num_seqs: int  # requests decoding at once, over every instance
    last_predicted: float | None  # the cost model's time of the last step (None: it ran no Plan)

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt's ids, checked against the model and the cache (ValueError names the problem)."""

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        ttft_slo: float | None = None,
    ) -> str:
        """check_request, then enqueue."""

    def enqueue(
        self,
        ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        ttft_slo: float | None = None,
        generated: int = 0,
        after: str | None = None,
    ) -> str:
        """Take a checked request; its id. generated: a request resumed after a fail-over, whose last `generated`
        ids it generated already (its text resumes there; a cluster refuses one, as only a replica is a
        fail-over's engine). after: a live request with the same prompt (a sibling, n > 1) whose prefill it may
        wait for, to share its KV."""

    def abort(self, request_id: str) -> bool:
        """End a request now; False if it was not live."""

    def step(self) -> list[RequestOutput]:
        """One iteration: every live request's new tokens and text (raises StepFailed, naming the requests ended)."""

    def has_unfinished(self) -> bool: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_preemptions(self) -> int: ...

    @property
    def events(self) -> Mapping[str, int]:
        """Scheduling events counted since start, by kind (a cluster's chunks, moves and transfers)."""

    @property
    def kv(self) -> KVUsage: ...

    @property
    def can_step(self) -> bool:
        """False while a failed step's state could not be rebuilt (recover tries again)."""

    def recover(self) -> None: ...

    @property
    def has_deferred(self) -> bool:
        """Work waits for the engine to be idle (e.g. a cost profile measured in the background)."""

    def run_deferred(self, stop: Callable[[], bool]) -> None: ...
