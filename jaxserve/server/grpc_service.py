"""The gRPC service (jaxserve.v1.JaxServe, see protos/jaxserve.proto) on grpc.aio, with the standard health
service and server reflection.

A cancelled call (the client left, or its deadline passed: grpc cancels the handler) closes the request's
stream, which aborts it in the engine and frees its KV blocks. With an API key, JaxServe calls need the
metadata `authorization: Bearer <key>`; health and reflection stay open for probes and tools.
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet
from grpc_reflection.v1alpha import reflection

from jaxserve.engine.engine import FinishReason, TokenLogprob
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.async_engine import merged
from jaxserve.server.frontend import REFUSED, Frontend, excerpt, refusal
from jaxserve.server.proto import jaxserve_pb2 as pb
from jaxserve.server.proto import jaxserve_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxServe"].full_name
_FINISH = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH}
_DEFAULT_MAX_TOKENS = SamplingParams.max_tokens  # the proto leaves it unset: the Python API's default


class JaxServeServicer(pb_grpc.JaxServeServicer):
    def __init__(self, frontend: Frontend):
        self.frontend = frontend

    async def _refuse(self, context: grpc.aio.ServicerContext, error: Exception) -> None:
        r = refusal(error)
        self.frontend.engine.metrics.errors.labels(r.reason).inc()
        await context.abort(grpc.StatusCode[r.grpc_code], str(error))

    def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        metadata = dict(context.invocation_metadata() or ())
        self.frontend.authorize(metadata.get("authorization"))

    async def _prompt_ids(self, which: str, request: pb.GenerateRequest | pb.TokenizeRequest) -> list[int]:
        f = self.frontend
        if which == "text":
            return await f.encode(request.text)
        if which == "chat":
            return await f.encode_chat([{"role": m.role, "content": m.content} for m in request.chat.messages])
        if which == "token_ids":
            return list(request.token_ids.ids)
        raise ValueError("the request has no prompt: set text, token_ids or chat")

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            self._authorize(context)
            _check_parsed(request)
            f, p = self.frontend, request.params
            f.check_model(request.model)
            ids = await self._prompt_ids(request.WhichOneof("prompt"), request)
            params = f.params(
                ids,
                max_tokens=p.max_tokens if p.HasField("max_tokens") else None,
                default_max_tokens=_DEFAULT_MAX_TOKENS,
                temperature=p.temperature,
                top_k=p.top_k,
                top_p=p.top_p if p.HasField("top_p") else None,
                seed=p.seed if p.HasField("seed") else None,
                stop=tuple(p.stop),
                stop_token_ids=tuple(p.stop_token_ids),
                ignore_eos=p.ignore_eos,
                presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty,
                repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else None,
                min_p=p.min_p,
                logit_bias=dict(p.logit_bias),
                min_tokens=p.min_tokens,
                logprobs=p.logprobs if p.HasField("logprobs") else None,
                n=p.n or 1,
                structured_output=_structured_output(p.structured_output) if p.HasField("structured_output") else None,
                allowed_token_ids=tuple(p.allowed_token_ids) or None,
                bad_words=tuple(p.bad_words),
                skip_special_tokens=p.skip_special_tokens if p.HasField("skip_special_tokens") else None,
            )
            scored = await f.prompt_logprobs(ids, p.prompt_logprobs) if p.HasField("prompt_logprobs") else None
            streams = f.submit(ids, params, p.ttft_slo if p.HasField("ttft_slo") else None)
        except REFUSED as e:
            await self._refuse(context, e)
        # closing the merged outputs (a cancelled call) closes the streams, which aborts unfinished requests
        async with contextlib.aclosing(merged(streams)) as outputs:
            try:
                async for i, out in outputs:
                    stream = streams[i]
                    reply = pb.GenerateResponse(
                        request_id=stream.request_id,
                        token_ids=out.new_token_ids,
                        text=out.new_text,
                        index=i,
                        logprobs=[_token_logprob(x) for x in out.logprobs or ()],
                    )
                    if scored is not None:  # the prompt's, once
                        reply.prompt_logprobs.extend(_token_logprob(x) for x in scored[1:])
                        scored = None
                    if out.finished:
                        reply.finish_reason = _FINISH[out.finish_reason]
                        reply.usage.prompt_tokens = len(stream.prompt_ids)
                        reply.usage.completion_tokens = stream.num_generated
                        reply.usage.cached_tokens = stream.cached_tokens
                        reply.timings.time_to_first_token_s = stream.first_token_time - stream.arrival
                        reply.timings.total_s = stream.last_token_time - stream.arrival
                    yield reply
            except REFUSED as e:  # the server shut down or the engine failed mid-stream
                await self._refuse(context, e)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            self._authorize(context)
            _check_parsed(request)
            self.frontend.check_model(request.model)
            ids = await self._prompt_ids(request.WhichOneof("input"), request)
        except REFUSED as e:
            await self._refuse(context, e)
        return pb.TokenizeResponse(token_ids=ids, max_model_len=self.frontend.max_model_len)

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        try:
            self._authorize(context)
            _check_parsed(request)
        except REFUSED as e:
            await self._refuse(context, e)
        f = self.frontend
        return pb.ListModelsResponse(
            models=[pb.ModelInfo(id=f.model_name, max_model_len=f.max_model_len, vocab_size=f.vocab_size)]
        )


class _Malformed:
    """A request whose bytes did not parse, or that carries fields this server does not know: the handler refuses
    it with INVALID_ARGUMENT (grpc itself would answer UNKNOWN with the parser's traceback, and protobuf would
    keep unknown fields silently)."""

    def __init__(self, why: str):
        self.why = why


def _check_parsed(request: object) -> None:
    if isinstance(request, _Malformed):
        raise ValueError(request.why)


def unknown_fields(message: Message, path: str = "") -> list[str]:
    """Where `message` (and the messages inside it) carries fields its type does not declare: a newer client's
    options, which this server would otherwise ignore."""
    found = [f"{path or message.DESCRIPTOR.name} field {f.field_number}" for f in UnknownFieldSet(message)]
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        if field.message_type.GetOptions().map_entry:  # a map: its values may be messages, its keys are not
            if field.message_type.fields_by_name["value"].message_type is None:
                continue
            value = list(value.values())
        one = isinstance(value, Message)
        for i, m in enumerate([value] if one else value):
            found += unknown_fields(m, f"{path or message.DESCRIPTOR.name}.{field.name}" + ("" if one else f"[{i}]"))
    return found


def _lenient(message: type) -> Callable[[bytes], object]:
    def parse(data: bytes) -> object:
        try:
            parsed = message.FromString(data)
        except DecodeError as e:  # includes strings that are not UTF-8
            return _Malformed(f"the request is not a valid protobuf message of its type ({excerpt(str(e))})")
        unknown = unknown_fields(parsed)
        if unknown:
            return _Malformed(
                f"{', '.join(unknown[:4])}: not part of this server's API (protos/jaxserve.proto); "
                "refused rather than ignored"
            )
        return parsed

    return parse


def _add_servicer(servicer: JaxServeServicer, server: grpc.aio.Server) -> None:
    """What the generated add_JaxServeServicer_to_server does, with requests parsed by _lenient."""
    handlers = {}
    for m in pb.DESCRIPTOR.services_by_name["JaxServe"].methods:
        make = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[m.name] = make(
            getattr(servicer, m.name),
            request_deserializer=_lenient(getattr(pb, m.input_type.name)),
            response_serializer=getattr(pb, m.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def build_grpc_server(frontend: Frontend, address: str) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """The server (not started), its health servicer, and the bound port (address may end in :0)."""
    server = grpc.aio.server()
    _add_servicer(JaxServeServicer(frontend), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind the gRPC server to {address}")
    return server, health_servicer, port


async def set_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", SERVICE_NAME):  # "": the server as a whole
        await health_servicer.set(service, status)


def _structured_output(s: pb.StructuredOutput) -> dict[str, Any]:
    """The message as sampling_params.StructuredOutput's fields (it checks them)."""
    kind = s.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_output needs one of json_schema, json_object, regex, choice and grammar")
    value = {
        "json_schema": lambda: {"json": s.json_schema},
        "json_object": lambda: {"json_object": s.json_object},
        "regex": lambda: {"regex": s.regex},
        "choice": lambda: {"choice": list(s.choice.options)},
        "grammar": lambda: {"grammar": s.grammar},
    }[kind]()
    return value | {"disable_any_whitespace": s.disable_any_whitespace}


def _token_logprob(x: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=x.token, logprob=x.logprob, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in x.top]
    )
