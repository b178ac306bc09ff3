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
monitor task watches the socket's events), with the silence timer as the fallback. What
the messages mean is kvhold.client.core's, shared with the sync Client; this module does the
asyncio sockets and waits.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref
from typing import Awaitable, Callable

import zmq
import zmq.asyncio

from kvhold.client.client import open_sockets, send_or_fail, send_quietly, shut_sockets
from kvhold.client.core import (ClientCore, GenerationResult, Received, ReconnectWatch, StreamState, StreamView,
                                TokenEvent, TokenLogprob)
from kvhold.protocol import messages as m
from kvhold.protocol.errors import NotFound, ProtocolError, SidecarUnavailable
from kvhold.protocol.naming import InstancePaths
from kvhold.protocol.sampling import RequestInput

log = logging.getLogger(__name__)
__all__ = ["AsyncClient", "AsyncStream", "TokenEvent", "TokenLogprob", "GenerationResult"]


def _changed(st: StreamState) -> asyncio.Event:
    """The event set when stream `st` has news (see AsyncClient._woke)."""
    if st.waiter is None:
        st.waiter = asyncio.Event()
    return st.waiter


class AsyncStream(StreamView):
    """Async iterator over one request's tokens; `await result()` waits for the end."""

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        st = self._state
        while not st.pending:
            if st.error is not None:
                raise st.error
            if st.done is not None:
                raise StopAsyncIteration
            await self._client._wait_news(st)
        return st.pending.popleft()

    async def result(self) -> GenerationResult:
        async for _ in self:
            pass
        return self._state.result()

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
        self.endpoint = endpoint
        self.timeout = timeout
        self._own_ctx = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._sock, self._monitor = open_sockets(self._ctx, endpoint, identity, curve_server_key,
                                                 curve_secret_key_file, self._own_ctx)
        # never closed and collected in a cycle: closed in order (kvhold.client.client.shut_sockets)
        self._shut = weakref.finalize(self, shut_sockets, self._sock, self._monitor, self._ctx, self._own_ctx)
        self._resume_on_reconnect = resume_on_reconnect
        self._reconnect = ReconnectWatch()
        self._core = ClientCore(endpoint, timeout, time.monotonic())
        self._answers: dict[int, asyncio.Future] = {}    # tag -> set once its reply is in the core
        self._receiver: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
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
        return await self.submit(RequestInput.check(prompt, prompt_ids, prefix_generated, params))

    async def submit(self, request: RequestInput, *,
                     on_silence: Callable[[], Awaitable[None]] | None = None) -> AsyncStream:
        """Send one Generate for a checked request (kvhold.protocol.sampling.RequestInput) and
        return its stream once the sidecar accepted it. `on_silence` is awaited each time the
        sidecar has stayed silent for `timeout` meanwhile: it raises to give up, or returns to
        wait again for the same Generate; without it, SidecarUnavailable."""
        self._ensure_receiver()
        return AsyncStream(self, await self._ask(*self._core.generate(request), on_silence))

    async def attach(self, request_id: int) -> AsyncStream:
        """Take up the stream of a request this client's key owns but this client has no stream
        for: one a previous process with the same routing id (and the same principal: uid or
        CurveZMQ key) started. The sidecar sends every token again from the first, then the rest
        as they are committed, and the end; a request that ended while no owner was connected
        is served from its kept result. `NotFound` if the sidecar has no such request of this
        key's (unknown, another's, cancelled, or ended and delivered)."""
        asked = time.monotonic()
        st, resume = self._core.attach(request_id, asked)
        try:
            self._ensure_receiver()
            send_or_fail(self._sock, resume, self.endpoint)
            # answered by its tokens, its end, an error, or a keepalive naming it (nothing sent yet)
            while not self._core.attach_answered(st, asked):
                await self._wait_news(st)
        finally:
            if not self._core.attach_answered(st, asked):
                self._core.drop(st)
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

    async def pool_restart(self, hold: bool = False, client_grace_s: float = 300.0) -> m.PoolRestartReply:
        """Ask the sidecar to restart its pool (see kvhold.cli.pool_restart); returns once it drains."""
        return await self._request(lambda tag: m.PoolRestart(tag=tag, hold=hold, client_grace_s=client_grace_s))

    async def admissions(self, reopen: bool = False) -> m.AdmissionsReply:
        """Whether the sidecar admits new requests, and who closed them; `reopen` lifts a
        health action's closure first (local socket only; see `kvhold admissions`)."""
        return await self._request(lambda tag: m.Admissions(tag=tag, reopen=reopen))

    async def reset_prefix_cache(self) -> None:
        """Free every idle page of the sidecar's prefix cache (vLLM's reset_prefix_cache);
        returns once the active executor has. Pages that running requests use stay theirs.
        InvalidParams where the sidecar has no prefix cache."""
        await self._request(lambda tag: m.ResetPrefixCache(tag=tag))

    @property
    def last_heard(self) -> float:
        """When (time.monotonic()) the last message from the sidecar came."""
        return self._core.last_rx

    def disconnects(self) -> int:
        """How many times the connection to the sidecar has dropped (the socket monitor's
        events, as the monitor task has read them)."""
        return self._reconnect.drops

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
        return await self._ask(*self._core.request(make))

    async def _ask(self, tag: int, msg, on_silence=None):
        """Send request `msg` and wait for its reply (see `submit` for `on_silence`)."""
        answer = self._answers[tag] = asyncio.get_running_loop().create_future()
        try:
            self._core.sending(tag)
            send_or_fail(self._sock, msg, self.endpoint)
            while True:
                try:
                    await self._wait(asyncio.shield(answer))
                except SidecarUnavailable:
                    if on_silence is None:
                        raise
                    await on_silence()
                    continue
                return self._core.reply(tag)      # the reply, or the error it was
        finally:
            self._answers.pop(tag, None)
            self._core.forget(tag)

    async def _wait_news(self, st: StreamState) -> None:
        """Wait until stream `st` has news (or SidecarUnavailable, as `_wait`)."""
        changed = _changed(st)
        changed.clear()
        await self._wait(changed.wait())

    async def _wait(self, awaitable):
        """Await `awaitable` while the sidecar stays alive: any frame from it resets the clock."""
        task = asyncio.ensure_future(awaitable)
        started = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                wait_s = self._core.wait_s(started, now)
                send_quietly(self._sock, self._core.resume_due(now))
                done, _ = await asyncio.wait({task}, timeout=wait_s)
                if done:
                    return task.result()
        finally:
            if not task.done():
                task.cancel()

    def _ensure_receiver(self) -> None:
        if self._closed:
            raise SidecarUnavailable("the client is closed")
        if self._receiver is None or self._receiver.done():
            self._receiver = asyncio.get_running_loop().create_task(self._receive_loop())
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch_reconnects())

    async def _watch_reconnects(self) -> None:
        """Re-attach every open stream as soon as the socket has connected again."""
        while True:
            frames = await self._monitor.recv_multipart()
            resume, got = self._core.link_event(self._reconnect, frames, time.monotonic())
            if self._resume_on_reconnect:
                send_quietly(self._sock, resume)
            self._woke(got)

    async def _receive_loop(self) -> None:
        while True:
            frame = await self._sock.recv()
            try:
                got = self._core.receive(frame, time.monotonic())
            except ProtocolError as exc:
                got = self._core.fail_all(exc)
            self._woke(got)

    def _woke(self, got: Received) -> None:
        """Wake whoever waits on what a message changed."""
        for tag in got.replies:
            answer = self._answers.get(tag)
            if answer is not None and not answer.done():
                answer.set_result(None)
        for st in got.streams:
            if st.waiter is not None:
                st.waiter.set()
