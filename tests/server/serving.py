"""What the in-process server's tests share (tests/server/conftest.py starts the server): its settings and
small HTTP helpers."""

from __future__ import annotations

import http.client
import json
import time

KEY = "test-key"
MODEL = "smollm2-135m-instruct"
PROMPT = "The three primary colors are"
BODY_LIMIT = 1 << 20
ORIGIN = "https://app.example"  # the one origin whose pages may call the server (CORS)


def free_blocks(served) -> int:
    return served.call(lambda: served.server.engine.engine.kv.num_free)


def initial_blocks(served) -> int:
    return served.server.engine.engine.kv.capacity


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def post(served, path: str, body: bytes | str, key: str | None = KEY) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", served.server.http_port, timeout=60)
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    conn.request("POST", path, body=body, headers=headers)
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, json.loads(payload) if payload else {}
