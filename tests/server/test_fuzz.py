"""Hostile input against a real server (a `python -m jaxserve serve` process): a bounded fuzz of both interfaces
with a canary stream beside it (tools/checks/fuzz_server.py runs thousands), and the fuzz's own judge checked against
a server that misbehaves on purpose."""

from __future__ import annotations

import concurrent.futures
import http.server
import platform
import random
import socketserver
import threading

import grpc
import pytest

from jaxserve.fuzz.grpc_cases import GrpcCase, grpc_cases
from jaxserve.fuzz.http_cases import HttpCase, http_cases, request
from jaxserve.fuzz.runner import fuzz, send_grpc, send_http
from jaxserve.server.memory import release_free_memory
from jaxserve.server.spawn import ServerProcess

KEY = "fuzz-key"
MODEL = "smollm2-135m-instruct"


def test_a_bounded_fuzz_of_both_interfaces_hurts_nobody():
    """250 hostile HTTP requests and 100 gRPC calls, 4 at a time: no 5xx, no UNKNOWN/INTERNAL, no dropped
    connection, every error in OpenAI's shape and short, nothing hangs; the canary's greedy text never changes;
    the server is alive and every KV block is back at the end."""
    # --noquick_start: the fuzz's timing must not share the CPU with a background compile, and the cost profile
    # it measures (cached) is the one test_server's LLM of the same shapes loads
    with ServerProcess(
        "--max_model_len=1024",
        "--kv_cache_gib=0.25",
        "--max_num_seqs=8",
        "--max_queue=32",
        f"--api_key={KEY}",
        "--max_request_bytes=4194304",
        "--noquick_start",
    ) as server:
        report = fuzz(
            server.http_port, server.grpc_port, model=MODEL, key=KEY, n_http=250, n_grpc=100, seed=17, workers=4
        )
        assert server.proc.poll() is None
        log = server.log()
    assert not report.failures, "\n".join(f"{o.kind} {o.status}: {o.failure}\n  {o.case}" for o in report.failures)
    assert report.canary_texts and report.canary_changed == 0 and not report.canary_errors
    statuses = report.statuses()
    assert sum(statuses["http"].values()) == 250 and sum(statuses["grpc"].values()) == 100
    assert statuses["http"].get("400", 0) > 100 and statuses["grpc"].get("INVALID_ARGUMENT", 0) > 20  # hostile
    assert statuses["http"].get("200", 0) > 10 and statuses["grpc"].get("OK", 0) > 5  # and some served
    assert "Traceback" not in log


def test_cases_are_reproducible_from_the_seed():
    a, b = http_cases(random.Random(3), 50, MODEL, KEY), http_cases(random.Random(3), 50, MODEL, KEY)
    assert a == b and len({c.kind for c in a}) == 5
    assert grpc_cases(random.Random(3), 50, KEY) == grpc_cases(random.Random(3), 50, KEY)


class _Misbehaving(http.server.BaseHTTPRequestHandler):
    """Answers by path: a 500, a plain-text 400, an echoing 400, a good 400, or hangs up without a reply."""

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        self.rfile.read(int(self.headers["Content-Length"]))
        replies = {
            "/500": (500, b'{"error": {"message": "x", "type": "server_error", "code": 500}}'),
            "/plain": (400, b"Bad Request"),
            "/echo": (400, b'{"error": {"message": "' + b"m" * 5000 + b'", "type": "t", "code": 400}}'),
            "/good": (400, b'{"error": {"message": "bad", "type": "invalid_request_error", "code": 400}}'),
        }
        if self.path == "/drop":
            self.connection.close()
            return
        status, body = replies[self.path]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def misbehaving_port():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Misbehaving)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


@pytest.mark.parametrize(
    "path, failure",
    [
        ("/500", "server error"),
        ("/plain", "OpenAI's shape"),
        ("/echo", "echoed"),
        ("/drop", "no reply"),
        ("/good", None),
    ],
)
def test_the_judge_flags_each_kind_of_failure(misbehaving_port, path, failure):
    outcome = send_http(misbehaving_port, HttpCase("t", request("POST", path, b"{}")), timeout=10)
    assert (outcome.failure is None) if failure is None else (failure in outcome.failure)


def test_the_idle_server_can_give_free_heap_back():
    """Server._trim_when_idle relies on it: glibc's malloc_trim, found and called (elsewhere, a no-op)."""
    assert release_free_memory() == (platform.libc_ver()[0] == "glibc")


@pytest.fixture(scope="module")
def misbehaving_grpc():
    """A gRPC server whose one method answers with the status code named in the request."""

    def answer(request: bytes, context: grpc.ServicerContext) -> bytes:
        code = grpc.StatusCode[request.decode()]
        if code is not grpc.StatusCode.OK:
            context.abort(code, "m" * 5000 if code is grpc.StatusCode.INVALID_ARGUMENT else "x")
        return b""

    handler = grpc.method_handlers_generic_handler("t.S", {"M": grpc.unary_unary_rpc_method_handler(answer)})
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel
    server.stop(0)


@pytest.mark.parametrize(
    "code, failure",
    [
        ("INTERNAL", "INTERNAL"),
        ("UNKNOWN", "UNKNOWN"),
        ("UNAVAILABLE", "dropped"),
        ("CANCELLED", "cancelled"),
        ("INVALID_ARGUMENT", "echoed"),
        ("RESOURCE_EXHAUSTED", None),
        ("OK", None),
    ],
)
def test_the_judge_flags_each_kind_of_grpc_failure(misbehaving_grpc, code, failure):
    outcome = send_grpc(misbehaving_grpc, GrpcCase("t", "/t.S/M", code.encode(), False, None, 10.0))
    assert (outcome.failure is None) if failure is None else (failure in outcome.failure)
