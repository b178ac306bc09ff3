"""RoutedClient: generate() across a service's sidecars; a stream outlives its sidecar.

    view = RegistryView(EtcdGateway.from_url("etcd://10.0.0.5:2379"), "prod").start()
    with RoutedClient(view) as router:
        stream = router.generate("Once upon a time", max_tokens=64, temperature=0.8)
        for event in stream:          # TokenEvent; indices continue across moves
            print(event.text, end="")
        result = stream.result()      # RoutedResult: the whole output, plus `moves`

Routing: each request goes to the least loaded serving sidecar in the registry
(ipc.registry_client.pick_sidecar, counting this router's own streams); a sidecar marked
drain or starting is never picked, and one that refuses admission is skipped. A sidecar
is *lost* once it has been silent for `poll_s` and (a) its socket reported a disconnect
(the process died), (b) its registry entry is gone (lease expired), or (c) nothing, not
even a keepalive, came from it for `silence_s`. Every stream on a lost sidecar moves to
another with the same weights fingerprint: the prompt plus the tokens already streamed
(Generate.prefix_generated) with the same seed (chosen here when the caller gives none),
so the continuation is exactly the uninterrupted run's (sampling draws are keyed by seed
and absolute position). One RoutedClient, like one Client, is for one thread.
"""
from __future__ import annotations

import collections
import logging
import secrets
import time
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from ipc import messages as m
from ipc.client import Client, GenerationResult, Stream, TokenEvent, _StreamState
from ipc.errors import Overloaded, ShuttingDown, SidecarUnavailable
from ipc.registry_client import RegistryView, SidecarEntry, node_name, pick_sidecar
from ipc.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RoutedResult(GenerationResult):
    moves: tuple = ()            # one dict per move: from, to, reason, tokens carried, times
    sidecars: tuple = ()         # registry keys that served the request, in order


