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
one thread (several streams may be interleaved); see AsyncClient for asyncio.
"""
from __future__ import annotations

import collections
import itertools
import os
import time
import weakref
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvhold.protocol import messages as m, wire
from kvhold.protocol.curve import apply_client_curve
from kvhold.protocol.errors import ProtocolError, SidecarUnavailable, error_from_code
from kvhold.protocol.naming import InstancePaths
from kvhold.protocol.sampling import RequestInput

RESUME_AFTER_S = 1.0   # silence (two missed keepalives) after which open streams are re-attached
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


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability under the model's raw distribution (None for a prompt's first
    token, which has none) and the most likely tokens there, (token id, log-prob), most likely
    first; asked for with `logprobs=k` (generated tokens) or `prompt_logprobs=k`."""
    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class TokenEvent:
    index: int
    token_id: int
    text: str
    logprob: TokenLogprob | None = None      # with logprobs=k


@dataclass(frozen=True, slots=True)
class GenerationResult:
    request_id: int
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    preemptions: int = 0
    recomputed_tokens: int = 0
    queue_s: float | None = None      # the sidecar's: admitted -> first scheduled (None: not known)
    prefill_s: float | None = None    # first scheduled -> first token
    logprobs: list[TokenLogprob] | None = None          # one per generated token, with logprobs=k
    prompt_logprobs: list[TokenLogprob] | None = None   # one per prompt token, with prompt_logprobs=k


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



# ------------------------------------------------------------------ shared by Client and AsyncClient
def take_tokens(st, msg: m.Tokens) -> bool:
    """Append `msg`'s tokens to stream state `st`, never one twice. False (and `st.error`
    set) when the message skips ahead: tokens were lost."""
    st.heard = time.monotonic()
    have = len(st.token_ids)
    if msg.start > have:
        st.error = ProtocolError(f"request {msg.request_id}: gap in the stream "
                                 f"(have {have} tokens, got index {msg.start})")
        return False
    skip = have - msg.start
    if msg.prompt_ids is not None and st.prompt_logprobs is None:
        st.prompt_logprobs = [TokenLogprob(msg.prompt_ids[0], None)] + _logprobs(
            msg.prompt_ids[1:], msg.prompt_logprobs, msg.prompt_top_ids, msg.prompt_top_logprobs)
    lps = (_logprobs(msg.ids, msg.logprobs, msg.top_ids, msg.top_logprobs) if msg.logprobs is not None
           else [None] * len(msg.ids))
    for offset, (tid, text, lp) in enumerate(zip(msg.ids[skip:], msg.texts[skip:], lps[skip:])):
        st.pending.append(TokenEvent(index=have + offset, token_id=tid, text=text, logprob=lp))
        st.token_ids.append(tid)
        if lp is not None:
            st.logprobs.append(lp)
    return True


def _logprobs(ids, logprobs, top_ids, top_logprobs) -> list[TokenLogprob]:
    if logprobs is None or len(logprobs) != len(ids):
        raise ProtocolError("a tokens message's log-probs do not match its tokens")
    return [TokenLogprob(t, lp, tuple(zip(ti, tl))) for t, lp, ti, tl in zip(ids, logprobs, top_ids, top_logprobs)]


def result_of(st, done: m.Done) -> GenerationResult:
    """The GenerationResult of a finished stream's state."""
    return GenerationResult(request_id=st.request_id, token_ids=list(st.token_ids), text=done.text,
                            finish_reason=done.finish_reason, prompt_tokens=done.prompt_tokens,
                            completion_tokens=done.completion_tokens, preemptions=done.preemptions,
                            recomputed_tokens=done.recomputed_tokens, queue_s=done.queue_s,
                            prefill_s=done.prefill_s,
                            logprobs=list(st.logprobs) if len(st.logprobs) == len(st.token_ids) and st.logprobs
                            else None, prompt_logprobs=st.prompt_logprobs)


def resume_message(streams: dict, now: float) -> m.Resume | None:
    """Re-attach the streams silent for RESUME_AFTER_S (other traffic does not count), or None."""
    ids = [r for r, st in streams.items() if now - st.heard >= RESUME_AFTER_S]
    if not ids:
        return None
    return m.Resume(request_ids=ids, next_indices=[len(streams[r].token_ids) for r in ids])


