"""uvicorn's h11 connection with a deadline on request headers, which uvicorn does not have: a client that
connects (or, on a kept-alive connection, starts its next request) and then sends its headers slowly or not at
all is disconnected after `timeout` seconds instead of holding the connection open for ever (slowloris). The
body's own pace is the _ReadBody middleware's (http_app.py)."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def header_deadline_protocol(timeout: float, on_timeout: Callable[[], None]) -> type[H11Protocol]:
    """An H11Protocol class (uvicorn.Config(http=...)) that closes a connection whose request headers are not
    complete `timeout` seconds after it opened or after its request's first byte; `on_timeout` is called for
    each (e.g. to count it)."""

    class HeaderDeadlineProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._deadline = self.loop.call_later(timeout, self._headers_too_slow)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # still reading a request line and headers
                if self._deadline is None:  # a kept-alive connection's next request has begun
                    self._deadline = self.loop.call_later(timeout, self._headers_too_slow)
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _headers_too_slow(self) -> None:
            self._deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                on_timeout()
                self.transport.close()  # no response: h11 can answer only a request it has read

    return HeaderDeadlineProtocol