class _TrackedClient(Client):
    """A Client that remembers when it last heard from its sidecar, and stops waiting the
    moment its connection drops (the socket monitor wakes the same poll)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.last_heard = time.monotonic()
        self.monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self.monitor, zmq.POLLIN)

    def _receive_one(self) -> None:
        if self._sock not in dict(self._poller.poll(int(self.timeout * 1000))):
            raise SidecarUnavailable(f"no message from the sidecar at {self.endpoint}")
        self._dispatch(self._sock.recv())

    def _dispatch(self, frame: bytes) -> None:
        self.last_heard = time.monotonic()
        super()._dispatch(frame)

    def disconnected(self) -> bool:
        try:
            while True:
                if recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"] == zmq.EVENT_DISCONNECTED:
                    return True
        except zmq.Again:
            return False

    def close(self) -> None:
        self.monitor.close(0)
        super().close()


@dataclass(slots=True)
class _Conn:
    entry: SidecarEntry
    client: _TrackedClient
    streams: int = 0
    lost: str = ""


class RoutedClient:
    def __init__(self, view: RegistryView, *, poll_s: float = 0.05, silence_s: float = 5.0,
                 submit_timeout_s: float = 10.0, move_timeout_s: float = 30.0,
                 curve_secret_key_file=None, local_node: str | None = None):
        self.view = view
        self.poll_s = poll_s
        self.silence_s = silence_s
        self.submit_timeout_s = submit_timeout_s
        self.move_timeout_s = move_timeout_s
        self.curve_secret_key_file = curve_secret_key_file
        self.local_node = local_node or node_name()
        self._ctx = zmq.Context()
        self._conns: dict[str, _Conn] = {}
        self._lost: dict[str, int] = {}     # key -> pid of a lost sidecar, avoided while listed
        self._own_view = False

    @classmethod
    def connect(cls, registry_url: str, service: str = "default", **kwargs) -> "RoutedClient":
        """A router with its own registry view of `service` (stopped by close())."""
        from ipc.registry_client import EtcdGateway

        router = cls(RegistryView(EtcdGateway.from_url(registry_url), service).start(), **kwargs)
        router._own_view = True
        return router

    def generate(self, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
                 **params) -> "RoutedStream":
        if (prompt is None) == (prompt_ids is None):
            raise ValueError("give exactly one of prompt or prompt_ids")
        if params.get("seed") is None:       # a move must continue the same random stream
            params["seed"] = secrets.randbits(63)
        SamplingParams.from_dict(params)
        stream = RoutedStream(self, prompt, prompt_ids, params)
        stream._place(reason="")
        return stream

    def close(self) -> None:
        for conn in self._conns.values():
            conn.client.close()
        self._conns.clear()
        self._ctx.term()
        if self._own_view:
            self.view.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ sidecars
    def pick(self, exclude=(), fingerprint: str | None = None) -> SidecarEntry | None:
        entries = self.view.entries()
        listed = {e.key: e.pid for e in entries}
        for key, pid in list(self._lost.items()):
            if listed.get(key) != pid:   # gone from the registry, or a new process: forget
                del self._lost[key]
        pending = {k: c.streams for k, c in self._conns.items()}
        return pick_sidecar(entries, exclude=set(exclude) | set(self._lost), fingerprint=fingerprint,
                            local_node=self.local_node, pending=pending)

    def connection(self, entry: SidecarEntry) -> _Conn:
        conn = self._conns.get(entry.key)
        if conn is None or conn.entry.pid != entry.pid:
            if conn is not None:
                conn.client.close()
            local = entry.node == self.local_node
            curve = {} if local or not entry.curve_public_key else dict(
                curve_server_key=entry.curve_public_key.encode(),
                curve_secret_key_file=self.curve_secret_key_file)
            client = _TrackedClient(entry.endpoint if local else entry.tcp_endpoint,
                                    timeout=self.poll_s, context=self._ctx, **curve)
            conn = self._conns[entry.key] = _Conn(entry, client)
        return conn

    def check(self, conn: _Conn) -> str:
        """Why `conn`'s sidecar is lost, or "" while it may still be alive (see module doc)."""
        if conn.lost:
            return conn.lost
        entry = self.view.get(conn.entry.key)
        if conn.client.disconnected():
            reason = "connection closed"
        elif self.view.connected and (entry is None or entry.pid != conn.entry.pid):
            reason = "registry entry gone (lease expired)"
        elif time.monotonic() - conn.client.last_heard > self.silence_s:
            reason = f"silent for {self.silence_s:.1f} s"
        else:
            return ""
        log.warning("sidecar %s (pid %d) lost: %s; moving its %d stream(s)", conn.entry.key,
                    conn.entry.pid, reason, conn.streams)
        conn.lost = reason
        self._lost[conn.entry.key] = conn.entry.pid
        if self._conns.get(conn.entry.key) is conn:
            del self._conns[conn.entry.key]
        conn.client.close()
        return reason

    def submit(self, conn: _Conn, prompt, prompt_ids, params: dict, prefix: list[int]) -> Stream:
        """Generate on `conn`; raises SidecarUnavailable when it is lost meanwhile or silent."""
        client = conn.client
        tag = next(client._tags)
        client._send(m.Generate(tag=tag, params=params, prompt=prompt, prompt_ids=prompt_ids,
                                prefix_generated=list(prefix) or None))
        deadline = time.monotonic() + self.submit_timeout_s
        while True:
            try:
                reply = client._wait_reply(tag)
                break
            except SidecarUnavailable:
                reason = self.check(conn)
                if reason or time.monotonic() > deadline:
                    raise SidecarUnavailable(f"{conn.entry.key}: {reason or 'no reply'}") from None
        state = _StreamState(request_id=reply.request_id, prompt_tokens=reply.prompt_tokens)
        client._streams[reply.request_id] = state
        return Stream(client, state)


