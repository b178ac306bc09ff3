"""AsyncRoutedClient: kvhold.routing.router's routing and moves, for asyncio programs (the HTTP router).

    view = RegistryView(EtcdGateway.from_url("etcd://10.0.0.5:2379"), "prod").start()
    async with AsyncRoutedClient(view) as router:
        stream = await router.generate("Once upon a time", max_tokens=64, seed=1)
        async for event in stream:        # TokenEvent; indices continue across moves
            print(event.text, end="")
        result = await stream.result()    # RoutedResult, with `moves` and `sidecars`

Same rules as kvhold.routing.router (picking, when a sidecar is lost, what a move carries; see its
module doc and kvhold.routing.routing), on kvhold.client.aclient.AsyncClient: one client per sidecar, shared
by every coroutine of one event loop. The registry view runs in its own thread; its
reads are lock-protected snapshots, and its change callback only wakes this loop
(call_soon_threadsafe), so a request waiting for a sidecar goes as soon as one appears.
`routed` and `moved` count placements per sidecar key and moves per sidecar lost.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvhold.protocol import messages as m, wire
from kvhold.client.aclient import AsyncClient, AsyncStream
from kvhold.client.client import TokenEvent
from kvhold.protocol.errors import KvholdError, Overloaded, ShuttingDown, SidecarUnavailable
from kvhold.protocol.sampling import SamplingParams
from kvhold.routing.registry_client import RegistryView, SidecarEntry
from kvhold.routing.routing import Conn, RoutedResult, RouterCore, StreamLog, routed_params

__all__ = ["AsyncRoutedClient", "AsyncRoutedStream", "RoutedResult"]
log = logging.getLogger(__name__)


class _TrackedAsyncClient(AsyncClient):
    """An AsyncClient that can tell whether its connection dropped (a socket monitor)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, resume_on_reconnect=False, **kwargs)   # this monitor is the router's
        self.monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    @property
    def last_heard(self) -> float:
        return self._last_rx

    async def disconnected(self) -> bool:
        try:
            while True:
                frames = await self.monitor.recv_multipart(zmq.NOBLOCK)
                if parse_monitor_message(frames)["event"] == zmq.EVENT_DISCONNECTED:
                    return True
        except zmq.Again:
            return False

    async def close(self) -> None:
        self.monitor.close(0)
        await super().close()


