"""gRPC clients of a jaxserve server: `Client` (blocking) and `AsyncClient` (asyncio).

    with Client("127.0.0.1:50051") as c:
        for delta in c.stream("Once upon a time", max_tokens=32):
            print(delta.text, end="")
        print(c.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=16).text)

Sampling options are the fields of jaxserve.v1.SamplingParams (max_tokens, temperature, top_k, top_p, seed,
stop, stop_token_ids, ignore_eos, presence_penalty, frequency_penalty, repetition_penalty, min_p, logit_bias,
min_tokens, logprobs, n, structured_output, prompt_logprobs, allowed_token_ids, bad_words, skip_special_tokens).
structured_output is a dict of jaxserve.v1.StructuredOutput's fields, e.g. {"json_schema": {...}} (a schema as a
dict or its JSON text), {"regex": "[0-9]+"} or {"choice": {"options": ["yes", "no"]}}. Errors arrive as
grpc.RpcError with the server's status and message.
Imports no jax: it runs anywhere grpcio does.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, AsyncIterator, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.server.proto import jaxserve_pb2 as pb
from jaxserve.server.proto import jaxserve_pb2_grpc as pb_grpc

Messages = Sequence[dict[str, str]]


@dataclasses.dataclass
class Generation:
    """A whole reply, assembled from the streamed messages."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    time_to_first_token_s: float
    total_s: float
    cached_tokens: int = 0  # prompt tokens the server found in its prefix cache
    logprobs: list[pb.TokenLogprob] = dataclasses.field(default_factory=list)  # with the logprobs option
    prompt_logprobs: list[pb.TokenLogprob] = dataclasses.field(default_factory=list)  # with prompt_logprobs


def _generate_request(
    prompt: str | Sequence[int] | None, messages: Messages | None, model: str, params: dict[str, Any]
) -> pb.GenerateRequest:
    if (prompt is None) == (messages is None):
        raise ValueError("give either a prompt (text or token ids) or chat messages")
    params = {k: v for k, v in params.items() if v is not None}
    if isinstance(params.get("structured_output", {}).get("json_schema"), dict):
        params["structured_output"] = {
            **params["structured_output"],
            "json_schema": json.dumps(params["structured_output"]["json_schema"]),
        }
    request = pb.GenerateRequest(model=model, params=pb.SamplingParams(**params))
    if messages is not None:
        request.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    elif isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def _one_sample(params: dict[str, Any]) -> dict[str, Any]:
    if params.get("n", 1) not in (0, 1, None):
        raise ValueError("generate() returns one sample: use samples() for n > 1")
    return params


def _tokenize_request(text: str | None, messages: Messages | None, model: str) -> pb.TokenizeRequest:
    if (text is None) == (messages is None):
        raise ValueError("give either text or chat messages")
    if messages is None:
        return pb.TokenizeRequest(model=model, text=text)
    return pb.TokenizeRequest(
        model=model, chat=pb.Chat(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages])
    )


class _Assembler:
    """Whole replies from the streamed messages, one per sample (GenerateResponse.index)."""

    def __init__(self) -> None:
        self.parts: dict[int, list[pb.GenerateResponse]] = {}

    def add(self, reply: pb.GenerateResponse) -> None:
        self.parts.setdefault(reply.index, []).append(reply)

    def results(self) -> list[Generation]:
        return [self._one(self.parts[i]) for i in sorted(self.parts)]

    @staticmethod
    def _one(parts: list[pb.GenerateResponse]) -> Generation:
        last = parts[-1]
        return Generation(
            last.request_id,
            "".join(p.text for p in parts),
            [t for p in parts for t in p.token_ids],
            pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower(),
            last.usage.prompt_tokens,
            last.timings.time_to_first_token_s,
            last.timings.total_s,
            last.usage.cached_tokens,
            [x for p in parts for x in p.logprobs],
            [x for p in parts for x in p.prompt_logprobs],
        )


class _Base:
    def __init__(self, target: str, api_key: str | None, model: str, channel: Any):
        self.target = target
        self.model = model
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._channel = channel
        self._stub = pb_grpc.JaxServeStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)


class Client(_Base):
    """Blocking client. timeout: seconds per call (the server sees it as the request's deadline)."""

    def __init__(self, target: str = "127.0.0.1:50051", *, api_key: str | None = None, model: str = ""):
        super().__init__(target, api_key, model, grpc.insecure_channel(target))

    def stream(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Messages | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> Iterator[pb.GenerateResponse]:
        """The server's messages as they arrive; leaving the loop early cancels the request."""
        call = self._stub.Generate(
            _generate_request(prompt, messages, self.model, params), timeout=timeout, metadata=self._metadata
        )
        try:
            yield from call
        finally:
            call.cancel()  # no-op once the stream ended

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Messages | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> Generation:
        (one,) = self.samples(prompt, messages=messages, timeout=timeout, **_one_sample(params))
        return one

    def samples(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Messages | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> list[Generation]:
        """The n (a params option) samples of one prompt, whole."""
        whole = _Assembler()
        for reply in self.stream(prompt, messages=messages, timeout=timeout, **params):
            whole.add(reply)
        return whole.results()

    def tokenize(self, text: str | None = None, *, messages: Messages | None = None) -> list[int]:
        return list(
            self._stub.Tokenize(_tokenize_request(text, messages, self.model), metadata=self._metadata).token_ids
        )

    def list_models(self) -> list[pb.ModelInfo]:
        return list(self._stub.ListModels(pb.ListModelsRequest(), metadata=self._metadata).models)

    def health(self, service: str = "") -> str:
        """SERVING or NOT_SERVING."""
        status = self._health.Check(health_pb2.HealthCheckRequest(service=service)).status
        return health_pb2.HealthCheckResponse.ServingStatus.Name(status)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncClient(_Base):
    """asyncio client; create it inside the event loop that uses it."""

    def __init__(self, target: str = "127.0.0.1:50051", *, api_key: str | None = None, model: str = ""):
        super().__init__(target, api_key, model, grpc.aio.insecure_channel(target))

    async def stream(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Messages | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> AsyncIterator[pb.GenerateResponse]:
        call = self._stub.Generate(
            _generate_request(prompt, messages, self.model, params), timeout=timeout, metadata=self._metadata
        )
        try:
            async for reply in call:
                yield reply
        finally:
            call.cancel()

    async def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Messages | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> Generation:
        (one,) = await self.samples(prompt, messages=messages, timeout=timeout, **_one_sample(params))
        return one

    async def samples(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Messages | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> list[Generation]:
        """The n (a params option) samples of one prompt, whole."""
        whole = _Assembler()
        async for reply in self.stream(prompt, messages=messages, timeout=timeout, **params):
            whole.add(reply)
        return whole.results()

    async def tokenize(self, text: str | None = None, *, messages: Messages | None = None) -> list[int]:
        reply = await self._stub.Tokenize(_tokenize_request(text, messages, self.model), metadata=self._metadata)
        return list(reply.token_ids)

    async def list_models(self) -> list[pb.ModelInfo]:
        return list((await self._stub.ListModels(pb.ListModelsRequest(), metadata=self._metadata)).models)

    async def health(self, service: str = "") -> str:
        status = (await self._health.Check(health_pb2.HealthCheckRequest(service=service))).status
        return health_pb2.HealthCheckResponse.ServingStatus.Name(status)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