class RoutedStream:
    """One request's tokens, whichever sidecars produce them; `result()` waits for the end."""

    def __init__(self, router: RoutedClient, prompt, prompt_ids, params: dict):
        self.router = router
        self.prompt, self.prompt_ids, self.params = prompt, prompt_ids, params
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.pending: collections.deque = collections.deque()
        self.moves: list[dict] = []
        self.sidecars: list[str] = []
        self.fingerprint: str | None = None
        self.prompt_tokens = 0
        self._conn: _Conn | None = None
        self._inner: Stream | None = None
        self._segment_start = 0
        self._result: RoutedResult | None = None

    def __iter__(self):
        return self

    def __next__(self) -> TokenEvent:
        while not self.pending:
            if self._result is not None:
                raise StopIteration
            self.step()
        return self.pending.popleft()

    @property
    def finished(self) -> bool:
        return self._result is not None

    def result(self) -> RoutedResult:
        for _ in self:
            pass
        return self._result

    def step(self) -> None:
        """Wait (at most about poll_s when the sidecar is silent) for progress: a token, the end,
        or a move to another sidecar."""
        st = self._inner._state
        if self._conn.lost and not st.pending and st.done is None and st.error is None:
            return self._place(self._conn.lost)     # lost while another stream was waiting
        try:
            event = next(self._inner)
        except StopIteration:
            return self._finish(self._inner.result())
        except SidecarUnavailable:
            reason = self.router.check(self._conn)
            if reason:
                self._place(reason)
            return
        if self.moves and "first_token_s" not in self.moves[-1]:
            self.moves[-1]["first_token_s"] = time.monotonic() - self.moves[-1]["lost_at"]
        event = TokenEvent(index=len(self.token_ids), token_id=event.token_id, text=event.text)
        self.token_ids.append(event.token_id)
        self.texts.append(event.text)
        self.pending.append(event)

    def _place(self, reason: str) -> None:
        """Start (or continue, after `reason`) on the best sidecar; retry until move_timeout_s."""
        r = self.router
        old, lost_at = self._conn, time.monotonic()
        if old is not None:
            old.streams -= 1
            if len(self.token_ids) >= self.params.get("max_tokens", 16):   # only the Done was lost
                return self._finish(None, "length")
        skip: set[str] = set()
        while True:
            entry = r.pick(exclude=skip, fingerprint=self.fingerprint)
            if entry is not None:
                conn = r.connection(entry)
                try:
                    self._inner = r.submit(conn, self.prompt, self.prompt_ids, self.params, self.token_ids)
                    break
                except (ShuttingDown, Overloaded, SidecarUnavailable) as exc:
                    log.info("sidecar %s did not take the request: %s", entry.key, exc)
                    skip.add(entry.key)
                    continue
            if time.monotonic() - lost_at > r.move_timeout_s:
                raise SidecarUnavailable(f"no serving sidecar in the registry for {r.move_timeout_s:.0f} s"
                                         + (f" (after: {reason})" if reason else ""))
            skip.clear()
            time.sleep(0.05)
        self._conn, self._segment_start = conn, len(self.token_ids)
        conn.streams += 1
        self.fingerprint = self.fingerprint or entry.fingerprint
        self.prompt_tokens = self.prompt_tokens or self._inner._state.prompt_tokens
        if old is not None:
            self.moves.append({"from": old.entry.key, "to": entry.key, "reason": reason,
                               "tokens_carried": len(self.token_ids), "lost_at": lost_at,
                               "resubmitted_s": time.monotonic() - lost_at})
        self.sidecars.append(entry.key)

    def _finish(self, last: GenerationResult | None, reason: str = "") -> None:
        if self._conn is not None and last is not None:
            self._conn.streams -= 1
        text = "".join(self.texts[:self._segment_start]) + (last.text if last else "".join(
            self.texts[self._segment_start:]))
        self._result = RoutedResult(
            request_id=last.request_id if last else 0, token_ids=list(self.token_ids), text=text,
            finish_reason=last.finish_reason if last else reason, prompt_tokens=self.prompt_tokens,
            completion_tokens=len(self.token_ids), preemptions=last.preemptions if last else 0,
            recomputed_tokens=last.recomputed_tokens if last else 0,
            moves=tuple(self.moves), sidecars=tuple(self.sidecars))


def wait_all(streams: list[RoutedStream], on_event=None) -> list[RoutedResult]:
    """Drive several routed streams together; `on_event(stream, event)` sees each token."""
    while True:
        for s in streams:
            while s.pending:
                event = s.pending.popleft()
                if on_event is not None:
                    on_event(s, event)
        live = [s for s in streams if not s.finished]
        if not live:
            return [s.result() for s in streams]
        for s in live:
            s.step()
