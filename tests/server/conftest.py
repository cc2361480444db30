"""The in-process server (gRPC + OpenAI-compatible HTTP over one engine) that test_server.py and
test_openai_compat.py drive, started once for both."""

from __future__ import annotations

import openai
import pytest

import jaxserve
from jaxserve.client import Client
from jaxserve.server.launch import BackgroundServer
from serving import BODY_LIMIT, KEY, ORIGIN


@pytest.fixture(scope="session")
def served():
    # Its own LLM (the session one answers the reference calls): a small pool and batch, so queueing happens.
    llm = jaxserve.LLM(max_model_len=1024, kv_cache_tokens=4096, max_num_seqs=8)
    with BackgroundServer(
        llm,
        grpc_port=0,
        http_port=0,
        api_key=KEY,
        max_queue=32,
        max_request_bytes=BODY_LIMIT,
        request_read_timeout=1.0,
        allowed_origins=(ORIGIN,),
    ) as s:
        yield s


@pytest.fixture(scope="session")
def grpc_client(served):
    with Client(f"127.0.0.1:{served.server.grpc_port}", api_key=KEY) as c:
        yield c


@pytest.fixture(scope="session")
def oai(served):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served.server.http_port}/v1", api_key=KEY, max_retries=0)
