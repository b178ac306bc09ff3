"""The memory owner's end of the channel to its frontend (kvhold.protocol.frontend_link).

The sidecar is the memory owner: memory, the supervisor, health and the request-death rule.
Everything client-facing (the client sockets, tokenizer, streams, the durable journal's
records) is its frontend's, and the owner speaks to it through one interface, `FrontendEnd`,
in typed messages (`fl.*`), whichever way they travel:
* `FrontendLink` (`kvhold sidecar --external-frontend`): a ROUTER socket the frontend
  process (`kvhold frontend`, kvhold.frontend.process) connects to; messages are encoded;
* `InprocFrontendLink` (`kvhold sidecar`): the same frontend running in the owner's
  process, on the owner's loop and thread (kvhold.frontend.inline); the messages are
  delivered by direct calls, nothing is encoded and no loop turn is added.
Through it the owner
* wakes the active executor when the frontend says there is new work;
* tells the frontend which slots a step committed tokens to (it streams from the journal,
  and pumps every stream 20 times a second anyway: a nudge lost while no frontend runs
  costs only latency);
* fails requests (kvhold.sidecar.request_deaths): each is kept while its slot still holds
  it, and every frontend that says hello is told of all of them, so a frontend that was
  down when a request was failed still ends its stream;
* holds the admission closures of health actions, sent on every change and in each hello
  reply;
* answers status and admissions queries;
* at a stop, once the executors are stopped, has the frontend write the in-flight requests
  to the durable journal and waits (at most JOURNAL_WAIT_S) for it to say it has; a pool
  restart is the frontend's to ask for (`PoolRestartAsked`).
The channel carries no client message: the owner decodes nothing a client sent.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Protocol

import zmq

from kvhold.protocol import frontend_link as fl, wire
from kvhold.protocol.journal import Journal
from kvhold.protocol.leases import now_ns
from kvhold.protocol.router_socket import bind_router, drain

log = logging.getLogger(__name__)
JOURNAL_WAIT_S = 5.0
CONNECTED_NS = 1_000_000_000      # a frontend that said hello within this is connected
NO_DEADLINE_NS = 1 << 62


class FrontendEnd(Protocol):
    """The memory owner's view of its frontend (kvhold.sidecar.daemon speaks to nothing else
    client-facing). What the owner sends: `committed`, `fail_request`, the admission closures,
    `journal_on_stop`; what it receives (hello, wake-ups, status and admissions queries, a pool
    restart asked) is handled by the end itself, with the callables it was made with."""

    KIND: str                       # the state file's "frontend": "external" or "inline"
    BINDS_CLIENT_SOCKET: bool       # the owner's process binds the client socket (stale files go)
    closed: dict[str, str]          # the owner's admission closures (health actions): who -> why
    pool_restart: fl.PoolRestartAsked | None     # asked by the frontend, not yet done
    on_admissions_query: Callable[[bool], dict]  # (reopen) -> the closures after the query

    def start(self, stack: contextlib.ExitStack, adopting: bool) -> None: ...   # before any executor
    def open(self, stack: contextlib.ExitStack, zctx: zmq.Context, loop) -> None: ...   # its sockets
    def on_events(self, events) -> None: ...          # a poll's events
    def tick(self, now: int) -> None: ...             # the end of each loop turn
    def next_deadline_ns(self) -> int: ...
    def committed(self, slots, recoveries: int = 0) -> None: ...
    def fail_request(self, request_id: int, slot: int, message: str) -> None: ...
    def close_admissions(self, by: str, reason: str) -> None: ...
    def open_admissions(self, by: str) -> None: ...
    def admissions_closed(self) -> bool: ...          # for the registry entry
    def in_flight(self) -> int: ...                   # for the registry entry
    def requests_adopted(self) -> int: ...            # with a re-adopted pool (the log line)
    def journal_on_stop(self, timeout_s: float = JOURNAL_WAIT_S) -> int | None: ...
    @property
    def restore_report(self) -> dict | None: ...     # the owner's re-admission, if it made one
    @property
    def client_tcp(self): ...                         # the client TCP endpoint in this process
    def status(self) -> dict: ...


class LinkEnd:
    """What both ends share: the messages from the frontend, the failed requests, the
    closures, the journaling at a stop. A subclass carries the messages (`_send`,
    `_await_journaled`)."""
    KIND = ""
    BINDS_CLIENT_SOCKET = False
    client_tcp = None

    def __init__(self, tables, *, wake, status, admissions=None):
        self.tables = tables
        self.journal = Journal(tables)
        self._wake = wake                   # () -> None: Wake the active executor
        self._status = status               # () -> dict: the sidecar's status
        # (reopen) -> dict: the closures after the query (the owner's health responder)
        self.on_admissions_query = admissions or (lambda reopen: dict(self.closed))
        self.identity: bytes | None = None
        self.frontend_pid = 0
        self.last_hello_ns = 0
        self.sessions = 0                   # frontends (or restarts of one) that said hello
        self.closed: dict[str, str] = {}
        self.failed: dict[int, tuple[int, str]] = {}    # request id -> (slot, message)
        self.journaled: int | None = None
        self.pool_restart: fl.PoolRestartAsked | None = None   # asked by the frontend, not yet done

    # ------------------------------------------------------------------ from the frontend
    def handle(self, identity: bytes, msg) -> None:
        if isinstance(msg, fl.WakeExecutor):
            self._wake()
        elif isinstance(msg, fl.Hello):
            self._on_hello(identity, msg)
        elif isinstance(msg, fl.OwnerStatusQuery):
            self._send(fl.OwnerStatus(tag=msg.tag, status=self._status()), identity)
        elif isinstance(msg, fl.AdmissionsQuery):
            self._send(fl.AdmissionsAnswer(tag=msg.tag, closed=self.on_admissions_query(msg.reopen)), identity)
        elif isinstance(msg, fl.InFlightJournaled):
            self.journaled = msg.requests
        elif isinstance(msg, fl.PoolRestartAsked):
            log.warning("pool restart asked by the frontend%s", " (then holding for the operator)" if msg.hold else "")
            self.pool_restart = msg

    def _on_hello(self, identity: bytes, msg: fl.Hello) -> None:
        self.last_hello_ns = now_ns()
        if identity == self.identity and msg.pid == self.frontend_pid:
            return                                           # a heartbeat
        self.identity, self.frontend_pid = identity, msg.pid
        self.sessions += 1
        log.info("frontend pid %d connected (session %d)", msg.pid, self.sessions)
        self._prune_failed()
        self._send(fl.OwnerHello(pid=os.getpid(), generation=self.tables.generation,
                                 tables=self.tables_name, closed=dict(self.closed),
                                 failed=[[rid, slot, text] for rid, (slot, text) in self.failed.items()]))
        self._wake()        # a wake-up sent while no sidecar ran is lost: look at the journal now

    tables_name = ""        # set by the sidecar

    # ------------------------------------------------------------------ to the frontend
    def _send(self, msg, identity: bytes | None = None) -> None:
        raise NotImplementedError

    def _await_journaled(self, timeout_s: float) -> None:
        """Until the frontend answers `ExecutorsStopped` (`journaled`), at most `timeout_s`."""

    def committed(self, slots, recoveries: int = 0) -> None:
        self._send(fl.Committed(slots=list(slots), recoveries=recoveries))

    def fail_request(self, request_id: int, slot: int, message: str) -> None:
        log.error("%s", message)
        self.journal.cancel(slot)     # at once: the next executor must not run it even if no frontend runs
        self._prune_failed()
        self.failed[request_id] = (slot, message)
        self._send(fl.FailRequest(request_id=request_id, slot=slot, message=message))

    def _prune_failed(self) -> None:
        """Forget failed requests whose slot the frontend has released."""
        for rid, (slot, _) in list(self.failed.items()):
            if self.journal.request_id_at(slot) != rid or self.journal.is_free(slot):
                del self.failed[rid]

    def close_admissions(self, by: str, reason: str) -> None:
        if by not in self.closed:
            log.warning("admissions closed by %s: %s", by, reason)
        self.closed[by] = reason
        self._send(fl.AdmissionsChanged(closed=dict(self.closed)))

    def open_admissions(self, by: str) -> None:
        if self.closed.pop(by, None) is not None:
            log.info("admissions reopened by %s", by)
            self._send(fl.AdmissionsChanged(closed=dict(self.closed)))

    def admissions_closed(self) -> bool:
        return bool(self.closed)

    def in_flight(self) -> int:
        return len(self.journal.live_slots())

    def requests_adopted(self) -> int:
        return len(self.journal.live_slots())

    def journal_on_stop(self, timeout_s: float = JOURNAL_WAIT_S) -> int | None:
        """The executors are stopped: have the frontend journal what is in flight; its count,
        or None if no frontend answered in time (the requests' admission records are on disk:
        the next start recomputes their tokens)."""
        if self.identity is None:    # (its hellos waited while the executors stopped: not `connected`)
            log.warning("no frontend ever connected: in-flight requests keep their admission records only")
            return None
        self.journaled = None
        self._send(fl.ExecutorsStopped())
        self._await_journaled(timeout_s)
        if self.journaled is None:
            log.warning("the frontend did not journal the in-flight requests within %.0f s", timeout_s)
        return self.journaled

    # ------------------------------------------------------------------ the owner's loop
    def on_events(self, events) -> None:
        pass

    def tick(self, now: int) -> None:
        pass

    def next_deadline_ns(self) -> int:
        return NO_DEADLINE_NS

    @property
    def restore_report(self) -> dict | None:
        return None

    @property
    def connected(self) -> bool:
        return self.identity is not None and now_ns() - self.last_hello_ns < CONNECTED_NS

    def status(self) -> dict:
        self._prune_failed()
        return {"pid": self.frontend_pid or None, "connected": self.connected, "sessions": self.sessions,
                "last_hello_ms_ago": (now_ns() - self.last_hello_ns) / 1e6 if self.last_hello_ns else None,
                "failed_pending": len(self.failed)}


class FrontendLink(LinkEnd):
    """The link to a frontend process (`--external-frontend`): a ROUTER in the runtime dir.
    `readmission` (kvhold.sidecar.readmit): the owner re-admits the durable journal's
    requests into a fresh pool; the frontend process adopts their streams."""
    KIND = "external"

    def __init__(self, tables, *, wake, status, readmission=None, paths=None, admissions=None):
        super().__init__(tables, wake=wake, status=status, admissions=admissions)
        self.readmission = readmission
        self.paths = paths
        self.sock: zmq.Socket | None = None

    def start(self, stack: contextlib.ExitStack, adopting: bool) -> None:
        """A pool adopted keeps its requests for the frontend as they are."""
        if not adopting and self.readmission is not None:
            self.readmission.restore()

    def open(self, stack: contextlib.ExitStack, zctx: zmq.Context, loop) -> None:
        self.sock = bind_router(zctx, fl.link_endpoint(self.paths), fl.link_socket(self.paths), stack)
        loop.register(self.sock)

    def on_events(self, events) -> None:
        if self.sock in events:
            drain(self.sock, self.on_message)

    def on_message(self, identity: bytes, frame: bytes) -> None:
        try:
            msg = wire.decode(frame, fl.TO_OWNER)
        except wire.WireError as exc:
            log.warning("bad message on the frontend link: %s", exc)
            return
        self.handle(identity, msg)

    def _send(self, msg, identity: bytes | None = None) -> None:
        identity = identity or self.identity
        if identity is None:
            return
        try:
            self.sock.send_multipart([identity, wire.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not send %s to the frontend: %s", msg.TYPE, exc)

    def _await_journaled(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.journaled is None and time.monotonic() < deadline:
            if self.sock.poll(50):
                try:
                    ident, frame = self.sock.recv_multipart(zmq.NOBLOCK)
                except (zmq.Again, ValueError):
                    continue
                self.on_message(ident, frame)

    @property
    def restore_report(self) -> dict | None:
        return self.readmission.report if self.readmission is not None else None


class InprocPeer(Protocol):
    """The frontend in the owner's process, as its in-process link end sees it
    (kvhold.frontend.process.FrontendProcess over an in-process owner port)."""
    tcp: object

    def deliver(self, msg) -> None: ...               # an owner -> frontend message, handled now
    def start_in_process(self, stack: contextlib.ExitStack, adopting: bool) -> None: ...
    def open_in_process(self, stack: contextlib.ExitStack, zctx: zmq.Context) -> None: ...
    def on_events(self, events) -> None: ...
    def after_events(self, now: int) -> None: ...
    def next_deadline_ns(self) -> int: ...
    def admissions_closed(self) -> bool: ...
    def in_flight(self) -> int: ...
    def requests_adopted(self) -> int: ...


class InprocFrontendLink(LinkEnd):
    """The link to the frontend in this process (`kvhold sidecar` without --external-frontend),
    on the owner's loop and thread: the owner's messages are the frontend's method calls and
    the frontend's the owner's (`handle`), the typed messages as they are, never encoded. The
    frontend's client sockets are on the owner's poller; each loop turn runs its work after
    the owner's (`tick`). A step's `Committed` streams its tokens within the owner's handling
    of the StepDone. The frontend cannot die without the owner: it needs no heartbeat, and the
    requests failed are failed there and then (the frontend cancels them in the journal)."""
    KIND = "inline"
    BINDS_CLIENT_SOCKET = True
    IDENTITY = b"inproc"

    def __init__(self, tables, *, wake, status, admissions=None):
        super().__init__(tables, wake=wake, status=status, admissions=admissions)
        self.peer: InprocPeer | None = None

    def start(self, stack: contextlib.ExitStack, adopting: bool) -> None:
        """The frontend's streams, and the durable journal's requests re-admitted (with a pool
        re-adopted, those not in its journal), before any executor runs."""
        self.peer.start_in_process(stack, adopting)

    def open(self, stack: contextlib.ExitStack, zctx: zmq.Context, loop) -> None:
        self.peer.open_in_process(stack, zctx)

    def on_events(self, events) -> None:
        self.peer.on_events(events)

    def tick(self, now: int) -> None:
        self.peer.after_events(now)

    def next_deadline_ns(self) -> int:
        return self.peer.next_deadline_ns()

    def _send(self, msg, identity: bytes | None = None) -> None:
        if self.peer is not None:
            self.peer.deliver(msg)

    def committed(self, slots, recoveries: int = 0) -> None:
        self.peer.deliver(fl.Committed(slots=slots, recoveries=recoveries))

    def fail_request(self, request_id: int, slot: int, message: str) -> None:
        self._send(fl.FailRequest(request_id=request_id, slot=slot, message=message))

    def close_admissions(self, by: str, reason: str) -> None:
        self.closed[by] = reason           # (the frontend logs it)
        self._send(fl.AdmissionsChanged(closed=dict(self.closed)))

    def open_admissions(self, by: str) -> None:
        if self.closed.pop(by, None) is not None:
            self._send(fl.AdmissionsChanged(closed=dict(self.closed)))

    def journal_on_stop(self, timeout_s: float = JOURNAL_WAIT_S) -> int | None:
        try:
            return super().journal_on_stop(timeout_s)
        except Exception:
            log.exception("could not journal the in-flight requests")
            return None

    def admissions_closed(self) -> bool:
        return self.peer.admissions_closed()

    def in_flight(self) -> int:
        return self.peer.in_flight()

    def requests_adopted(self) -> int:
        return self.peer.requests_adopted()

    @property
    def client_tcp(self):
        return self.peer.tcp

    @property
    def connected(self) -> bool:
        return self.identity is not None
