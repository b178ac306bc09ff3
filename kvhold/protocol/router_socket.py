"""ZeroMQ ROUTER sockets as the sidecar and the frontend serve them: bind one owner-only, drain
its messages in bounded slices of a loop turn, decode a frame against the messages a socket
accepts (a bad frame gets an `Error` reply and never reaches a handler), reply without blocking.
"""
from __future__ import annotations

import contextlib
import logging
import os

import zmq

from kvhold.protocol import messages as m, wire
from kvhold.protocol.leases import now_ns

log = logging.getLogger(__name__)
DRAIN_SLICE_NS = 1_000_000    # a socket's messages handled per loop turn: at most about this long
_MORE, _NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK), int(zmq.NOBLOCK)   # plain ints: no enum arithmetic per send


def bind_router(zctx: zmq.Context, endpoint: str, path, stack: contextlib.ExitStack) -> zmq.Socket:
    sock = zctx.socket(zmq.ROUTER)
    stack.callback(unlink, path)     # after the close: the socket file goes last
    stack.callback(sock.close, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.bind(endpoint)
    os.chmod(path, 0o600)
    return sock


def unlink(path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def drain(sock: zmq.Socket, handler, budget: int = 256, copy: bool = True) -> None:
    """Handle up to `budget` (identity, body) messages, for at most about DRAIN_SLICE_NS."""
    deadline = now_ns() + DRAIN_SLICE_NS     # the rest waits a turn: death signals go first
    for _ in range(budget):
        if now_ns() > deadline:
            return
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            return
        if len(frames) != 2:
            log.warning("dropped a %d-frame message (expected identity + body)", len(frames))
            continue
        handler(frames[0] if copy else frames[0].bytes, frames[1])


def reply(sock: zmq.Socket, identity: bytes, msg) -> None:
    try:   # send_multipart's two sends, without its per-call checks
        data = wire.encode(msg)
        sock.send(identity, _MORE)
        sock.send(data, _NOBLOCK)
    except zmq.ZMQError as exc:
        log.warning("dropped %s reply: %s", msg.TYPE, exc)


def decode(sock: zmq.Socket, identity: bytes, frame: bytes, allowed, what: str,
           max_array_len: int | None = None):
    """The message, or None after an error reply: a bad frame never reaches a handler."""
    try:
        return wire.decode(frame, allowed, max_array_len=max_array_len)
    except wire.WireError as exc:
        log.warning("bad %s message: %s (%s)", what, exc, exc.code.name)
        reply(sock, identity, m.Error(code=exc.code, message=str(exc), tag=wire.peek_tag(frame)))
        return None
