"""OpenAI-compatible HTTP API (FastAPI): /v1/completions and /v1/chat/completions (SSE streaming or one JSON
reply), /v1/models and /v1/models/{id}, vLLM's /tokenize, /detokenize and /version, /health, /metrics. Every reply
carries an X-Request-Id header.

Errors use OpenAI's shape, {"error": {"message", "type", "code"}}, with 400 for bad input (bad JSON and wrong
types included), 401 without the API key, 408 for a body that does not arrive in time, 413 for one over the
limit, 429 when the queue is full, 503 while shutting down, 500 for a fault of the server's own; every one is
counted in jaxserve_request_errors_total by reason. /health and /metrics need no key, so probes and scrapers
work unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable, NamedTuple, Sequence

import numpy as np

from absl import logging
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxserve import tool_calls
from jaxserve.engine.engine import TokenLogprob
from jaxserve.server.async_engine import NOT_ACCEPTING, RequestStream, ShuttingDown, merged
from jaxserve.server.frontend import REFUSED, Frontend, ReadTimeout, TooLarge, Unauthenticated, excerpt, refusal
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ReplyOptions,
    TokenizeRequest,
    rendering,
)

OPEN_PATHS = ("/health", "/metrics")  # served without the API key


def _error_body(message: str, error_type: str, status: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": None, "code": status}}


class _RequireApiKey:
    """ASGI middleware: every request but /health and /metrics (probes, scrapers) must carry the API key,
    checked before the body is read; /docs and /openapi.json included."""

    def __init__(self, app: Any, frontend: Frontend):
        self.app = app
        self.frontend = frontend

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = dict(scope["headers"]).get(b"authorization")
            try:
                self.frontend.authorize(header.decode("latin-1") if header else None)
            except Unauthenticated as e:
                await _refuse(self.frontend, e)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _RequestId:
    """ASGI middleware: every reply carries an X-Request-Id header (OpenAI sends one; vLLM echoes the client's):
    the request's own if it sent a short printable one, else a new one."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"")
        rid = (
            given
            if 0 < len(given) <= 128 and given.isascii() and given.decode().isprintable()
            else uuid.uuid4().hex.encode()
        )

        async def with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, with_id)


class _ReadBody:
    """ASGI middleware: a request body is read whole, up to `max_bytes` (413 past it, from Content-Length before
    reading) and within `timeout` seconds per read (408 for a client that stalls; 503 if the server begins to
    drain meanwhile), before any parsing; the app then reads it from memory."""

    def __init__(self, app: Any, frontend: Frontend, max_bytes: int, timeout: float):
        self.app, self.frontend, self.max_bytes, self.timeout = app, frontend, max_bytes, timeout

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        body, more = bytearray(), True
        closing = asyncio.ensure_future(self.frontend.engine.closing.wait())  # draining: refuse at once
        try:
            while more:
                receiving = asyncio.ensure_future(receive())
                await asyncio.wait((receiving, closing), timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
                if not receiving.done():
                    receiving.cancel()
                    error = (
                        ShuttingDown(NOT_ACCEPTING)
                        if closing.done()
                        else ReadTimeout(f"the request body did not arrive within {self.timeout:g} s")
                    )
                    await self._answer(error, scope, receive, send)
                    return
                message = receiving.result()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                if len(body) > self.max_bytes:
                    await self._too_large(scope, receive, send)
                    return
                more = message.get("more_body", False)
        finally:
            closing.cancel()
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect the handlers watch for
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, scope: dict, receive: Callable, send: Callable) -> None:
        error = TooLarge(f"the request body is over this server's limit of {self.max_bytes} bytes")
        await self._answer(error, scope, receive, send)

    async def _answer(self, error: Exception, scope: dict, receive: Callable, send: Callable) -> None:
        """Refuse, and close the connection: the rest of the body is never read."""
        await _refuse(self.frontend, error, headers={"Connection": "close"})(scope, receive, send)


def _refuse(frontend: Frontend, error: Exception, headers: dict[str, str] | None = None) -> JSONResponse:
    r = refusal(error)
    frontend.engine.metrics.errors.labels(r.reason).inc()
    return JSONResponse(
        _error_body(str(error), r.error_type, r.http_status), status_code=r.http_status, headers=headers
    )


