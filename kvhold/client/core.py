"""The SDK's protocol logic, free of any I/O: what both clients (kvhold.client.client.Client,
kvhold.client.aclient.AsyncClient) do with the sidecar's messages.

`ClientCore` takes the messages a client receives (`receive`: a frame, the time it came) and
keeps everything they decide: the open streams (tokens, in order and never twice; the end or
the error), the replies awaited by tag, when the sidecar was last heard from, the pause a pool
restart announced, and when open streams are re-attached (`Resume`) after a silence or a
reconnect. It sends nothing and waits for nothing: it returns the messages to send and says
which replies and streams a message changed (`Received`); each client does the sending and
the waiting its own way (blocking sockets and a poller, or asyncio).
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvhold.protocol import messages as m, wire
from kvhold.protocol.errors import ProtocolError, SidecarUnavailable, error_from_code
from kvhold.protocol.sampling import RequestInput

RESUME_AFTER_S = 1.0   # silence (two missed keepalives) after which open streams are re-attached


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability under the model's raw distribution (None for a prompt's first
    token, which has none) and the most likely tokens there, (token id, log-prob), most likely
    first; asked for with `logprobs=k` (generated tokens) or `prompt_logprobs=k`."""
    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None      # 1: the most likely token there (None: not known, a prompt's first)


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
    cached_tokens: int = 0            # prompt tokens whose KV came from the prefix cache
    queue_s: float | None = None      # the sidecar's: admitted -> first scheduled (None: not known)
    prefill_s: float | None = None    # first scheduled -> first token
    logprobs: list[TokenLogprob] | None = None          # one per generated token, with logprobs=k
    prompt_logprobs: list[TokenLogprob] | None = None   # one per prompt token, with prompt_logprobs=k


@dataclass(slots=True, eq=False)
class StreamState:
    """One request's stream: the tokens so far, those not yet taken (`pending`), its end."""
    request_id: int
    prompt_tokens: int
    heard: float                                         # last tokens or keepalive for it
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)         # TokenLogprob per token, when asked for
    prompt_logprobs: list | None = None                  # TokenLogprob per prompt token, when asked for
    pending: collections.deque = field(default_factory=collections.deque)
    done: m.Done | None = None
    error: Exception | None = None
    waiter: Any = None            # the I/O side's wake-up for whoever waits on it (the core never uses it)

    @property
    def finished(self) -> bool:
        return self.done is not None or self.error is not None

    def result(self) -> GenerationResult:
        """The GenerationResult of a stream that is done."""
        done = self.done
        return GenerationResult(request_id=self.request_id, token_ids=list(self.token_ids), text=done.text,
                                finish_reason=done.finish_reason, prompt_tokens=done.prompt_tokens,
                                completion_tokens=done.completion_tokens, preemptions=done.preemptions,
                                recomputed_tokens=done.recomputed_tokens, cached_tokens=done.cached_tokens,
                                queue_s=done.queue_s,
                                prefill_s=done.prefill_s,
                                logprobs=list(self.logprobs) if self.logprobs and len(self.logprobs) == len(
                                    self.token_ids) else None,
                                prompt_logprobs=self.prompt_logprobs)


class StreamView:
    """What a stream object (the SDKs' Stream and AsyncStream) tells of its state."""

    def __init__(self, client, state: StreamState):
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
    def buffered(self) -> int:
        """Tokens received and not yet taken."""
        return len(self._state.pending)

    @property
    def prompt_logprobs(self) -> list[TokenLogprob] | None:
        """The prompt's TokenLogprob list (asked for with prompt_logprobs=k), once the first
        tokens have arrived; None before, or when not asked for."""
        return self._state.prompt_logprobs


@dataclass(slots=True)
class Received:
    """What one message changed: the tags whose reply came, the streams with news (tokens, the
    end, an error, or a keepalive naming them)."""
    replies: list[int] = field(default_factory=list)
    streams: list[StreamState] = field(default_factory=list)


