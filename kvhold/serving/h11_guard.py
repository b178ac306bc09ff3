"""`GuardedH11Protocol`: uvicorn's h11 protocol with a header deadline (kvhold.serving.http_guards,
which imports it only where uvicorn serves, so that the command's flags import no HTTP stack, and
sets its deadline: `HttpGuards.uvicorn_options`). Imports nothing else of kvhold."""
from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)
_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s")


class GuardedH11Protocol(H11Protocol):
    header_timeout_s: float           # the subclass HttpGuards.uvicorn_options builds sets it

    def connection_made(self, transport) -> None:
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm()               # a kept-alive connection's next request starts its clock
        super().data_received(data)
        self._headers_done()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._arm()               # part of a pipelined request is already here
        self._headers_done()

    def _headers_done(self) -> None:
        if self.conn.their_state is not h11.IDLE:
            self._disarm()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        log.info("closed a connection from %s: no complete request headers within %.1f s",
                 "%s:%d" % self.client if self.client else "?", self.header_timeout_s)
        body = b"Request headers not received in time."
        self.transport.write(_TIMEOUT_408 % (len(body), body))
        self.transport.close()