def resume_all(streams: dict) -> m.Resume | None:
    """Re-attach every open stream (the socket reconnected: the sidecar may be a new one)."""
    if not streams:
        return None
    return m.Resume(request_ids=list(streams), next_indices=[len(st.token_ids) for st in streams.values()])


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


class ReconnectWatch:
    """Reads a socket monitor's events: `seen(frames)` is True for a handshake that succeeded
    after a disconnect (not for the first connection)."""

    def __init__(self):
        self.disconnected = False
        self.reconnects = 0

    def seen(self, frames) -> bool:
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_DISCONNECTED:
            self.disconnected = True
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and self.disconnected:
            self.disconnected = False
            self.reconnects += 1
            return True
        return False


def hear_keepalive(streams: dict, msg: m.Keepalive) -> None:
    now = time.monotonic()
    for rid in msg.request_ids:
        if rid in streams:
            streams[rid].heard = now


class Stream:
    """Iterator over one request's tokens; `result()` waits for the end."""

    def __init__(self, client: "Client", state: _StreamState):
        self._client = client
        self._state = state

    @property
    def request_id(self) -> int:
        return self._state.request_id

    @property
    def finished(self) -> bool:
        return self._state.done is not None or self._state.error is not None

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
        return result_of(self._state, self._state.done)

    def cancel(self) -> None:
        self._client.cancel(self.request_id)


