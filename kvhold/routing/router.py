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

from kvhold.client.client import Client, Stream, TokenEvent
from kvhold.protocol.errors import SidecarUnavailable
from kvhold.protocol.sampling import RequestInput
from kvhold.routing.registry_client import RegistryView, SidecarEntry
from kvhold.routing.routing import REFUSALS, Conn, RoutedResult, RouterCore, StreamLog

__all__ = ["RoutedClient", "RoutedStream", "RoutedResult", "wait_all"]
log = logging.getLogger(__name__)


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
        # checked before any sidecar sees it
        return self.submit(RequestInput.check(prompt, prompt_ids, None, params))

    def submit(self, request: RequestInput) -> "RoutedStream":
        """Route a checked request (kvhold.protocol.sampling.RequestInput; a seed is chosen here
        when it has none)."""
        stream = RoutedStream(self, request)
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
            # streams move elsewhere when the connection drops: no resume on a reconnect
            conn = self.add(entry, Client(endpoint, timeout=self.poll_s, context=self._ctx,
                                          resume_on_reconnect=False, **curve))
        return conn

    def check(self, conn: Conn) -> str:
        """Why `conn`'s sidecar is lost, or "" while it may still be alive (see module doc)."""
        if conn.lost:
            return conn.lost
        reason = self.loss_reason(conn, conn.client.disconnects() > 0)
        if reason:
            conn.client.close()
        return reason

    def send(self, conn: Conn, request: RequestInput) -> Stream:
        """Generate on `conn`; raises SidecarUnavailable when it is lost meanwhile or silent."""
        deadline = time.monotonic() + self.submit_timeout_s

        def on_silence() -> None:
            reason = self.check(conn)
            if reason or time.monotonic() > deadline:
                raise SidecarUnavailable(f"{conn.entry.key}: {reason or 'no reply'}")
        return conn.client.submit(request, on_silence=on_silence)


class RoutedStream(StreamLog):
    """One request's tokens, whichever sidecars produce them; `result()` waits for the end."""

    def __init__(self, router: RoutedClient, request: RequestInput):
        super().__init__(request)
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
        if self.stranded(self._inner):
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
        if self.leave():
            return
        skip: set[str] = set()
        while True:
            entry = r.pick(exclude=skip, fingerprint=self.fingerprint)
            if entry is not None:
                conn = r.connection(entry)
                self.reserve(r, conn)
                try:
                    self._inner = r.send(conn, self.continuation())
                    break
                except REFUSALS as exc:
                    self.refused(r, conn, exc, skip)
                    continue
            self.round_over(r, lost_at, reason, skip)
            time.sleep(0.05)
        self.placed(old, conn, reason, lost_at, self._inner.prompt_tokens)


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