class ReconnectWatch:
    """Reads a socket monitor's events: `seen(frames)` is True for a handshake that succeeded
    after a disconnect (not for the first connection); `drops` counts the disconnects."""

    def __init__(self):
        self.disconnected = False
        self.reconnects = 0
        self.drops = 0

    def seen(self, frames) -> bool:
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_DISCONNECTED:
            self.disconnected = True
            self.drops += 1
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and self.disconnected:
            self.disconnected = False
            self.reconnects += 1
            return True
        return False


_NO_REPLY = object()


class ClientCore:
    """One client's protocol state (see the module doc). Times are time.monotonic() values,
    given by the caller."""

    def __init__(self, endpoint: str, timeout: float, now: float):
        self.endpoint = endpoint
        self.timeout = timeout
        self.streams: dict[int, StreamState] = {}
        self._tags = itertools.count(1)
        self._awaited: dict[int, object] = {}     # tag -> its reply (_NO_REPLY until it comes)
        self._link = 0                # connections lost so far (socket monitor)
        self._sent_on: dict[int, int] = {}        # tag -> `_link` when it was sent
        self.last_rx = self.last_resume = now
        self.pause_until = 0.0        # a pool restart announced a pause until then

    # ------------------------------------------------------------------ requests
    def request(self, make: Callable[[int], Any]) -> tuple[int, Any]:
        """(tag, message) of a new request: `make(tag)` builds it; its reply is awaited."""
        tag = next(self._tags)
        self._awaited[tag] = _NO_REPLY
        return tag, make(tag)

    def sending(self, tag: int) -> None:
        """Request `tag` goes out now, on the connection as the socket monitor last told it."""
        self._sent_on[tag] = self._link

    def generate(self, request: RequestInput) -> tuple[int, m.Generate]:
        """The Generate of a checked request; its reply is the new stream's StreamState."""
        return self.request(lambda tag: m.Generate(
            tag=tag, params=request.sampling, prompt=request.prompt, prompt_ids=request.prompt_ids,
            prefix_generated=list(request.prefix) or None))

    def answered(self, tag: int) -> bool:
        return self._awaited.get(tag, _NO_REPLY) is not _NO_REPLY

    def reply(self, tag: int):
        """Take the reply to `tag` (the request is then done with); raises the error it was."""
        reply = self._awaited.pop(tag)
        self._sent_on.pop(tag, None)
        if isinstance(reply, Exception):
            raise reply
        return reply

    def forget(self, tag: int) -> None:
        """Stop awaiting `tag` (its waiter gave up): a late reply is dropped, and a late
        Accepted opens no stream."""
        self._awaited.pop(tag, None)
        self._sent_on.pop(tag, None)

    def attach(self, request_id: int, now: float) -> tuple[StreamState, m.Resume]:
        """A stream for a request this client's key owns but this client has no stream for,
        and the Resume that asks for its tokens from the first (see AsyncClient.attach)."""
        if request_id in self.streams:
            raise ValueError(f"request {request_id:#x} already has a stream on this client")
        st = self.streams[request_id] = StreamState(request_id, 0, heard=now)
        return st, m.Resume(request_ids=[request_id], next_indices=[0])

    @staticmethod
    def attach_answered(st: StreamState, asked: float) -> bool:
        """The sidecar answered an attach: tokens, the end, an error, or a keepalive naming it."""
        return bool(st.pending) or st.finished or st.heard > asked

    def drop(self, st: StreamState) -> None:
        """Forget stream `st` (an attach that got no answer)."""
        if self.streams.get(st.request_id) is st:
            del self.streams[st.request_id]

    # ------------------------------------------------------------------ messages
    def receive(self, frame: bytes, now: float) -> Received:
        """Handle one frame from the sidecar; ProtocolError when it cannot be decoded."""
        self.last_rx = now
        try:
            msg = wire.decode(frame)
        except wire.WireError as exc:
            raise ProtocolError(f"undecodable message from the sidecar: {exc}") from None
        return self.handle(msg, now)

    def handle(self, msg, now: float) -> Received:
        got = Received()
        handler = self._HANDLERS.get(type(msg))
        if handler is not None:
            handler(self, msg, now, got)
        return got

    def fail_all(self, exc: Exception) -> Received:
        """Every awaited reply and every open stream ends with `exc`."""
        got = Received(replies=[t for t, r in self._awaited.items() if r is _NO_REPLY],
                       streams=list(self.streams.values()))
        for tag in got.replies:
            self._awaited[tag] = exc
        for st in got.streams:
            st.error = exc
        self.streams.clear()
        return got

    def _answer(self, tag: int, value, got: Received) -> None:
        if self._awaited.get(tag, None) is _NO_REPLY:
            self._awaited[tag] = value
            got.replies.append(tag)

    def _on_accepted(self, msg: m.Accepted, now: float, got: Received) -> None:
        # The stream is opened here, not when its waiter wakes: tokens, and the Done of a short
        # request, may be handled before then.
        if self._awaited.get(msg.tag, None) is _NO_REPLY:
            st = self.streams[msg.request_id] = StreamState(msg.request_id, msg.prompt_tokens, heard=now)
            self._answer(msg.tag, st, got)

    def _on_reply(self, msg, now: float, got: Received) -> None:
        self._answer(msg.tag, msg, got)

    def _on_tokens(self, msg: m.Tokens, now: float, got: Received) -> None:
        st = self.streams.get(msg.request_id)
        if st is None:
            return
        if not take_tokens(st, msg, now):
            del self.streams[msg.request_id]       # tokens were lost: the stream ends in error
        got.streams.append(st)

    def _on_done(self, msg: m.Done, now: float, got: Received) -> None:
        st = self.streams.pop(msg.request_id, None)
        if st is not None:
            st.done = msg
            got.streams.append(st)

    def _on_error(self, msg: m.Error, now: float, got: Received) -> None:
        exc = error_from_code(msg.code, msg.message)
        if msg.tag:                                  # the answer to a request (awaited or not)
            self._answer(msg.tag, exc, got)
        elif msg.request_id in self.streams:
            st = self.streams.pop(msg.request_id)
            st.error = exc
            got.streams.append(st)

    def _on_keepalive(self, msg: m.Keepalive, now: float, got: Received) -> None:
        for rid in msg.request_ids:
            st = self.streams.get(rid)
            if st is not None:
                st.heard = now
                got.streams.append(st)
        self.pause_until = 0.0     # a sidecar serves our streams (again): normal timeout

    def _on_restarting(self, msg: m.Restarting, now: float, got: Received) -> None:
        self.pause_until = max(self.pause_until, now + msg.resume_within_s)

    _HANDLERS = {m.Accepted: _on_accepted, m.Tokens: _on_tokens, m.Done: _on_done, m.Error: _on_error,
                 m.Cancelled: _on_reply, m.StatusReply: _on_reply, m.Pong: _on_reply,
                 m.PoolRestartReply: _on_reply, m.AdmissionsReply: _on_reply,
                 m.ResetPrefixCacheReply: _on_reply,
                 m.Keepalive: _on_keepalive, m.Restarting: _on_restarting}

    # ------------------------------------------------------------------ silence and resumes
    def wait_s(self, started: float, now: float) -> float:
        """How long a client waiting since `started` may block before it asks again (for
        `resume_due`); SidecarUnavailable once the sidecar has been silent for `timeout`
        (or, if later, past the pause a pool restart announced)."""
        left = max(max(self.last_rx, started) + self.timeout, self.pause_until) - now
        if left <= 0:
            raise SidecarUnavailable(f"no message from the sidecar at {self.endpoint} for "
                                     f"{self.timeout:.1f} s")
        return min(left, RESUME_AFTER_S)

    def resume_due(self, now: float) -> m.Resume | None:
        """Once per RESUME_AFTER_S: re-attach the streams silent that long (other traffic does
        not count; a restarted sidecar re-sends from there), or None."""
        if now - self.last_resume < RESUME_AFTER_S:
            return None
        self.last_resume = now
        ids = [r for r, st in self.streams.items() if now - st.heard >= RESUME_AFTER_S]
        if not ids:
            return None
        return m.Resume(request_ids=ids, next_indices=[len(self.streams[r].token_ids) for r in ids])

    def link_event(self, watch: ReconnectWatch, frames, now: float) -> tuple[m.Resume | None, Received]:
        """One socket-monitor event, read by `watch`: a lost connection is noted
        (`connection_lost`); a reconnect gives what `reconnected` does; anything else nothing."""
        drops = watch.drops
        again = watch.seen(frames)
        if watch.drops != drops:
            self.connection_lost()
        return self.reconnected(now) if again else (None, Received())

    def connection_lost(self) -> None:
        """The socket lost its connection (socket monitor): what was sent before it is answered
        by that peer or never (a ROUTER drops what it sends to a client that is not connected)."""
        self._link += 1

    def reconnected(self, now: float) -> tuple[m.Resume | None, Received]:
        """The socket connected again (the sidecar or its frontend may be a new process): the
        Resume that re-attaches every open stream, and the requests sent before the connection
        was lost that got no answer, now failed with SidecarUnavailable: a Generate the old
        process took and died with may never have been admitted, and an answer sent meanwhile
        was dropped; the caller sends it again (an HTTP client gets 503 and Retry-After)."""
        self.last_resume = now
        got = Received()
        for tag in [t for t, r in self._awaited.items() if r is _NO_REPLY and self._sent_on.get(t, self._link) < self._link]:
            self._answer(tag, SidecarUnavailable(
                f"the connection to the sidecar at {self.endpoint} was lost before it answered: the "
                "request may not have been taken; send it again"), got)
        if not self.streams:
            return None, got
        return m.Resume(request_ids=list(self.streams),
                        next_indices=[len(st.token_ids) for st in self.streams.values()]), got


