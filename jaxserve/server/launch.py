"""Both interfaces over one engine in one asyncio loop: start, serve until SIGTERM/SIGINT, drain, stop.

Draining: new requests are refused (UNAVAILABLE / HTTP 503) and health reports NOT_SERVING; in-flight requests
get `drain_timeout` seconds to finish; whatever is still running then ends with UNAVAILABLE (or an SSE error
event) naming the shutdown, and the servers stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import threading
import time
from typing import Any

import uvicorn
from absl import logging

from jaxserve import config
from jaxserve.config import DistributedConfig, ServerConfig
from jaxserve.server.async_engine import AsyncEngine, ShuttingDown
from jaxserve.server.frontend import Frontend
from jaxserve.server.model import ServedModel
from jaxserve.server.grpc_service import build_grpc_server, set_serving
from jaxserve.server.http_app import build_http_app
from jaxserve.server.http_protocol import header_deadline_protocol
from jaxserve.server.memory import release_free_memory


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the Server below owns SIGTERM/SIGINT and drains first."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


class Server:
    def __init__(
        self,
        llm: ServedModel,
        server: ServerConfig | None = None,
        *,
        heartbeat_timeout: float = DistributedConfig.heartbeat_timeout,
        **settings: Any,
    ):
        """llm: a jaxserve.LLM (a ServedModel), from then on driven by this server only. server: its
        ServerConfig; settings: any of its fields by name, over it (e.g. grpc_port=0: a free port).
        heartbeat_timeout: across processes, seconds without a follower's heartbeat before it counts as gone:
        the server fails over to an engine on this process's devices (LLM.fail_over), and every open request
        resumes there; health says degraded. If that cannot be built, its requests end UNAVAILABLE and the
        server stops."""
        cfg = config.replace(server or ServerConfig(), **settings)
        if llm.lockstep is not None:
            try:
                llm.prepare_fail_over()
            except Exception:  # noqa: BLE001 - a fail-over then compiles its programs itself
                logging.exception("the fail-over engine's programs cannot be prepared")
        self.host, self.drain_timeout = cfg.host, cfg.drain_timeout
        self._http_limits = {
            "max_body_bytes": cfg.max_request_bytes,
            "read_timeout": cfg.request_read_timeout,
            "allowed_origins": cfg.allowed_origins,
        }
        self.engine = AsyncEngine(
            llm.engine,
            max_queue=cfg.max_queue,
            stall_timeout=cfg.stall_timeout,
            lost=lambda: llm.lost(heartbeat_timeout),
            fallback=llm.fail_over if llm.lockstep is not None else None,
            loss_grace=heartbeat_timeout + 5.0,
        )
        self.frontend = Frontend(
            llm, self.engine, model_name=cfg.served_model_name or llm.model_name, api_key=cfg.api_key
        )
        self.engine.metrics.name_model(self.frontend.model_name)
        self._grpc_port, self._http_port = cfg.grpc_port, cfg.http_port
        self.grpc_port = self.http_port = None  # the bound ports, once started
        self._stop = asyncio.Event()

    async def start(self) -> None:
        self.engine.start()
        address = f"[{self.host}]:{self._grpc_port}" if ":" in self.host else f"{self.host}:{self._grpc_port}"
        self._grpc, self._health, self.grpc_port = build_grpc_server(self.frontend, address)
        await self._grpc.start()
        sock = _listening_socket(self.host, self._http_port)
        self.http_port = sock.getsockname()[1]
        slow_headers = self.engine.metrics.errors.labels("read_timeout").inc
        config = uvicorn.Config(
            build_http_app(self.frontend, **self._http_limits),
            log_level="warning",
            lifespan="off",
            http=header_deadline_protocol(self._http_limits["read_timeout"], slow_headers),
        )
        self._http = _Uvicorn(config)
        self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]))
        while not self._http.started:
            if self._http_task.done():  # failed to start: surface its error
                self._http_task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        await set_serving(self._health, self.engine.healthy)
        self._health_task = asyncio.create_task(self._follow_health())
        self._trim_task = asyncio.create_task(self._trim_when_idle())

    HEALTH_POLL_S = 0.25

    async def _follow_health(self) -> None:
        """gRPC health follows the engine (HTTP /health reads it directly), polled from the event loop, which
        a stuck engine thread cannot hold up; draining keeps NOT_SERVING."""
        reported = self.engine.healthy
        while True:
            engine = self.engine
            if engine.check_lost() and not engine.accepting and not engine.failed_over:  # no fallback, or none
                logging.error("%s: ending every request and stopping", engine.lost)  # could be built
                await set_serving(self._health, False)
                self.request_stop()
                return
            if not engine.accepting:  # draining
                return
            healthy = self.engine.healthy
            if healthy != reported:
                if not healthy:
                    logging.warning("the engine cannot step or is stalled: health is NOT_SERVING")
                await set_serving(self._health, healthy)
                reported = healthy
            await asyncio.sleep(self.HEALTH_POLL_S)

    TRIM_S = 5.0

    async def _trim_when_idle(self) -> None:
        """Every TRIM_S seconds with no request open, give the heap's free pages back (server/memory.py), so
        RSS returns to its level after a burst instead of keeping its peak."""
        while True:
            await asyncio.sleep(self.TRIM_S)
            if self.engine.num_open == 0:
                await asyncio.to_thread(release_free_memory)

    def request_stop(self) -> None:
        """Begin draining (safe to call from a signal handler on the loop)."""
        self._stop.set()

    async def wait_stopped(self) -> None:
        await self._stop.wait()
        await self.shutdown()

    END_S = 2.0  # the most of drain_timeout kept for ending what is left and stopping

    async def shutdown(self) -> None:
        """Drain and stop within drain_timeout in all. Requests get most of it; the last part (a quarter, at most
        END_S) ends what is left (half of it), stops both servers (cancelling any handler still stuck on its
        client) and, in the last eighth, the engine thread; so a supervisor's grace period of drain_timeout
        holds. Bodies still arriving when draining begins are refused at once (503)."""
        deadline = time.monotonic() + self.drain_timeout

        def left() -> float:
            return max(deadline - time.monotonic(), 0.0)

        end = min(self.END_S, self.drain_timeout / 4)
        self.engine.stop_accepting()
        self._health_task.cancel()
        self._trim_task.cancel()
        try:
            await set_serving(self._health, False)
            if not await self.engine.wait_idle(left() - end):
                self.engine.abort_all(
                    ShuttingDown(
                        f"the server shut down before this request finished (drain timeout {self.drain_timeout:g} s)"
                    )
                )
                await self.engine.wait_idle(left() - end / 2)  # let the handlers send that status
            # uvicorn notices should_exit within 0.1 s and waits 0.1 s more before its graceful wait
            self._http.config.timeout_graceful_shutdown = max(left() - end / 8 - 0.25, 0.0)
            self._http.should_exit = True
            await asyncio.gather(self._grpc.stop(grace=max(left() - end / 8, 0.0)), self._http_task)
        finally:
            await asyncio.to_thread(self.engine.stop, max(left(), end / 8))
            self.frontend.release()

    async def serve_until_signalled(self) -> None:
        """Start, print where it listens, serve until SIGTERM or SIGINT, then drain and stop."""
        await self.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        f = self.frontend
        print(
            f"jaxserve: serving {f.model_name} (context {f.max_model_len}); gRPC on {self.host}:{self.grpc_port}, "
            f"HTTP on http://{self.host}:{self.http_port}",
            flush=True,
        )
        await self.wait_stopped()
        print("jaxserve: stopped", file=sys.stderr, flush=True)


class BackgroundServer:
    """A Server on its own event loop in a background thread, for notebooks and tests:

    with BackgroundServer(llm, grpc_port=0, http_port=0) as s:
        openai.OpenAI(base_url=f"http://127.0.0.1:{s.server.http_port}/v1", api_key="-")
    """

    def __init__(self, llm: ServedModel, **server_args: Any):
        self.server = Server(llm, **server_args)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="jaxserve-server", daemon=True)

    def start(self) -> BackgroundServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result()
        return self

    def stop(self) -> None:
        """Drain and stop, as on SIGTERM."""
        asyncio.run_coroutine_threadsafe(self.server.shutdown(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def call(self, fn: Any, *args: Any) -> Any:
        """Run fn(*args) on the server's loop and return its result (for a look at state from another thread)."""

        async def run() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
