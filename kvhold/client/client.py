"""Client SDK: generate, stream, cancel, status over ZeroMQ.

    from kvhold.client.client import Client
    with Client.for_instance("default") as client:
        stream = client.generate("Once upon a time", max_tokens=32, temperature=0.8, seed=1)
        for event in stream:             # TokenEvent(index, token_id, text)
            print(event.text, end="")
        result = stream.result()         # finish_reason, usage, full text

A stream survives executor crashes with no action by the caller: the sidecar
keeps it open, sends keepalives during the pause and continues from the next
token, with no duplicate and no gap (the SDK checks the indices). A pool restart
(`kvhold pool-restart`) is a longer pause: the sidecar announces it (`Restarting`), the
SDK waits that long, then re-attaches its streams to the new sidecar (`Resume`) and
continues from the index it has. The Resume goes as soon as the socket has connected again
after a disconnect (a ZeroMQ socket monitor: the handshake with the new sidecar succeeded),
so a restarted sidecar's streams continue without waiting for a silence; after each second
of silence it is sent as well, the fallback for a restart the socket did not see. Errors are
typed (kvhold.protocol.errors): bad parameters raise `InvalidParams` and its subclasses
before or after a round trip; a sidecar that stays silent for `timeout` seconds
raises `SidecarUnavailable`, never a hang. One Client is one socket: use it from
one thread (several streams may be interleaved); see AsyncClient for asyncio. What the
messages mean (streams, replies, resumes) is kvhold.client.core's, shared with AsyncClient;
this module does the sockets and the blocking waits.
"""
from __future__ import annotations

import os
import time
import weakref
from typing import Callable

import zmq

from kvhold.client.core import (RESUME_AFTER_S, ClientCore, GenerationResult, ReconnectWatch, StreamView,
                                TokenEvent, TokenLogprob)
from kvhold.protocol import messages as m, wire
from kvhold.protocol.curve import apply_client_curve
from kvhold.protocol.errors import NotFound, SidecarUnavailable
from kvhold.protocol.naming import InstancePaths
from kvhold.protocol.sampling import RequestInput

__all__ = ["Client", "Stream", "TokenEvent", "TokenLogprob", "GenerationResult", "wait_all", "RESUME_AFTER_S",
           "ReconnectWatch"]
# the monitor's events: a new connection is usable once its handshake succeeded
RECONNECT_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
# a dropped connection is tried again after 10 ms, doubling to 40 ms: a restarted sidecar (a
# spare re-adopts the pool some 30-200 ms after the crash) is reached within 40 ms of binding,
# not ZeroMQ's 100 ms (or, with a longer backoff, the next doubling's) later
RECONNECT_IVL_MS, RECONNECT_IVL_MAX_MS = 10, 40


def dealer_socket(ctx: zmq.Context, identity: bytes | None):
    """The SDK's socket to a sidecar: no linger, a stable identity, prompt reconnects."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # A stable identity keeps ownership of our requests across reconnects.
    sock.setsockopt(zmq.ROUTING_ID, identity or os.urandom(16))
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    return sock


def open_sockets(ctx, endpoint: str, identity: bytes | None, curve_server_key, curve_secret_key_file,
                 own_ctx: bool):
    """(the DEALER socket, its monitor) of a client, connected to `endpoint`; over CURVE when
    given its keys. On an error the socket is closed, and the context ended if the client made it."""
    sock = None
    try:
        if (curve_server_key is None) != (curve_secret_key_file is None):
            raise ValueError("CURVE needs both curve_server_key and curve_secret_key_file")
        sock = dealer_socket(ctx, identity)
        if curve_server_key is not None:
            apply_client_curve(sock, curve_server_key, curve_secret_key_file)
        monitor = sock.get_monitor_socket(RECONNECT_EVENTS)
    except BaseException:
        if sock is not None:
            sock.close(0)
        if own_ctx:
            ctx.term()
        raise
    sock.connect(endpoint)
    return sock, monitor


def send_or_fail(sock, msg, endpoint: str) -> None:
    """Send `msg`; SidecarUnavailable when the socket's queue is full (the sidecar is away)."""
    try:
        sock.send(wire.encode(msg), zmq.NOBLOCK)
    except zmq.Again:
        raise SidecarUnavailable(f"cannot queue a message to {endpoint}") from None