class Client:
    """`endpoint` is ipc://PATH (local, owner-only) or tcp://HOST:PORT. Over TCP give the
    server's public key (z85 or its .key file) and this client's .key_secret file to speak
    CurveZMQ; a CURVE sidecar serves nobody else (see kvhold.protocol.curve, `kvhold keygen`)."""

    def __init__(self, endpoint: str, timeout: float = 10.0, identity: bytes | None = None,
                 context: zmq.Context | None = None, curve_server_key=None,
                 curve_secret_key_file: os.PathLike | None = None, resume_on_reconnect: bool = True):
        """`resume_on_reconnect`: re-attach open streams as soon as the socket has connected again
        (a socket monitor); False leaves only the silence timer (a router, which moves streams
        elsewhere when a connection drops, watches the socket itself)."""
        if (curve_server_key is None) != (curve_secret_key_file is None):
            raise ValueError("CURVE needs both curve_server_key and curve_secret_key_file")
        self.endpoint = endpoint
        self.timeout = timeout
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._sock = dealer_socket(self._ctx, identity)
        if curve_server_key is not None:
            try:
                apply_client_curve(self._sock, curve_server_key, curve_secret_key_file)
            except BaseException:
                self.close()
                raise
        self._monitor = self._sock.get_monitor_socket(RECONNECT_EVENTS) if resume_on_reconnect else None
        self._reconnect = ReconnectWatch()
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        if self._monitor is not None:
            self._poller.register(self._monitor, zmq.POLLIN)
        self._shut = weakref.finalize(self, shut_sockets, self._sock, self._monitor, self._ctx, self._own_ctx)
        self._sock.connect(endpoint)
        self._tags = itertools.count(1)
        self._replies: dict[int, object] = {}
        self._streams: dict[int, _StreamState] = {}
        self._last_rx = self._last_resume = time.monotonic()
        self._pause_until = 0.0    # a pool restart announced a pause until then (monotonic)

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
        req = RequestInput.check(prompt, prompt_ids, prefix_generated, params)
        tag = next(self._tags)
        self._send(m.Generate(tag=tag, params=req.sampling, prompt=req.prompt,
                              prompt_ids=req.prompt_ids, prefix_generated=req.prefix or None))
        reply = self._wait_reply(tag)
        state = _StreamState(request_id=reply.request_id, prompt_tokens=reply.prompt_tokens)
        self._streams[reply.request_id] = state
        return Stream(self, state)

    def cancel(self, request_id: int) -> None:
        tag = next(self._tags)
        self._send(m.Cancel(tag=tag, request_id=request_id))
        self._wait_reply(tag)

    def status(self) -> dict:
        tag = next(self._tags)
        self._send(m.Status(tag=tag))
        return self._wait_reply(tag).status

    def ping(self) -> int:
        """Round trip; returns the pool generation."""
        tag = next(self._tags)
        self._send(m.Ping(tag=tag))
        return self._wait_reply(tag).generation

    def pool_restart(self, hold: bool = False, client_grace_s: float = 300.0) -> m.PoolRestartReply:
        """Ask the sidecar to restart its pool (see kvhold.cli.pool_restart); returns once it drains."""
        tag = next(self._tags)
        self._send(m.PoolRestart(tag=tag, hold=hold, client_grace_s=client_grace_s))
        return self._wait_reply(tag)

    def admissions(self, reopen: bool = False) -> m.AdmissionsReply:
        """Whether the sidecar admits new requests, and who closed them; `reopen` lifts a
        health action's closure first (local socket only; see `kvhold admissions`)."""
        tag = next(self._tags)
        self._send(m.Admissions(tag=tag, reopen=reopen))
        return self._wait_reply(tag)

    def close(self) -> None:
        shut = getattr(self, "_shut", None)
        if shut is not None:
            shut()                  # once: a finalizer runs its function at most one time
            return
        shut_sockets(self._sock, getattr(self, "_monitor", None), self._ctx, self._own_ctx)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ plumbing
    def _send(self, msg) -> None:
        try:
            self._sock.send(wire.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            raise SidecarUnavailable(f"cannot queue a message to {self.endpoint}") from None

    def _wait_reply(self, tag: int):
        while tag not in self._replies:
            self._receive_one()
        reply = self._replies.pop(tag)
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _receive_one(self) -> None:
        """Receive and dispatch one message; SidecarUnavailable after `timeout` of silence (or
        after the pause a pool restart announced, if longer). Open streams are re-attached with
        `Resume` as soon as the socket connected again, and after each RESUME_AFTER_S of
        silence: a restarted sidecar re-sends from there."""
        started = time.monotonic()
        while True:
            now = time.monotonic()
            deadline = max(max(self._last_rx, started) + self.timeout, self._pause_until)
            if now >= deadline:
                raise SidecarUnavailable(f"no message from the sidecar at {self.endpoint} for "
                                         f"{self.timeout:.1f} s")
            if now - self._last_resume >= RESUME_AFTER_S:
                self._send_resume()
            ready = dict(self._poller.poll(max(1, int(min(deadline - now, RESUME_AFTER_S) * 1000))))
            if self._monitor is not None and self._monitor in ready:
                self._on_monitor()
            if self._sock in ready:
                self._last_rx = time.monotonic()
                self._dispatch(self._sock.recv())
                return

    def _on_monitor(self) -> None:
        while True:
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if self._reconnect.seen(frames):
                self._last_resume = time.monotonic()
                self._queue(resume_all(self._streams))

    def _send_resume(self) -> None:
        now = self._last_resume = time.monotonic()
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
        self._pause_until = 0.0    # a sidecar is serving our streams (again): normal timeout

    def _dispatch(self, frame: bytes) -> None:
        try:
            msg = wire.decode(frame)
        except wire.WireError as exc:
            raise ProtocolError(f"undecodable message from the sidecar: {exc}") from None
        handler = self._HANDLERS.get(type(msg))
        if handler is not None:
            handler(self, msg)

    def _on_tokens(self, msg: m.Tokens) -> None:
        st = self._streams.get(msg.request_id)
        if st is not None:
            take_tokens(st, msg)

    def _on_done(self, msg: m.Done) -> None:
        st = self._streams.pop(msg.request_id, None)
        if st is not None:
            st.done = msg

    def _on_error(self, msg: m.Error) -> None:
        exc = error_from_code(msg.code, msg.message)
        if msg.tag:
            self._replies[msg.tag] = exc
        elif msg.request_id in self._streams:
            self._streams.pop(msg.request_id).error = exc

    def _on_reply(self, msg) -> None:
        self._replies[msg.tag] = msg

    _HANDLERS = {m.Tokens: _on_tokens, m.Done: _on_done, m.Error: _on_error,
                 m.Accepted: _on_reply, m.Cancelled: _on_reply, m.StatusReply: _on_reply,
                 m.Pong: _on_reply, m.Keepalive: _on_keepalive, m.Restarting: _on_restarting,
                 m.PoolRestartReply: _on_reply, m.AdmissionsReply: _on_reply}


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
