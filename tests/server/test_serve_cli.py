"""The launcher as users run it: `python -m jaxserve serve` in a subprocess, `python -m jaxserve client`, the API
key on both interfaces, and SIGTERM draining."""

from __future__ import annotations

import http.client
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest

from jaxserve import SamplingParams
from jaxserve.client import Client
from jaxserve.server.spawn import ServerProcess

KEY = "cli-key"
DRAIN_S = 5.0


@pytest.fixture(scope="module")
def server():
    """One server for the module: the client test uses it, then the SIGTERM test drains it (file order)."""
    # everything compiled before listening: the drain's timing must not share the CPU with a background compile
    # (quick start, serve's default, is run by tests/engine/test_profile.py's bench_startup test). test_fuzz.py's
    # shapes: its programs and cost profile, cached by then, are loaded rather than compiled and measured again.
    s = ServerProcess(
        "--max_model_len=1024",
        "--kv_cache_gib=0.25",
        "--max_num_seqs=8",
        f"--api_key={KEY}",
        f"--drain_timeout={DRAIN_S:g}",
        "--noquick_start",
    )
    yield s.proc, s.grpc_port, s.http_port, s.log
    if s.proc.poll() is None:
        s.proc.kill()
    s.proc.wait()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxserve", *args], capture_output=True, text=True, timeout=600)


def http_status(port: int, method: str, path: str, key: str | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request(
        method, path, body="{}" if method == "POST" else None, headers={"Authorization": f"Bearer {key}"} if key else {}
    )
    return conn.getresponse().status


def test_client_command_streams_the_reply_and_the_key_guards_both_interfaces(llm, server):
    _, grpc_port, http_port, _ = server
    prompt = "What is the capital of France?"
    args = ("client", f"--target=127.0.0.1:{grpc_port}", f"--prompt={prompt}", "--max_tokens=12")
    proc = run_cli(*args, f"--api_key={KEY}")
    assert proc.returncode == 0, proc.stderr
    (expected,) = llm.chat([{"role": "user", "content": prompt}], SamplingParams(max_tokens=12))
    assert proc.stdout == expected.text + "\n"

    refused = run_cli(*args)
    assert refused.returncode == 2
    assert "UNAUTHENTICATED" in refused.stderr and "API key" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert http_status(http_port, "GET", "/v1/models") == 401
    assert http_status(http_port, "GET", "/v1/models", KEY) == 200


def test_sigterm_drains_in_flight_streams_and_refuses_new_requests(server):
    proc, grpc_port, http_port, server_log = server
    client = Client(f"127.0.0.1:{grpc_port}", api_key=KEY)
    started = {name: threading.Event() for name in ("long", "short")}
    results: dict[str, object] = {}

    def consume(name: str, max_tokens: int) -> None:
        parts = []
        try:
            for reply in client.stream("Tell me a long story.", max_tokens=max_tokens, ignore_eos=True):
                parts.append(reply)
                started[name].set()
            results[name] = parts
        except grpc.RpcError as e:
            results[name] = e
        started[name].set()

    # The long request cannot finish within the drain; the short one can.
    threads = [
        threading.Thread(target=consume, args=("long", 900)),
        threading.Thread(target=consume, args=("short", 16)),
    ]
    threads[0].start()
    assert started["long"].wait(120)
    threads[1].start()
    assert started["short"].wait(120)
    # A client that sends half its body and goes quiet (the read timeout, 30 s, is far beyond the drain)
    stalled = socket.create_connection(("127.0.0.1", http_port))
    stalled.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\nAuthorization: Bearer " + KEY.encode() + b'\r\n\r\n{"model"'
    )
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)

    # While draining: new requests are refused, health says so.
    with pytest.raises(grpc.RpcError) as err:
        client.generate("hi", max_tokens=2)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
    assert client.health() == "NOT_SERVING"
    assert http_status(http_port, "GET", "/health") == 503
    assert http_status(http_port, "POST", "/v1/completions", KEY) in (400, 503)  # body checked before admission

    for t in threads:
        t.join(120)
    short = results["short"]
    assert not isinstance(short, Exception), short
    assert sum(len(r.token_ids) for r in short) == 16 and short[-1].usage.completion_tokens == 16
    long = results["long"]
    assert isinstance(long, grpc.RpcError) and long.code() == grpc.StatusCode.UNAVAILABLE
    assert "shut down before this request finished" in long.details()
    assert proc.wait(60) == 0
    # drain_timeout bounds the whole shutdown, the stalled client included. Before, uvicorn's own 5 s grace came
    # on top of the drain and the interpreter's exit: this bound fails that whatever the exit takes, and leaves the
    # exit 4.5 s on a loaded machine.
    assert time.monotonic() - signalled < DRAIN_S + 4.5
    # the body still arriving when draining began was refused at once, in OpenAI's shape, not cut off
    stalled.settimeout(10)
    reply = stalled.recv(65536)
    assert reply.startswith(b"HTTP/1.1 503") and b"shutting down" in reply, reply
    stalled.close()
    assert "Traceback" not in server_log(), server_log()
    client.close()