class AsyncRoutedClient(RouterCore):
    def __init__(self, view: RegistryView, **kwargs):
        if "curve_secret_key_file" in kwargs and kwargs["curve_secret_key_file"] is not None:
            raise ValueError("the asyncio router does not speak CurveZMQ yet; use ipc:// or plain tcp://")
        super().__init__(view, **kwargs)
        self._ctx = zmq.asyncio.Context()
        self._ids = itertools.count(1)
        self._changed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._chained = None
        self.moved: collections.Counter = collections.Counter()

    async def generate(self, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
                       **params) -> "AsyncRoutedStream":
        self._watch()
        stream = AsyncRoutedStream(self, next(self._ids), prompt, prompt_ids,
                                   routed_params(prompt, prompt_ids, params))
        await stream._place(reason="")
        return stream

    def serving(self) -> list[SidecarEntry]:
        """The registered sidecars a request could go to now."""
        return [e for e in self.view.entries() if e.serving and e.key not in self._lost]

    async def close(self) -> None:
        if self._loop is not None:
            self.view.on_change = self._chained
        for conn in list(self._conns.values()):
            await conn.client.close()
        self._conns.clear()
        self._ctx.term()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    # ------------------------------------------------------------------ registry bridge
    def _watch(self) -> None:
        """Wake this loop on registry changes (the view calls back on its own thread)."""
        if self._loop is not None:
            return
        self._loop, self._changed = asyncio.get_running_loop(), asyncio.Event()
        self._chained = self.view.on_change

        def on_change(entries):
            if self._chained is not None:
                self._chained(entries)
            try:
                self._loop.call_soon_threadsafe(self._changed.set)
            except RuntimeError:     # the loop is closed: nobody waits any more
                pass
        self.view.on_change = on_change

    async def wait_change(self, timeout: float) -> None:
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    # ------------------------------------------------------------------ sidecars
    async def connection(self, entry: SidecarEntry) -> Conn:
        conn, stale = self.cached(entry)
        if stale is not None:
            await stale.client.close()
        if conn is None:
            endpoint, curve = self.address(entry)
            if curve:     # skipped by _place, like a sidecar that refuses
                raise SidecarUnavailable(f"{entry.key} speaks CurveZMQ: not in the asyncio SDK yet")
            conn = self.add(entry, _TrackedAsyncClient(endpoint, timeout=self.poll_s, context=self._ctx))
        return conn

    async def check(self, conn: Conn) -> str:
        """Why `conn`'s sidecar is lost, or "" while it may still be alive."""
        if conn.lost:
            return conn.lost
        disconnected = await conn.client.disconnected()
        if conn.lost:                 # another coroutine decided meanwhile
            return conn.lost
        reason = self.loss_reason(conn, disconnected)
        if reason:
            self.moved[conn.entry.key] += conn.streams
            await conn.client.close()
        return reason

    async def submit(self, conn: Conn, prompt, prompt_ids, params: SamplingParams, prefix: list[int]) -> AsyncStream:
        """Generate on `conn` (one Generate, however long the wait); SidecarUnavailable when it
        is lost meanwhile or gives no reply within submit_timeout_s."""
        client = conn.client
        client._ensure_receiver()
        tag = next(client._tags)
        fut = asyncio.get_running_loop().create_future()
        client._replies[tag] = fut
        try:
            client._sock.send(wire.encode(m.Generate(tag=tag, params=params, prompt=prompt, prompt_ids=prompt_ids,
                                                     prefix_generated=list(prefix) or None)), zmq.NOBLOCK)
            deadline = time.monotonic() + self.submit_timeout_s
            while True:
                try:
                    _, state = await client._wait(asyncio.shield(fut))     # (Accepted, its stream)
                    break
                except SidecarUnavailable:
                    reason = await self.check(conn)
                    if reason or time.monotonic() > deadline:
                        raise SidecarUnavailable(f"{conn.entry.key}: {reason or 'no reply'}") from None
        except zmq.Again:
            raise SidecarUnavailable(f"cannot queue a message to {conn.entry.key}") from None
        finally:
            client._replies.pop(tag, None)
        return AsyncStream(client, state)


class AsyncRoutedStream(StreamLog):
    """Async iterator over one request's tokens, whichever sidecars produce them."""

    def __init__(self, router: AsyncRoutedClient, request_id: int, prompt, prompt_ids, params: SamplingParams):
        super().__init__(prompt, prompt_ids, params)
        self.router = router
        self.request_id = request_id          # this router's, not a sidecar's
        self.pending: collections.deque = collections.deque()
        self._inner: AsyncStream | None = None

    @property
    def finished(self) -> bool:
        return self.routed_result is not None

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        while not self.pending:
            if self.routed_result is not None:
                raise StopAsyncIteration
            await self.step()
        return self.pending.popleft()

    async def result(self) -> RoutedResult:
        async for _ in self:
            pass
        return self.routed_result

    async def cancel(self) -> None:
        """Stop the request; the stream ends (finish_reason 'cancelled') with what it has."""
        if self.finished:
            return
        conn = self.conn
        try:
            await self._inner.cancel()
        except KvholdError:
            pass                      # its sidecar is gone: nothing runs there any more
        self.finish(None, "cancelled")
        conn.streams -= 1

    async def step(self) -> None:
        """Wait (about poll_s at most while the sidecar is silent) for a token, the end or a move."""
        st = self._inner._state
        if self.conn.lost and not st.pending and not st.finished:
            return await self._place(self.conn.lost)   # lost while another stream was waiting
        try:
            event = await self._inner.__anext__()
        except StopAsyncIteration:
            return self.finish(await self._inner.result())
        except SidecarUnavailable:
            reason = await self.router.check(self.conn)
            if reason:
                await self._place(reason)
            return
        self.pending.append(self.record(event.token_id, event.text, event.logprob, self._inner))

    async def _place(self, reason: str) -> None:
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
                try:
                    conn = await r.connection(entry)
                except SidecarUnavailable as exc:
                    log.info("sidecar %s skipped: %s", entry.key, exc)
                    skip.add(entry.key)
                    continue
                self.reserve(r, conn)
                try:
                    self._inner = await r.submit(conn, self.prompt, self.prompt_ids, self.params, self.token_ids)
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
            await r.wait_change(0.05)
        self.placed(old, conn, reason, lost_at, self._inner.prompt_tokens)
