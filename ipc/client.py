"""Client SDK: generate, stream, cancel, status over ZeroMQ.

    from ipc.client import Client
    with Client.for_instance("default") as client:
        stream = client.generate("Once upon a time", max_tokens=32, temperature=0.8, seed=1)
        for event in stream:             # TokenEvent(index, token_id, text)
            print(event.text, end="")
        result = stream.result()         # finish_reason, usage, full text

A stream survives executor crashes with no action by the caller: the sidecar
keeps it open, sends keepalives during the pause and continues from the next
token, with no duplicate and no gap (the SDK checks the indices). Errors are
typed (ipc.errors): bad parameters raise `InvalidParams` and its subclasses
before or after a round trip; a sidecar that stays silent for `timeout` seconds
raises `SidecarUnavailable`, never a hang. One Client is one socket: use it from
one thread (several streams may be interleaved); see AsyncClient for asyncio.
"""
from __future__ import annotations

import collections
import itertools
import os
from dataclasses import dataclass, field

import zmq

from ipc import messages as m, wire
from ipc.errors import ProtocolError, SidecarUnavailable, error_from_code
from ipc.naming import InstancePaths
from ipc.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class TokenEvent:
    index: int
    token_id: int
    text: str


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


@dataclass(slots=True)
class _StreamState:
    request_id: int
    prompt_tokens: int
    token_ids: list = field(default_factory=list)
    pending: collections.deque = field(default_factory=collections.deque)
    done: m.Done | None = None
    error: Exception | None = None


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
        st = self._state
        return GenerationResult(request_id=st.request_id, token_ids=list(st.token_ids),
                                text=st.done.text, finish_reason=st.done.finish_reason,
                                prompt_tokens=st.done.prompt_tokens,
                                completion_tokens=st.done.completion_tokens,
                                preemptions=st.done.preemptions,
                                recomputed_tokens=st.done.recomputed_tokens)

    def cancel(self) -> None:
        self._client.cancel(self.request_id)


class Client:
    def __init__(self, endpoint: str, timeout: float = 10.0, identity: bytes | None = None,
                 context: zmq.Context | None = None):
        self.endpoint = endpoint
        self.timeout = timeout
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A stable identity keeps ownership of our requests across reconnects.
        self._sock.setsockopt(zmq.ROUTING_ID, identity or os.urandom(16))
        self._sock.connect(endpoint)
        self._tags = itertools.count(1)
        self._replies: dict[int, object] = {}
        self._streams: dict[int, _StreamState] = {}

    @classmethod
    def for_instance(cls, instance: str = "default", runtime_root=None, **kwargs) -> "Client":
        paths = InstancePaths.for_instance(instance, runtime_root)
        return cls(paths.client_endpoint, **kwargs)

    # ------------------------------------------------------------------ API
    def generate(self, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
                 **params) -> Stream:
        if (prompt is None) == (prompt_ids is None):
            raise ValueError("give exactly one of prompt or prompt_ids")
        sampling = SamplingParams.from_dict(params)  # fail fast; the sidecar checks again
        tag = next(self._tags)
        self._send(m.Generate(tag=tag, params=sampling.to_dict(), prompt=prompt,
                              prompt_ids=list(prompt_ids) if prompt_ids is not None else None))
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

    def close(self) -> None:
        self._sock.close(0)
        if self._own_ctx:
            self._ctx.term()

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
        """Receive and dispatch one message; SidecarUnavailable after `timeout` of silence."""
        if not self._sock.poll(int(self.timeout * 1000), zmq.POLLIN):
            raise SidecarUnavailable(f"no message from the sidecar at {self.endpoint} for "
                                     f"{self.timeout:.1f} s")
        self._dispatch(self._sock.recv())

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
        if st is None:
            return
        have = len(st.token_ids)
        if msg.start > have:
            st.error = ProtocolError(f"request {msg.request_id}: gap in the stream "
                                     f"(have {have} tokens, got index {msg.start})")
            return
        skip = have - msg.start  # never deliver a token twice
        for offset, (tid, text) in enumerate(zip(msg.ids[skip:], msg.texts[skip:])):
            st.pending.append(TokenEvent(index=have + offset, token_id=tid, text=text))
            st.token_ids.append(tid)

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
                 m.Pong: _on_reply, m.Keepalive: lambda self, msg: None}


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