def send_quietly(sock, msg) -> None:
    """Send `msg` (a Resume) if there is one, and if the socket's queue has room."""
    if msg is None:
        return
    try:
        sock.send(wire.encode(msg), zmq.NOBLOCK)
    except zmq.Again:
        pass  # queue full while the sidecar is away: the next silence retries


def shut_sockets(sock, monitor, ctx, own_ctx: bool) -> None:
    """Close a client's sockets, its monitor first, then end its context if it made it. Run by
    `close`, or by the client's finalizer when a client that was never closed is collected:
    collected in a reference cycle, its context's own finalizer could otherwise run first and
    wait for ever on the sockets still open."""
    if monitor is not None:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        monitor.close(0)
    sock.close(0)
    if own_ctx:
        ctx.term()


class Stream(StreamView):
    """Iterator over one request's tokens; `result()` waits for the end."""

    def __iter__(self):
        return self

    def __next__(self) -> TokenEvent:
        st = self._state
        while not st.pending:
            if st.error is not None:
                raise st.error
            if st.done is not None:
                raise StopIteration
            self._client._receive_one()
        return st.pending.popleft()

    def result(self) -> GenerationResult:
        for _ in self:
            pass
        return self._state.result()

    def cancel(self) -> None:
        """Stop the request; the stream then ends with finish_reason 'cancelled'."""
        if not self.finished:
            try:
                self._client.cancel(self.request_id)
            except NotFound:
                pass  # it finished meanwhile


