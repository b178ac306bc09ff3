"""Async client SDK: the same protocol and semantics as kvhold.client.client, for asyncio programs.

    from kvhold.client.aclient import AsyncClient
    async with AsyncClient.for_instance("default") as client:
        stream = await client.generate("Once upon a time", max_tokens=32, seed=1)
        async for event in stream:        # TokenEvent(index, token_id, text)
            print(event.text, end="")
        result = await stream.result()    # GenerationResult

One AsyncClient is one DEALER socket on one event loop; any number of coroutines may
use it at once. A single receiver task reads every frame and routes it: replies by
the request's `tag`, tokens and the end of a stream by `request_id`. Streams cross
executor crashes with no duplicate and no gap (indices are checked), exactly as in
the sync SDK. Liveness follows the Paranoid Pirate rule: any frame from the sidecar,
keepalives included, proves it alive; a caller that waits while the sidecar has been
silent for `timeout` seconds gets `SidecarUnavailable`, never a hang. Pool restarts work
as in the sync SDK: the announced pause is waited through, then `Resume` re-attaches; a
restarted sidecar's streams are re-attached as soon as the socket has connected to it (a
monitor task watches the socket's events), with the silence timer as the fallback.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import time
import weakref
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from kvhold.protocol import messages as m, wire
from kvhold.client.client import (RECONNECT_EVENTS, RESUME_AFTER_S, GenerationResult, ReconnectWatch, TokenEvent,
                                  TokenLogprob, hear_keepalive, result_of, resume_all, resume_message, shut_sockets,
                                  dealer_socket, take_tokens)
from kvhold.protocol.curve import apply_client_curve
from kvhold.protocol.errors import NotFound, ProtocolError, SidecarUnavailable, error_from_code
from kvhold.protocol.naming import InstancePaths
from kvhold.protocol.sampling import RequestInput

log = logging.getLogger(__name__)
__all__ = ["AsyncClient", "AsyncStream", "TokenEvent", "TokenLogprob", "GenerationResult"]


@dataclass(slots=True)
class _StreamState:
    request_id: int
    prompt_tokens: int
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)         # TokenLogprob per token, when asked for
    prompt_logprobs: list | None = None                  # TokenLogprob per prompt token, when asked for
    pending: collections.deque = field(default_factory=collections.deque)
    done: m.Done | None = None
    error: Exception | None = None
    heard: float = field(default_factory=time.monotonic)   # last tokens or keepalive for it
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        return self.done is not None or self.error is not None


class AsyncStream:
    """Async iterator over one request's tokens; `await result()` waits for the end."""

    def __init__(self, client: "AsyncClient", state: _StreamState):
        self._client = client
        self._state = state

    @property
    def request_id(self) -> int:
        return self._state.request_id

    @property
    def prompt_tokens(self) -> int:
        return self._state.prompt_tokens

    @property
    def finished(self) -> bool:
        return self._state.finished

    @property
    def prompt_logprobs(self):
        """The prompt's TokenLogprob list (asked for with prompt_logprobs=k), once the first
        tokens have arrived; None before, or when not asked for."""
        return self._state.prompt_logprobs

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        st = self._state
        while not st.pending:
            if st.error is not None:
                raise st.error
            if st.done is not None:
                raise StopAsyncIteration
            st.changed.clear()
            await self._client._wait(st.changed.wait())
        return st.pending.popleft()

    async def result(self) -> GenerationResult:
        async for _ in self:
            pass
        return result_of(self._state, self._state.done)

    async def cancel(self) -> None:
        """Stop the request; the stream then ends with finish_reason 'cancelled'."""
        if not self.finished:
            try:
                await self._client.cancel(self.request_id)
            except NotFound:
                pass  # it finished meanwhile


