"""Slow clients: deadlines for a request's headers and body in the HTTP server.

uvicorn bounds an idle kept-alive connection (`timeout_keep_alive`) and the size of
an incomplete header block (h11's limit: a larger one is answered 400), but not the
size of a complete one (`GuardedH11Protocol` answers a header block over MAX_HEADER_BYTES
with 400, however it arrives), nor the time a client takes to send its headers or its body. A client that connects and
sends nothing, or dribbles a byte every few seconds, holds a connection (and, in
the body, a request task) for as long as it likes; enough of them exhaust the
server's descriptors. Two guards close that, both on by default:

* `GuardedH11Protocol`, uvicorn's h11 protocol with a header deadline: from the
  connection's start, and on a kept-alive connection from the first byte of the next
  request, the request line and headers must be complete within `header_timeout_s`;
  otherwise the server answers 408 and closes the connection.
* `BodyDeadline`, ASGI middleware: the body must be complete within `body_timeout_s`
  of the request's start; otherwise the request is answered 408 (OpenAI-style error,
  code `request_timeout`) and the connection closed. Once the body is in, nothing is
  timed: a long streamed response is not a slow client.

`kvhold serve` and `kvhold router` take both as flags (`--http-header-timeout`,
`--http-body-timeout`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
MAX_HEADER_BYTES = 16 * 1024      # request line + headers; a larger block is answered 400


@dataclass(frozen=True, slots=True)
class HttpGuards:
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S

    def __post_init__(self):
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"--http-{name[:-10]}-timeout must be > 0 seconds (got {value})")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "HttpGuards":
        return cls(header_timeout_s=args.http_header_timeout, body_timeout_s=args.http_body_timeout)

    def uvicorn_options(self) -> dict:
        """The uvicorn.Config arguments that apply the header guards."""
        from kvhold.serving.h11_guard import GuardedH11Protocol   # uvicorn: only where it serves

        protocol = type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": self.header_timeout_s,
                                                                     "max_header_bytes": MAX_HEADER_BYTES})
        return {"http": protocol, "h11_max_incomplete_event_size": MAX_HEADER_BYTES}


def add_guard_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http-header-timeout", type=float, default=HEADER_TIMEOUT_S,
                   help="seconds a client has to send a request's line and headers, from its "
                        "connection (or its next request's first byte); then 408 and the "
                        "connection is closed (default %(default)s)")
    p.add_argument("--http-body-timeout", type=float, default=BODY_TIMEOUT_S,
                   help="seconds a client has to send a request's whole body, from the request's "
                        "start; then 408 and the connection is closed (default %(default)s)")


class _BodyTimeout(Exception):
    pass


class BodyDeadline:
    """ASGI middleware: a request's body must be complete within `timeout_s` of its start."""

    def __init__(self, app, timeout_s: float):
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body_done = started = False

        async def timed_receive():
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise _BodyTimeout() from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, timed_receive, tracking_send)
        except _BodyTimeout:
            if started:
                raise
            client = scope.get("client")
            log.info("answered 408 to %s: request body not received within %.1f s",
                     "%s:%d" % tuple(client) if client else "?", self.timeout_s)
            from kvhold.serving.openai_schema import ApiError   # pydantic: kept out of every CLI's start

            err = ApiError(408, f"The request body was not received within {self.timeout_s:g} s.",
                           code="request_timeout")
            body = json.dumps(err.body()).encode()
            await send({"type": "http.response.start", "status": 408,
                        "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