class Client:
    """`endpoint` is ipc://PATH (local, owner-only) or tcp://HOST:PORT. Over TCP give the
    server's public key (z85 or its .key file) and this client's .key_secret file to speak
    CurveZMQ; a CURVE sidecar serves nobody else (see kvhold.protocol.curve, `kvhold keygen`)."""

    def __init__(self, endpoint: str, timeout: float = 10.0, identity: bytes | None = None,
                 context: zmq.Context | None = None, curve_server_key=None,
                 curve_secret_key_file: os.PathLike | None = None, resume_on_reconnect: bool = True):
        """`resume_on_reconnect`: re-attach open streams as soon as the socket has connected again
        (a socket monitor); False leaves only the silence timer (a router, which moves streams
        elsewhere when a connection drops: it asks `disconnects()`)."""
        self.endpoint = endpoint
        self.timeout = timeout
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._sock, self._monitor = open_sockets(self._ctx, endpoint, identity, curve_server_key,
                                                 curve_secret_key_file, self._own_ctx)
        # never closed and collected in a cycle: closed in order (shut_sockets)
        self._shut = weakref.finalize(self, shut_sockets, self._sock, self._monitor, self._ctx, self._own_ctx)
        self._resume_on_reconnect = resume_on_reconnect
        self._reconnect = ReconnectWatch()
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._core = ClientCore(endpoint, timeout, time.monotonic())

    @classmethod
    def for_instance(cls, instance: str = "default", runtime_root=None, **kwargs) -> "Client":
        paths = InstancePaths.for_instance(instance, runtime_root)
        return cls(paths.client_endpoint, **kwargs)

    # ------------------------------------------------------------------ API
    def generate(self, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
                 prefix_generated: list[int] | None = None, **params) -> Stream:
        """`prefix_generated` continues a request moved from another sidecar (see kvhold.routing.router):
        the stream then yields only the tokens after it, indexed from 0."""
        # every field's type and range, before anything is sent (the sidecar checks again)
        return self.submit(RequestInput.check(prompt, prompt_ids, prefix_generated, params))

    def submit(self, request: RequestInput, *, on_silence: Callable[[], None] | None = None) -> Stream:
        """Send one Generate for a checked request (kvhold.protocol.sampling.RequestInput) and
        return its stream once the sidecar accepted it. `on_silence` is called each time the
        sidecar has stayed silent for `timeout` meanwhile: it raises to give up, or returns to
        wait again for the same Generate; without it, SidecarUnavailable."""
        tag, msg = self._core.generate(request)
        return Stream(self, self._ask(tag, msg, on_silence))

    def cancel(self, request_id: int) -> None:
        self._ask(*self._core.request(lambda tag: m.Cancel(tag=tag, request_id=request_id)))

    def status(self) -> dict:
        return self._ask(*self._core.request(lambda tag: m.Status(tag=tag))).status

    def ping(self) -> int:
        """Round trip; returns the pool generation."""
        return self._ask(*self._core.request(lambda tag: m.Ping(tag=tag))).generation

    def pool_restart(self, hold: bool = False, client_grace_s: float = 300.0) -> m.PoolRestartReply:
        """Ask the sidecar to restart its pool (see kvhold.cli.pool_restart); returns once it drains."""
        return self._ask(*self._core.request(lambda tag: m.PoolRestart(tag=tag, hold=hold,
                                                                       client_grace_s=client_grace_s)))

    def admissions(self, reopen: bool = False) -> m.AdmissionsReply:
        """Whether the sidecar admits new requests, and who closed them; `reopen` lifts a
        health action's closure first (local socket only; see `kvhold admissions`)."""
        return self._ask(*self._core.request(lambda tag: m.Admissions(tag=tag, reopen=reopen)))

    def reset_prefix_cache(self) -> None:
        """Free every idle page of the sidecar's prefix cache (vLLM's reset_prefix_cache);
        returns once the active executor has. Pages that running requests use stay theirs.
        InvalidParams where the sidecar has no prefix cache."""
        self._ask(*self._core.request(lambda tag: m.ResetPrefixCache(tag=tag)))

    @property
    def last_heard(self) -> float:
        """When (time.monotonic()) the last message from the sidecar came."""
        return self._core.last_rx

    def disconnects(self) -> int:
        """How many times the connection to the sidecar has dropped (the socket monitor's
        events, read now)."""
        self._on_monitor()
        return self._reconnect.drops

    def close(self) -> None:
        self._shut()                # once: a finalizer runs its function at most one time

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ plumbing
    def _ask(self, tag: int, msg, on_silence: Callable[[], None] | None = None):
        """Send request `msg` and wait for its reply (see `submit` for `on_silence`)."""
        try:
            # the socket's connection events so far first: a request sent after a reconnect that
            # happened while this client was idle is not one sent before the connection was lost
            self._on_monitor()
            self._core.sending(tag)
            send_or_fail(self._sock, msg, self.endpoint)
            while not self._core.answered(tag):
                try:
                    self._receive_one()
                except SidecarUnavailable:
                    if on_silence is None:
                        raise
                    on_silence()
            return self._core.reply(tag)
        finally:
            self._core.forget(tag)

    def _receive_one(self) -> None:
        """Receive and handle one message; SidecarUnavailable after `timeout` of silence (or
        after the pause a pool restart announced, if longer). Open streams are re-attached with
        `Resume` as soon as the socket connected again, and after each RESUME_AFTER_S of
        silence: a restarted sidecar re-sends from there."""
        started = time.monotonic()
        while True:
            now = time.monotonic()
            wait_s = self._core.wait_s(started, now)
            send_quietly(self._sock, self._core.resume_due(now))
            ready = dict(self._poller.poll(max(1, int(wait_s * 1000))))
            if self._monitor in ready and self._on_monitor():
                return                       # requests sent before a lost connection failed
            if self._sock in ready:
                self._core.receive(self._sock.recv(), time.monotonic())
                return

    def _on_monitor(self) -> bool:
        """Handle the socket monitor's events; True when requests awaited were failed (their
        connection was lost before they were answered: kvhold.client.core.ClientCore.reconnected)."""
        failed = False
        while True:
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return failed
            resume, got = self._core.link_event(self._reconnect, frames, time.monotonic())
            if self._resume_on_reconnect:
                send_quietly(self._sock, resume)
            failed = failed or bool(got.replies)


def wait_all(streams: list[Stream], on_event=None) -> list[GenerationResult]:
    """Drive several streams of one Client together; `on_event(stream, event)` sees each token."""
    while streams:
        for s in streams:
            while s._state.pending:
                event = s._state.pending.popleft()
                if on_event is not None:
                    on_event(s, event)
        if all(s.finished for s in streams):
            break
        streams[0]._client._receive_one()
    return [s.result() for s in streams]