def take_tokens(st: StreamState, msg: m.Tokens, now: float) -> bool:
    """Append `msg`'s tokens to stream `st`, never one twice. False (and `st.error` set) when
    the message skips ahead: tokens were lost."""
    st.heard = now
    have = len(st.token_ids)
    if msg.start > have:
        st.error = ProtocolError(f"request {msg.request_id}: gap in the stream "
                                 f"(have {have} tokens, got index {msg.start})")
        return False
    skip = have - msg.start
    if msg.prompt_ids is not None and st.prompt_logprobs is None:
        st.prompt_logprobs = [TokenLogprob(msg.prompt_ids[0], None)] + _logprobs(
            msg.prompt_ids[1:], msg.prompt_logprobs, msg.prompt_top_ids, msg.prompt_top_logprobs, msg.prompt_ranks)
    lps = (_logprobs(msg.ids, msg.logprobs, msg.top_ids, msg.top_logprobs, msg.ranks) if msg.logprobs is not None
           else [None] * len(msg.ids))
    for offset, (tid, text, lp) in enumerate(zip(msg.ids[skip:], msg.texts[skip:], lps[skip:])):
        st.pending.append(TokenEvent(index=have + offset, token_id=tid, text=text, logprob=lp))
        st.token_ids.append(tid)
        if lp is not None:
            st.logprobs.append(lp)
    return True


def _logprobs(ids, logprobs, top_ids, top_logprobs, ranks=None) -> list[TokenLogprob]:
    if logprobs is None or len(logprobs) != len(ids) or (ranks is not None and len(ranks) != len(ids)):
        raise ProtocolError("a tokens message's log-probs do not match its tokens")
    ranks = ranks if ranks is not None else [None] * len(ids)
    return [TokenLogprob(t, lp, tuple(zip(ti, tl)), r)
            for t, lp, ti, tl, r in zip(ids, logprobs, top_ids, top_logprobs, ranks)]