class AsyncClient:
    def __init__(self, endpoint: str, timeout: float = 10.0, identity: bytes | None = None,
                 context: zmq.asyncio.Context | None = None, curve_server_key=None,
                 curve_secret_key_file: os.PathLike | None = None, resume_on_reconnect: bool = True):
        """`endpoint`, the CURVE arguments and `resume_on_reconnect` as for
        kvhold.client.client.Client: over tcp://, give the server's public key and this client's
        .key_secret file to speak CurveZMQ."""
        if (curve_server_key is None) != (curve_secret_key_file is None):
            raise ValueError("CURVE needs both curve_server_key and curve_secret_key_file")
        self.endpoint = endpoint
        self.timeout = timeout
        self._own_ctx = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._sock = dealer_socket(self._ctx, identity)
        if curve_server_key is not None:
            try:
                apply_client_curve(self._sock, curve_server_key, curve_secret_key_file)
            except BaseException:
                self._sock.close(0)
                if self._own_ctx:
                    self._ctx.term()
                raise
        self._monitor = self._sock.get_monitor_socket(RECONNECT_EVENTS) if resume_on_reconnect else None
        self._reconnect = ReconnectWatch()
        # never closed and collected in a cycle: closed in order (kvhold.client.client.shut_sockets)
        self._shut = weakref.finalize(self, shut_sockets, self._sock, self._monitor, self._ctx, self._own_ctx)
        self._sock.connect(endpoint)
        self._tags = itertools.count(1)
        self._replies: dict[int, asyncio.Future] = {}
        self._streams: dict[int, _StreamState] = {}
        self._receiver: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._last_rx = self._last_resume = time.monotonic()
        self._pause_until = 0.0    # a pool restart announced a pause until then (monotonic)
        self._closed = False

    @classmethod
    def for_instance(cls, instance: str = "default", runtime_root=None, **kwargs) -> "AsyncClient":
        paths = InstancePaths.for_instance(instance, runtime_root)
        return cls(paths.client_endpoint, **kwargs)

    # ------------------------------------------------------------------ API
    async def generate(self, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
                       prefix_generated: list[int] | None = None, **params) -> AsyncStream:
        """`prefix_generated` continues a request moved from another sidecar (see kvhold.routing.arouter):
        the stream then yields only the tokens after it, indexed from 0."""
        # every field's type and range, before anything is sent (the sidecar checks again)
        req = RequestInput.check(prompt, prompt_ids, prefix_generated, params)
        _, state = await self._request(lambda tag: m.Generate(
            tag=tag, params=req.sampling, prompt=req.prompt, prompt_ids=req.prompt_ids,
            prefix_generated=req.prefix or None))
        return AsyncStream(self, state)

    async def attach(self, request_id: int) -> AsyncStream:
        """Take up the stream of a request this client's key owns but this client has no stream
        for: one a previous process with the same routing id (and the same principal: uid or
        CurveZMQ key) started. The sidecar sends every token again from the first, then the rest
        as they are committed, and the end; a request that ended while no owner was connected
        is served from its kept result. `NotFound` if the sidecar has no such request of this
        key's (unknown, another's, cancelled, or ended and delivered)."""
        if request_id in self._streams:
            raise ValueError(f"request {request_id:#x} already has a stream on this client")
        self._ensure_receiver()
        st = _StreamState(request_id, 0)
        self._streams[request_id] = st
        asked = time.monotonic()
        try:
            self._sock.send(wire.encode(m.Resume(request_ids=[request_id], next_indices=[0])), zmq.NOBLOCK)
            # answered by its tokens, its end, an error, or a keepalive naming it (nothing sent yet)
            while not (st.pending or st.finished or st.heard > asked):
                st.changed.clear()
                await self._wait(st.changed.wait())
        except zmq.Again:
            raise SidecarUnavailable(f"cannot queue a message to {self.endpoint}") from None
        finally:
            if not (st.pending or st.finished or st.heard > asked) and self._streams.get(request_id) is st:
                del self._streams[request_id]
        if st.error is not None and not st.pending:
            raise st.error
        return AsyncStream(self, st)

    async def cancel(self, request_id: int) -> None:
        await self._request(lambda tag: m.Cancel(tag=tag, request_id=request_id))

    async def status(self) -> dict:
        return (await self._request(lambda tag: m.Status(tag=tag))).status

    async def ping(self) -> int:
        """Round trip; returns the pool generation."""
        return (await self._request(lambda tag: m.Ping(tag=tag))).generation

    async def close(self) -> None:
        self._closed = True
        for task in (self._receiver, self._watcher):
            if task is not None:
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        self._shut()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    # ------------------------------------------------------------------ plumbing
    async def _request(self, make):
        self._ensure_receiver()
        tag = next(self._tags)
        fut = asyncio.get_running_loop().create_future()
        self._replies[tag] = fut
        try:
            self._sock.send(wire.encode(make(tag)), zmq.NOBLOCK)
        except zmq.Again:
            self._replies.pop(tag, None)
            raise SidecarUnavailable(f"cannot queue a message to {self.endpoint}") from None
        try:
            return await self._wait(asyncio.shield(fut))
        finally:
            self._replies.pop(tag, None)

    async def _wait(self, awaitable):
        """Await `awaitable` while the sidecar stays alive: any frame from it resets the clock."""
        task = asyncio.ensure_future(awaitable)
        started = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                remaining = max(max(self._last_rx, started) + self.timeout, self._pause_until) - now
                if remaining <= 0:
                    raise SidecarUnavailable(f"no message from the sidecar at {self.endpoint} "
                                             f"for {self.timeout:.1f} s")
                done, _ = await asyncio.wait({task}, timeout=min(remaining, RESUME_AFTER_S))
                if done:
                    return task.result()
                self._maybe_resume()
        finally:
            if not task.done():
                task.cancel()

    def _ensure_receiver(self) -> None:
        if self._closed:
            raise SidecarUnavailable("the client is closed")
        if self._receiver is None or self._receiver.done():
            self._receiver = asyncio.get_running_loop().create_task(self._receive_loop())
        if self._monitor is not None and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.get_running_loop().create_task(self._watch_reconnects())

    async def _watch_reconnects(self) -> None:
        """Re-attach every open stream as soon as the socket has connected again."""
        while True:
            frames = await self._monitor.recv_multipart()
            if self._reconnect.seen(frames):
                self._last_resume = time.monotonic()
                self._queue(resume_all(self._streams))

    async def _receive_loop(self) -> None:
        while True:
            frame = await self._sock.recv()
            self._last_rx = time.monotonic()
            try:
                msg = wire.decode(frame)
            except wire.WireError as exc:
                self._fail_all(ProtocolError(f"undecodable message from the sidecar: {exc}"))
                continue
            handler = self._HANDLERS.get(type(msg))
            if handler is not None:
                handler(self, msg)

    def _maybe_resume(self) -> None:
        """After a silence, re-attach open streams (a restarted sidecar re-sends from there)."""
        now = time.monotonic()
        if now - self._last_resume < RESUME_AFTER_S:
            return
        self._last_resume = now
        self._queue(resume_message(self._streams, now))

    def _queue(self, msg) -> None:
        if msg is None:
            return
        try:
            self._sock.send(wire.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass  # queue full while the sidecar is away: the next silence retries

    def _on_restarting(self, msg: m.Restarting) -> None:
        self._pause_until = max(self._pause_until, time.monotonic() + msg.resume_within_s)

    def _on_keepalive(self, msg: m.Keepalive) -> None:
        hear_keepalive(self._streams, msg)
        for rid in msg.request_ids:           # wakes an `attach` waiting for the sidecar's word
            st = self._streams.get(rid)
            if st is not None:
                st.changed.set()
        self._pause_until = 0.0    # a sidecar serves our streams (again): normal timeout

    def _fail_all(self, exc: Exception) -> None:
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(exc)
        for st in self._streams.values():
            st.error = exc
            st.changed.set()
        self._streams.clear()

    def _on_accepted(self, msg: m.Accepted) -> None:
        # Registered here, not in generate(): tokens, and the Done of a short request, may
        # follow before generate() resumes. generate() gets the state with the reply, since
        # a Done handled by then has already taken it out of _streams.
        state = _StreamState(msg.request_id, msg.prompt_tokens)
        self._streams[msg.request_id] = state
        fut = self._replies.get(msg.tag)
        if fut is not None and not fut.done():
            fut.set_result((msg, state))

    def _on_tokens(self, msg: m.Tokens) -> None:
        st = self._streams.get(msg.request_id)
        if st is None:
            return
        if not take_tokens(st, msg):
            self._streams.pop(msg.request_id)
        st.changed.set()

    def _on_done(self, msg: m.Done) -> None:
        st = self._streams.pop(msg.request_id, None)
        if st is not None:
            st.done = msg
            st.changed.set()

    def _on_error(self, msg: m.Error) -> None:
        exc = error_from_code(msg.code, msg.message)
        fut = self._replies.get(msg.tag) if msg.tag else None
        if fut is not None and not fut.done():
            fut.set_exception(exc)
        elif msg.request_id in self._streams:
            st = self._streams.pop(msg.request_id)
            st.error = exc
            st.changed.set()

    def _on_reply(self, msg) -> None:
        fut = self._replies.get(msg.tag)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    _HANDLERS = {m.Tokens: _on_tokens, m.Done: _on_done, m.Error: _on_error, m.Accepted: _on_accepted,
                 m.Cancelled: _on_reply, m.StatusReply: _on_reply, m.Pong: _on_reply,
                 m.Keepalive: _on_keepalive, m.Restarting: _on_restarting}
