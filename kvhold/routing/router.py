"""RoutedClient: generate() across a service's sidecars; a stream outlives its sidecar.

    view = RegistryView(EtcdGateway.from_url("etcd://10.0.0.5:2379"), "prod").start()
    with RoutedClient(view) as router:
        stream = router.generate("Once upon a time", max_tokens=64, temperature=0.8)
        for event in stream:          # TokenEvent; indices continue across moves
            print(event.text, end="")
        result = stream.result()      # RoutedResult: the whole output, plus `moves`

Routing: each request goes to the least loaded serving sidecar in the registry
(kvhold.routing.registry_client.pick_sidecar, counting this router's own streams); a sidecar marked
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
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvhold.protocol import messages as m
from kvhold.client.client import Client, Stream, TokenEvent, _StreamState
from kvhold.protocol.errors import Overloaded, ShuttingDown, SidecarUnavailable
from kvhold.protocol.sampling import SamplingParams
from kvhold.routing.registry_client import RegistryView, SidecarEntry
from kvhold.routing.routing import Conn, RoutedResult, RouterCore, StreamLog, routed_params

__all__ = ["RoutedClient", "RoutedStream", "RoutedResult", "wait_all"]
log = logging.getLogger(__name__)


class _TrackedClient(Client):
    """A Client that remembers when it last heard from its sidecar, and stops waiting the
    moment its connection drops (the socket monitor wakes the same poll)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, resume_on_reconnect=False, **kwargs)   # this monitor is the router's
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


class RoutedClient(RouterCore):
    def __init__(self, view: RegistryView, **kwargs):
        super().__init__(view, **kwargs)
        self._ctx = zmq.Context()
        self._own_view = False

    @classmethod
    def connect(cls, registry_url: str, service: str = "default", **kwargs) -> "RoutedClient":
        """A router with its own registry view of `service` (stopped by close())."""
        from kvhold.routing.registry_client import EtcdGateway

        router = cls(RegistryView(EtcdGateway.from_url(registry_url), service).start(), **kwargs)
        router._own_view = True
        return router

    def generate(self, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
                 **params) -> "RoutedStream":
        stream = RoutedStream(self, prompt, prompt_ids, routed_params(prompt, prompt_ids, params))
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
    def connection(self, entry: SidecarEntry) -> Conn:
        conn, stale = self.cached(entry)
        if stale is not None:
            stale.client.close()
        if conn is None:
            endpoint, curve = self.address(entry)
            conn = self.add(entry, _TrackedClient(endpoint, timeout=self.poll_s, context=self._ctx, **curve))
        return conn

    def check(self, conn: Conn) -> str:
        """Why `conn`'s sidecar is lost, or "" while it may still be alive (see module doc)."""
        if conn.lost:
            return conn.lost
        reason = self.loss_reason(conn, conn.client.disconnected())
        if reason:
            conn.client.close()
        return reason

    def submit(self, conn: Conn, prompt, prompt_ids, params: SamplingParams, prefix: list[int]) -> Stream:
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


class RoutedStream(StreamLog):
    """One request's tokens, whichever sidecars produce them; `result()` waits for the end."""

    def __init__(self, router: RoutedClient, prompt, prompt_ids, params: SamplingParams):
        super().__init__(prompt, prompt_ids, params)
        self.router = router
        self.pending: collections.deque = collections.deque()
        self._inner: Stream | None = None

    def __iter__(self):
        return self

    def __next__(self) -> TokenEvent:
        while not self.pending:
            if self.routed_result is not None:
                raise StopIteration
            self.step()
        return self.pending.popleft()

    @property
    def finished(self) -> bool:
        return self.routed_result is not None

    def result(self) -> RoutedResult:
        for _ in self:
            pass
        return self.routed_result

    def step(self) -> None:
        """Wait (at most about poll_s when the sidecar is silent) for progress: a token, the end,
        or a move to another sidecar."""
        st = self._inner._state
        if self.conn.lost and not st.pending and st.done is None and st.error is None:
            return self._place(self.conn.lost)     # lost while another stream was waiting
        try:
            event = next(self._inner)
        except StopIteration:
            return self.finish(self._inner.result())
        except SidecarUnavailable:
            reason = self.router.check(self.conn)
            if reason:
                self._place(reason)
            return
        self.pending.append(self.record(event.token_id, event.text, event.logprob, self._inner))

    def _place(self, reason: str) -> None:
        """Start (or continue, after `reason`) on the best sidecar; retry until move_timeout_s."""
        r = self.router
        old, lost_at = self.conn, time.monotonic()
        if old is not None:
            old.streams -= 1
            if self.all_sent:
                return self.finish(None, "length")
        skip: set[str] = set()
        while True:
            entry = r.pick(exclude=skip, fingerprint=self.fingerprint)
            if entry is not None:
                conn = r.connection(entry)
                self.reserve(r, conn)
                try:
                    self._inner = r.submit(conn, self.prompt, self.prompt_ids, self.params, self.token_ids)
                    break
                except (ShuttingDown, Overloaded, SidecarUnavailable) as exc:
                    self.reserve(r, conn, taken=False)
                    log.info("sidecar %s did not take the request: %s", entry.key, exc)
                    skip.add(entry.key)
                    continue
            error = r.move_deadline_passed(lost_at, reason)
            if error:
                raise SidecarUnavailable(error)
            skip.clear()
            time.sleep(0.05)
        self.placed(old, conn, reason, lost_at, self._inner._state.prompt_tokens)


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
