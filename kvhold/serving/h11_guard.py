"""`GuardedH11Protocol`: uvicorn's h11 protocol with a header deadline and a header size limit
(kvhold.serving.http_guards, which imports it only where uvicorn serves, so that the command's
flags import no HTTP stack, and sets both: `HttpGuards.uvicorn_options`). Imports nothing else
of kvhold.

h11 bounds only an *incomplete* header block (`h11_max_incomplete_event_size`): a complete
one that arrives in one read is parsed whatever its size. So before h11 parses a request, its
header block (request line and headers, up to the blank line) is measured in what has
arrived: longer than `max_header_bytes` is answered 400 and the connection closed, however
the bytes were split into reads (and for a pipelined request too)."""
from __future__ import annotations

import asyncio
import logging
import re

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)
_CLOSING = (b"HTTP/1.1 %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s")
_BLOCK_END = re.compile(rb"\n\r?\n")     # where h11 ends a header block


class GuardedH11Protocol(H11Protocol):
    header_timeout_s: float           # the subclass HttpGuards.uvicorn_options builds sets both
    max_header_bytes: int

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

    def handle_events(self) -> None:
        """Before h11 parses a request (from a read, or pipelined after a response), its header
        block's size."""
        if self.conn.their_state is h11.IDLE and self._header_block_too_large():
            log.info("answered 400 to %s: request header block over %d bytes",
                     "%s:%d" % self.client if self.client else "?", self.max_header_bytes)
            self._disarm()
            self._close_with(b"400 Bad Request", b"Request header block too large.")
            return
        super().handle_events()

    def _header_block_too_large(self) -> bool:
        buffered = self.conn.trailing_data[0]
        limit = self.max_header_bytes
        return len(buffered) > limit and _BLOCK_END.search(buffered, 0, limit) is None

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
        self._close_with(b"408 Request Timeout", b"Request headers not received in time.")

    def _close_with(self, status: bytes, body: bytes) -> None:
        self.transport.write(_CLOSING % (status, len(body), body))
        self.transport.close()