def _validation_message(error: RequestValidationError, most: int = 5) -> str:
    """What is wrong, field by field (the first few), without echoing the values sent."""
    parts = []
    for e in error.errors()[:most]:
        where = ".".join(str(x) for x in e["loc"] if x != "body")
        parts.append(f"{excerpt(where)}: {e['msg']}" if where else e["msg"])
    more = len(error.errors()) - most
    return "invalid request: " + "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Echo(NamedTuple):
    """A completion's prompt as echo returns it: its text, and with logprobs each token's (None for the first);
    for chat the last message's content (no ids, no logprobs)."""

    text: str
    ids: list[int]
    logprobs: list[TokenLogprob | None] | None


class _Reply:
    """Builds one request's reply: the JSON object or the SSE chunks, in completion or chat form, with logprobs
    when asked (OpenAI's legacy shape for completions, its `content` list for chat)."""

    def __init__(
        self,
        frontend: Frontend,
        submitted: tuple[list[RequestStream], list],
        chat: bool,
        options: ReplyOptions,
        echo: list[_Echo] | None = None,
        tools: tool_calls.ToolPlan | None = None,
        prompt_logprobs: list[list[dict | None]] | None = None,
    ):
        """submitted: _submit_all's streams and groups; options: what the reply shows beside the text; echo: each
        prompt's; tools: how the model writes tool calls and whether it must (None where no calls are read);
        prompt_logprobs: each prompt's in vLLM's shape (_vllm_prompt_logprobs), where asked."""
        self.frontend = frontend
        self.streams, self.groups = submitted
        self.chat = chat
        self.options = options
        self.logprobs = options.logprobs
        # each stream's prompt echo
        self.echo = None if echo is None else [e for e, (group, _) in zip(echo, self.groups) for _ in group]
        self.prompt_logprobs = (
            None
            if prompt_logprobs is None
            else [lps for lps, (group, _) in zip(prompt_logprobs, self.groups) for _ in group]
        )
        # each choice's text and calls
        self.readers = [
            tool_calls.Reader(tools.format, tools.forced) if tools else tool_calls.Reader(None) for _ in self.streams
        ]
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _logprobs(self, lps: list[TokenLogprob], offset: int = 0, echo: _Echo | None = None) -> dict | None:
        """A choice's logprobs object for these tokens; `offset`: where their text starts in the choice's text.
        With `echo`: the prompt's tokens first (the first with no logprob)."""
        if self.logprobs is None:
            return None
        text = self.frontend.token_text
        # how a token is named: its text, or vLLM's "token_id:N" (return_tokens_as_token_ids)
        name = (lambda t: f"token_id:{t}") if self.options.tokens_as_ids else text  # noqa: E731
        if self.chat:

            def entry(token: int, logprob: float) -> dict[str, Any]:
                return {"token": name(token), "logprob": logprob, "bytes": list(text(token).encode())}

            return {
                "content": [
                    {**entry(x.token, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]} for x in lps
                ],
                "refusal": None,
            }
        pairs = [*zip(echo.ids, echo.logprobs), *((x.token, x) for x in lps)] if echo else [(x.token, x) for x in lps]
        tokens = [text(t) for t, _ in pairs]
        starts = np.cumsum([0, *map(len, tokens)])[:-1]
        if echo:  # the completion's tokens start where the prompt's text ends; a prompt's token texts can be
            # longer than its text (a character split over tokens reads U+FFFD in each): never past its end
            n = len(echo.ids)
            starts[:n] = np.minimum(starts[:n], len(echo.text))
            starts[n:] += len(echo.text) - sum(map(len, tokens[:n]))
        return {
            "tokens": [name(t) for t, _ in pairs],
            "token_logprobs": [None if x is None else x.logprob for _, x in pairs],
            "top_logprobs": [
                None if x is None else {name(t): v for t, v in (*x.top, (x.token, x.logprob))} for _, x in pairs
            ],
            "text_offset": (starts + offset).tolist(),
        }

    def _envelope(self, obj: str, **fields: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.frontend.model_name, **fields}

    def _usage(self) -> dict[str, Any]:
        prompt = sum(len(self.streams[group[0]].prompt_ids) for group, _ in self.groups)  # once per prompt
        completion = sum(s.num_generated for s in self.streams)
        cached = sum(s.cached_tokens for s in self.streams)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def whole(self, request: Request) -> JSONResponse:
        """Wait for every request to finish; a client that leaves first has its requests aborted."""
        texts: list[list[str]] = [[] for _ in self.streams]
        reasons: list[str | None] = [None] * len(self.streams)
        logprobs: list[list[TokenLogprob]] = [[] for _ in self.streams]
        ids: list[list[int]] = [[] for _ in self.streams]
        stops: list[str | int | None] = [None] * len(self.streams)

        async def collect() -> None:
            async with contextlib.aclosing(merged(self.streams)) as outputs:
                async for i, out in outputs:
                    texts[i].append(out.new_text)
                    logprobs[i] += out.logprobs or ()
                    ids[i] += out.new_token_ids
                    if out.finished:
                        reasons[i], stops[i] = out.finish_reason.value, out.stop

        work = asyncio.ensure_future(collect())
        watch = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()  # the client left: closing the streams aborts the requests
                # the cancellation runs at the task's next step: until then it has neither result nor exception
                await asyncio.wait([work])
        if work.cancelled():
            return Response(status_code=499)  # nobody is listening
        if isinstance(work.exception(), REFUSED):
            return _refuse(self.frontend, work.exception())
        work.result()
        choices = []
        for group, params in self.groups:  # with best_of: the n samples of the highest total logprob
            for i in (group[k] for k in params.kept([logprobs[i] for i in group])):
                text = "".join(texts[i])
                echo = self.echo[i] if self.echo else None
                reason = reasons[i]
                if self.chat:
                    content = self.readers[i].feed(text)
                    rest, calls = self.readers[i].finish()
                    message = {"role": "assistant", "content": (echo.text if echo else "") + content + rest}
                    if calls or self.readers[i].forced:  # OpenAI's: no content is null beside calls
                        message["content"] = message["content"] or None
                    if calls:
                        message["tool_calls"] = [c.openai() for c in calls]
                        reason = "tool_calls"
                    body = {"message": message}
                else:
                    body = {"text": echo.text + text if echo else text}
                choices.append(
                    {
                        "index": len(choices),
                        **body,
                        "logprobs": self._logprobs(logprobs[i], echo=echo),
                        "finish_reason": reason,
                        "matched_stop": stops[i],
                        **self._token_ids(i, ids[i], prompt=True),
                        **self._choice_prompt_logprobs(i),
                    }
                )
        obj = "chat.completion" if self.chat else "text_completion"
        return JSONResponse(self._envelope(obj, choices=choices, usage=self._usage(), **self._chat_prompt_ids()))

    def _token_ids(self, i: int, ids: list[int], prompt: bool) -> dict[str, Any]:
        """A choice's token ids (vLLM's return_token_ids): these, and for a completion the prompt's."""
        if not self.options.token_ids:
            return {}
        shown = {"token_ids": ids}
        return shown | ({"prompt_token_ids": self.streams[i].prompt_ids} if prompt and not self.chat else {})

    def _chat_prompt_ids(self) -> dict[str, Any]:
        """A chat reply's prompt token ids and logprobs (vLLM's return_token_ids and prompt_logprobs: beside the
        choices)."""
        if not self.chat:
            return {}
        return ({"prompt_token_ids": self.streams[0].prompt_ids} if self.options.token_ids else {}) | (
            {"prompt_logprobs": self.prompt_logprobs[0]} if self.prompt_logprobs else {}
        )

    def _choice_prompt_logprobs(self, i: int) -> dict[str, Any]:
        """A completion choice's prompt logprobs (vLLM's prompt_logprobs), where asked."""
        return {"prompt_logprobs": self.prompt_logprobs[i]} if self.prompt_logprobs and not self.chat else {}

    def streaming(self) -> StreamingResponse:
        return StreamingResponse(self._events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def _chunk(
        self,
        i: int,
        text: str | None,
        reason: str | None,
        role: bool = False,
        logprobs: dict | None = None,
        calls: list[dict[str, Any]] | None = None,
        ids: list[int] = (),
        first: bool = False,
        stop: str | int | None = None,
    ) -> str:
        """One choice's chunk; ids: its new token ids, first: its first chunk (where prompt ids go); stop: with
        the reason, what stopped it (SGLang's matched_stop)."""
        usage = {"usage": self._usage()} if self.options.continuous_usage else {}
        ended = {"matched_stop": stop} if reason else {}
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
            if calls:  # the tool calls' pieces (tool_calls.Reader.deltas)
                delta["tool_calls"] = calls
            choice = {
                "index": i,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": reason,
                **ended,
                **self._token_ids(i, list(ids), prompt=False),
            }
            body = self._envelope(
                "chat.completion.chunk",
                choices=[choice],
                **usage,
                **(self._chat_prompt_ids() if role and i == 0 else {}),
            )
        else:
            choice = {
                "index": i,
                "text": text or "",
                "logprobs": logprobs,
                "finish_reason": reason,
                **ended,
                **self._token_ids(i, list(ids), prompt=first),
                **(self._choice_prompt_logprobs(i) if first else {}),
            }
            body = self._envelope("text_completion", choices=[choice], **usage)
        return _sse(body)

    async def _events(self) -> AsyncIterator[str]:
        if self.chat:  # OpenAI opens each chat choice with the role
            for i in range(len(self.streams)):
                yield self._chunk(i, None, None, role=True)
        offsets = [0] * len(self.streams)  # each completion's text so far (logprobs' text_offset)
        started = [False] * len(self.streams)  # each choice's first chunk sent
        for i, echo in enumerate(self.echo or ()):  # the prompts first
            yield self._chunk(i, echo.text, None, logprobs=self._logprobs([], echo=echo), first=True)
            offsets[i], started[i] = len(echo.text), True
        try:
            async with contextlib.aclosing(merged(self.streams)) as outputs:
                async for i, out in outputs:
                    text = self.readers[i].feed(out.new_text) if self.chat else out.new_text
                    reason, calls = None, self.readers[i].deltas() if self.chat else None
                    if out.finished:  # the last token's chunk carries the reason (vLLM's), not one of its own
                        reason = out.finish_reason.value
                        if self.chat:  # what the reader held back: the rest of the text, and the calls' pieces
                            rest, last, is_calls = self.readers[i].finish_deltas()
                            text, calls = text + rest, calls + last
                            reason = "tool_calls" if is_calls else reason
                    if text or calls or out.logprobs or reason or (self.options.token_ids and out.new_token_ids):
                        logprobs = self._logprobs(out.logprobs or [], offsets[i])
                        yield self._chunk(
                            i,
                            text or None,
                            reason,
                            logprobs=logprobs,
                            calls=calls,
                            ids=out.new_token_ids,
                            first=not started[i],
                            stop=out.stop,
                        )
                        offsets[i], started[i] = offsets[i] + len(text), True
        except REFUSED as e:  # e.g. the server shut down mid-stream: say so in the stream, then end it
            r = refusal(e)
            self.frontend.engine.metrics.errors.labels(r.reason).inc()
            yield _sse(_error_body(str(e), r.error_type, r.http_status))
        else:
            if self.options.include_usage:
                obj = "chat.completion.chunk" if self.chat else "text_completion"
                yield _sse(self._envelope(obj, choices=[], usage=self._usage()))
        yield "data: [DONE]\n\n"


def _scores(frontend: Frontend, echo: list[_Echo], options: ReplyOptions) -> JSONResponse:
    """A completion of max_tokens 0 with echo: each prompt and its logprobs, nothing generated (nothing queued)."""
    reply = _Reply(frontend, ([], []), chat=False, options=options)
    prompt = sum(len(e.ids) for e in echo)
    choices = [
        {
            "index": i,
            "text": e.text,
            "logprobs": reply._logprobs([], echo=e),
            "finish_reason": "length",
            "matched_stop": None,
            **({"prompt_token_ids": e.ids, "token_ids": []} if options.token_ids else {}),
        }
        for i, e in enumerate(echo)
    ]
    return JSONResponse(
        reply._envelope(
            "text_completion",
            choices=choices,
            usage={
                "prompt_tokens": prompt,
                "completion_tokens": 0,
                "total_tokens": prompt,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        )
    )


def _vllm_prompt_logprobs(frontend: Frontend, scored: list[TokenLogprob | None], k: int) -> list[dict | None]:
    """A prompt's logprobs in vLLM's shape: per token None (the first) or {token id: {logprob, rank,
    decoded_token}}, the prompt's token first, then the k most likely."""

    def entry(logprob: float, rank: int, token: int) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": frontend.token_text(token)}

    return [
        None
        if x is None
        else {str(x.token): entry(x.logprob, x.rank, x.token)}
        | {str(t): entry(v, r, t) for r, (t, v) in enumerate(x.top[:k], start=1) if t != x.token}
        for x in scored
    ]


async def _scored(frontend: Frontend, prompts: list[list[int]], k: int | None) -> list[list[dict | None]] | None:
    """Each prompt's logprobs in vLLM's shape, where asked (k: prompt_logprobs)."""
    if k is None:
        return None
    return [_vllm_prompt_logprobs(frontend, await frontend.prompt_logprobs(ids, k), k) for ids in prompts]


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _submit_all(
    frontend: Frontend, prompts: list[list[int]], default_max_tokens: int | None, sampling: dict[str, Any]
) -> tuple[list[RequestStream], list[tuple[list[int], SamplingParams]]]:
    """Queue every prompt's samples, or none: if one is refused, the ones already queued are withdrawn. The
    streams (each prompt's samples together), and each prompt's streams (indices) and params."""
    ttft_slo = sampling.pop("ttft_slo", None)
    params = [frontend.params(ids, default_max_tokens=default_max_tokens, **sampling) for ids in prompts]
    streams: list[RequestStream] = []
    groups = []
    try:
        for ids, p in zip(prompts, params):
            group = frontend.submit(ids, p, ttft_slo)
            groups.append((list(range(len(streams), len(streams) + len(group))), p))
            streams += group
    except REFUSED:
        for s in streams:
            s.close()
        raise
    return streams, groups


def build_http_app(
    frontend: Frontend, max_body_bytes: int = 32 << 20, read_timeout: float = 30.0, allowed_origins: Sequence[str] = ()
) -> FastAPI:
    """max_body_bytes: the largest request body read (413 past it); read_timeout: seconds a client may take
    between two pieces of its body (408 past it); allowed_origins: the origins whose browser pages may call the
    API (CORS; "*": any)."""
    app = FastAPI(title="jaxserve", description="OpenAI-compatible API of a jaxserve server.")
    # added last, runs first: the key is checked before the body is read
    app.add_middleware(_ReadBody, frontend=frontend, max_bytes=max_body_bytes, timeout=read_timeout)
    app.add_middleware(_RequireApiKey, frontend=frontend)
    app.add_middleware(_RequestId)  # outside the key check and the body limit: their refusals carry it too
    if allowed_origins:  # outermost: a preflight (which carries no key) is answered, and refusals carry CORS headers
        app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"]
        )
    started = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        return _refuse(frontend, ValueError(_validation_message(error)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        # e.g. a body FastAPI cannot parse, an unknown path or method: OpenAI's error shape all the same
        frontend.engine.metrics.errors.labels("invalid" if error.status_code < 500 else "internal").inc()
        error_type = "invalid_request_error" if error.status_code < 500 else "server_error"
        return JSONResponse(
            _error_body(str(error.detail), error_type, error.status_code),
            status_code=error.status_code,
            headers=getattr(error, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _internal(_: Request, error: Exception) -> JSONResponse:
        logging.exception("unhandled error in an HTTP handler", exc_info=error)
        frontend.engine.metrics.errors.labels("internal").inc()
        return JSONResponse(_error_body("internal server error", "server_error", 500), status_code=500)

    for kind in REFUSED:
        app.add_exception_handler(kind, lambda _, error: _refuse(frontend, error))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        frontend.check_model(body.model)
        scores_only = body.scores_only()
        sampling = body.sampling()
        frontend.check_batch(len(body.prompts()) * (body.best_of or body.n))
        given = [await frontend.encode(p) if isinstance(p, str) else p for p in body.prompts()]
        prompts = [body.truncated(ids, frontend.max_model_len) for ids in given]
        echo = None
        if body.echo:
            # a prompt of token ids (or a truncated one) echoes as their text, control tokens included (as logprobs
            # list them)
            echo = [
                _Echo(
                    p
                    if isinstance(p, str) and len(ids) == len(whole)
                    else await frontend.decode(ids, skip_special_tokens=False),
                    ids,
                    None if body.logprobs is None else await frontend.prompt_logprobs(ids, body.logprobs),
                )
                for p, whole, ids in zip(body.prompts(), given, prompts)
            ]
        if scores_only:
            return _scores(frontend, echo, body.reply_options())
        scored = await _scored(frontend, prompts, body.prompt_logprobs_k())  # before anything is queued
        # 16: OpenAI's default max_tokens for completions
        reply = _Reply(
            frontend,
            _submit_all(frontend, prompts, 16, sampling),
            chat=False,
            options=body.reply_options(),
            echo=echo,
            prompt_logprobs=scored,
        )
        return reply.streaming() if body.stream else await reply.whole(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        frontend.check_model(body.model)
        sampling = body.sampling()
        tools = body.tool_plan(frontend.llm.tokenizer.chat_template)
        if tools is None:
            prompt = await frontend.encode_chat([m.as_dict() for m in body.messages], **rendering(body))
        else:
            prompt = await frontend.encode_chat(tools.messages, tools.tools, **rendering(body))
            sampling["structured_output"] = tools.structured_output or sampling["structured_output"]
            if tools.control_text:  # the calls open with a control token the reader must see
                sampling["skip_special_tokens"] = False
        prompt = body.truncated(prompt, frontend.max_model_len)
        scored = await _scored(frontend, [prompt], body.prompt_logprobs_k())  # before anything is queued
        echoed = body.echoed()
        reply = _Reply(
            frontend,
            _submit_all(frontend, [prompt], None, sampling),
            chat=True,
            options=body.reply_options(),
            tools=tools,
            prompt_logprobs=scored,
            echo=None if echoed is None else [_Echo(echoed, [], None)],
        )
        return reply.streaming() if body.stream else await reply.whole(request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            frontend.check_model(body.model)
        body.check()
        tools = body.tool_plan(frontend.llm.tokenizer.chat_template) if body.messages is not None else None
        if body.prompt is not None:
            ids = await frontend.encode(body.prompt, body.add_special_tokens is not False)
        elif tools is None:
            ids = await frontend.encode_chat([m.as_dict() for m in body.messages], **rendering(body))
        else:
            ids = await frontend.encode_chat(tools.messages, tools.tools, **rendering(body))
        strs = {"token_strs": [frontend.token_text(t) for t in ids]} if body.return_token_strs else {}
        return {"count": len(ids), "max_model_len": frontend.max_model_len, "tokens": ids, **strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            frontend.check_model(body.model)
        return {"prompt": await frontend.decode(body.tokens)}

    def card() -> dict[str, Any]:
        return {
            "id": frontend.model_name,
            "object": "model",
            "created": started,
            "owned_by": "jaxserve",
            "max_model_len": frontend.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        frontend.check_model(model_id, required=True)  # OpenAI's retrieve-model: 404 for one not served
        return card()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": importlib.metadata.version("jaxserve")}

    @app.get("/health")
    async def health() -> Response:
        engine = frontend.engine
        ok = engine.accepting and engine.healthy
        # degraded: serving on what remained after a lost process
        status = ("degraded" if engine.failed_over else "ok") if ok else "unavailable"
        return JSONResponse(
            {"status": status} | ({"lost": engine.lost} if engine.lost else {}), status_code=200 if ok else 503
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(frontend.engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
