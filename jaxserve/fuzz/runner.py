"""Sends fuzz cases to a running server from several threads while a canary stream checks that everyone else is
still served: the canary's greedy text must never change and its inter-token gaps show any stall. Classifies
every reply: a failure is a 5xx (or an SSE error event with a 5xx code), a connection dropped (without a reply;
gRPC UNAVAILABLE, or CANCELLED the client did not ask for), an error body not in OpenAI's shape or echoing the
input at length, a gRPC UNKNOWN or INTERNAL, or a call that did not end in time (a hang)."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import http.client
import json
import random
import socket
import threading
import time
from typing import Any, Callable

import grpc

from jaxserve.fuzz.grpc_cases import GrpcCase, grpc_cases
from jaxserve.fuzz.http_cases import HttpCase, http_cases, request

BAD_GRPC = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
MAX_MESSAGE = 2000  # characters of an error message: more means the client's input was echoed at length


@dataclasses.dataclass
class FuzzVerdict:
    interface: str  # "http" or "grpc"
    kind: str
    status: str  # HTTP status code, or gRPC status name
    failure: str | None = None  # why this reply breaks the bar (None: it does not)
    case: str = ""  # the case, described, when it failed


def _error_problem(body: bytes) -> str | None:
    """What is wrong with an error reply's body: not OpenAI's shape, or a message that echoes at length."""
    try:
        error = json.loads(body)["error"]
        if not (isinstance(error["message"], str) and isinstance(error["type"], str) and "code" in error):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        return f"error not in OpenAI's shape: {body[:300]!r}"
    if len(error["message"]) > MAX_MESSAGE:
        return f"error message of {len(error['message'])} characters (input echoed): {error['message'][:200]!r}"
    return None


def _sse_server_error(body: bytes) -> bool:
    """An SSE `error` event with a 5xx code inside a 200 stream."""
    for line in body.split(b"\n"):
        if line.startswith(b'data: {"error"'):
            try:
                if int(json.loads(line[6:])["error"]["code"]) >= 500:
                    return True
            except (ValueError, KeyError, TypeError):
                return True
    return False


def send_http(port: int, case: HttpCase, timeout: float) -> FuzzVerdict:
    def out(status: str, failure: str | None = None) -> FuzzVerdict:
        return FuzzVerdict("http", case.kind, status, failure, case.describe() if failure else "")

    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    except OSError as e:
        return out("refused", f"could not connect: {e}")
    try:
        try:
            sock.sendall(case.request)
        except OSError:
            pass  # the server may close early (e.g. 413 before the body); its reply is still read
        reply = http.client.HTTPResponse(sock)
        try:
            reply.begin()
        except (http.client.RemoteDisconnected, ConnectionResetError, http.client.BadStatusLine) as e:
            return out("dropped", f"no reply: {type(e).__name__}: {e}")
        status = reply.status
        body = reply.read(64) if case.leave_early and status == 200 else reply.read()
        if status >= 500 or _sse_server_error(body):
            return out(str(status), f"server error: {body[:500]!r}")
        problem = _error_problem(body) if case.in_app and status >= 400 else None
        return out(str(status), problem)
    except TimeoutError:
        return out("timeout", f"no complete reply within {timeout:g} s")
    except (http.client.HTTPException, OSError) as e:  # a reply begun, then broken off or garbled
        return out("cut", f"reply cut off: {type(e).__name__}: {e}")
    finally:
        sock.close()


def send_grpc(channel: grpc.Channel, case: GrpcCase) -> FuzzVerdict:
    metadata = None if case.key is None else (("authorization", f"Bearer {case.key}"),)
    raw = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        if case.streaming:
            call = channel.unary_stream(case.method, **raw)(case.payload, timeout=case.timeout, metadata=metadata)
            for _ in call:
                if case.cancel_after_first:
                    call.cancel()
                    break
        else:
            channel.unary_unary(case.method, **raw)(case.payload, timeout=case.timeout, metadata=metadata)
        code = grpc.StatusCode.OK
        details = ""
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
    failure = None
    if code in BAD_GRPC:
        failure = f"{code.name}: {details[:500]}"
    elif code is grpc.StatusCode.UNAVAILABLE:  # the connection dropped (the server is never shutting down here)
        failure = f"dropped: {details[:500]}"
    elif code is grpc.StatusCode.CANCELLED and not case.cancel_after_first:
        failure = f"cancelled by the server: {details[:500]}"
    elif code is grpc.StatusCode.DEADLINE_EXCEEDED and case.timeout >= 10:
        failure = f"no end within its {case.timeout:g} s deadline"
    elif len(details) > MAX_MESSAGE:
        failure = f"status message of {len(details)} characters (input echoed): {details[:200]!r}"
    return FuzzVerdict("grpc", case.kind, code.name, failure, case.describe() if failure else "")


class Canary:
    """Streams one greedy completion again and again over HTTP while the fuzz runs; records each run's text and
    the largest gap between two of its tokens."""

    def __init__(self, port: int, model: str, key: str | None, max_tokens: int = 32):
        body = json.dumps(
            {
                "model": model,
                "prompt": "The history of the Roman Empire began",
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        self._request = request("POST", "/v1/completions", body, key)
        self.port = port
        self.texts: list[str] = []
        self.gaps: list[float] = []  # between consecutive tokens of one run
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fuzz-canary", daemon=True)

    def run_once(self) -> str:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=120)
        try:
            sock.sendall(self._request)
            reply = http.client.HTTPResponse(sock)
            reply.begin()
            if reply.status != 200:
                raise RuntimeError(f"canary got {reply.status}: {reply.read()[:300]!r}")
            parts, last = [], None
            while line := reply.readline():
                if not line.startswith(b"data: {"):
                    continue
                now = time.monotonic()
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"canary stream error: {event['error']}")
                text = event["choices"][0]["text"] if event["choices"] else ""
                if text:
                    if last is not None:
                        self.gaps.append(now - last)
                    last = now
                    parts.append(text)
            return "".join(parts)
        finally:
            sock.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.texts.append(self.run_once())
            except Exception as e:  # noqa: BLE001 - recorded: a canary that cannot run is a finding
                self.errors.append(f"{type(e).__name__}: {e}")
                time.sleep(0.5)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclasses.dataclass
class FuzzReport:
    outcomes: list[FuzzVerdict]
    canary_expected: str
    canary_texts: list[str]
    canary_errors: list[str]
    canary_max_gap_s: float
    canary_p99_gap_s: float
    seconds: float

    def count(self, interface: str) -> int:
        return sum(o.interface == interface for o in self.outcomes)

    @property
    def failures(self) -> list[FuzzVerdict]:
        return [o for o in self.outcomes if o.failure]

    @property
    def canary_changed(self) -> int:
        return sum(t != self.canary_expected for t in self.canary_texts)

    def statuses(self) -> dict[str, dict[str, int]]:
        """Per interface, how many replies of each status."""
        table: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for o in self.outcomes:
            table[o.interface][o.status] += 1
        return {k: dict(sorted(v.items())) for k, v in table.items()}

    def summary(self) -> dict[str, Any]:
        return {
            "http_requests": self.count("http"),
            "grpc_calls": self.count("grpc"),
            "failures": len(self.failures),
            "statuses": self.statuses(),
            "canary_runs": len(self.canary_texts),
            "canary_changed": self.canary_changed,
            "canary_errors": len(self.canary_errors),
            "canary_max_gap_s": round(self.canary_max_gap_s, 3),
            "canary_p99_gap_s": round(self.canary_p99_gap_s, 3),
            "seconds": round(self.seconds, 1),
        }


def fuzz(
    http_port: int,
    grpc_port: int,
    *,
    model: str,
    key: str | None,
    n_http: int,
    n_grpc: int,
    seed: int = 0,
    workers: int = 8,
    timeout: float = 120.0,
    progress: Callable[[int], None] | None = None,
) -> FuzzReport:
    """Run n_http + n_grpc hostile requests (mixed, `workers` at a time) against the server with a canary
    stream beside them. `progress(k)` is called as each request ends."""
    rng = random.Random(seed)
    cases: list[HttpCase | GrpcCase] = [*http_cases(rng, n_http, model, key), *grpc_cases(rng, n_grpc, key)]
    rng.shuffle(cases)
    canary = Canary(http_port, model, key)
    expected = canary.run_once()  # on the quiet server
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=[("grpc.max_receive_message_length", 64 << 20)])
    start = time.monotonic()
    canary.start()

    def one(case: HttpCase | GrpcCase) -> FuzzVerdict:
        return send_http(http_port, case, timeout) if isinstance(case, HttpCase) else send_grpc(channel, case)

    outcomes = []
    try:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for outcome in pool.map(one, cases):
                outcomes.append(outcome)
                if progress:
                    progress(1)
    finally:
        canary.stop()
        channel.close()
    gaps = sorted(canary.gaps) or [0.0]
    return FuzzReport(
        outcomes,
        expected,
        canary.texts,
        canary.errors,
        gaps[-1],
        gaps[int(0.99 * (len(gaps) - 1))],
        time.monotonic() - start,
    )
