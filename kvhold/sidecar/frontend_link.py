"""The memory owner's end of the channel to a frontend process (kvhold.protocol.frontend_link).

With `--external-frontend` the sidecar serves no client: the frontend process
(kvhold.frontend.process) owns the client sockets, tokenizer, streams and the durable
journal's records. The sidecar keeps the memory, the supervisor, health and the request-death
rule, and through `FrontendLink`:
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
  to the durable journal and waits (at most JOURNAL_WAIT_S) for it to say it has.
The channel carries no client message: the sidecar decodes nothing a client sent.
"""
from __future__ import annotations

import logging
import os
import time

import zmq

from kvhold.protocol import frontend_link as fl, wire
from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import AdmitState
from kvhold.protocol.leases import now_ns

log = logging.getLogger(__name__)
JOURNAL_WAIT_S = 5.0
CONNECTED_NS = 1_000_000_000      # a frontend that said hello within this is connected


class FrontendLink:
    def __init__(self, sock: zmq.Socket, tables, *, wake, status, admissions):
        self.sock = sock
        self.tables = tables
        self.journal = Journal(tables)
        self._wake = wake                   # () -> None: Wake the active executor
        self._status = status               # () -> dict: the sidecar's status
        self._admissions = admissions       # (reopen) -> dict: the closures after the query
        self.identity: bytes | None = None
        self.frontend_pid = 0
        self.last_hello_ns = 0
        self.sessions = 0                   # frontends (or restarts of one) that said hello
        self.closed: dict[str, str] = {}
        self.failed: dict[int, tuple[int, str]] = {}    # request id -> (slot, message)
        self.journaled: int | None = None
        self.pool_restart: fl.PoolRestartAsked | None = None   # asked by the frontend, not yet done

    # ------------------------------------------------------------------ from the frontend
    def on_message(self, identity: bytes, frame: bytes) -> None:
        try:
            msg = wire.decode(frame, fl.TO_OWNER)
        except wire.WireError as exc:
            log.warning("bad message on the frontend link: %s", exc)
            return
        if isinstance(msg, fl.Hello):
            self._on_hello(identity, msg)
        elif isinstance(msg, fl.WakeExecutor):
            self._wake()
        elif isinstance(msg, fl.OwnerStatusQuery):
            self._send(fl.OwnerStatus(tag=msg.tag, status=self._status()), identity)
        elif isinstance(msg, fl.AdmissionsQuery):
            self._send(fl.AdmissionsAnswer(tag=msg.tag, closed=self._admissions(msg.reopen)), identity)
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
        identity = identity or self.identity
        if identity is None:
            return
        try:
            self.sock.send_multipart([identity, wire.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not send %s to the frontend: %s", msg.TYPE, exc)

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
            if self.journal.request_id_at(slot) != rid or \
                    int(self.tables.requests["admit_state"][slot]) == AdmitState.FREE:
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

    def journal_on_stop(self, timeout_s: float = JOURNAL_WAIT_S) -> int | None:
        """The executors are stopped: have the frontend journal what is in flight; its count,
        or None if no frontend answered in time (the requests' admission records are on disk:
        the next start recomputes their tokens)."""
        if self.identity is None:    # (its hellos waited while the executors stopped: not `connected`)
            log.warning("no frontend ever connected: in-flight requests keep their admission records only")
            return None
        self.journaled = None
        self._send(fl.ExecutorsStopped())
        deadline = time.monotonic() + timeout_s
        while self.journaled is None and time.monotonic() < deadline:
            if self.sock.poll(50):
                try:
                    ident, frame = self.sock.recv_multipart(zmq.NOBLOCK)
                except (zmq.Again, ValueError):
                    continue
                self.on_message(ident, frame)
        if self.journaled is None:
            log.warning("the frontend did not journal the in-flight requests within %.0f s", timeout_s)
        return self.journaled

    @property
    def connected(self) -> bool:
        return self.identity is not None and now_ns() - self.last_hello_ns < CONNECTED_NS

    def status(self) -> dict:
        self._prune_failed()
        return {"pid": self.frontend_pid or None, "connected": self.connected, "sessions": self.sessions,
                "last_hello_ms_ago": (now_ns() - self.last_hello_ns) / 1e6 if self.last_hello_ns else None,
                "failed_pending": len(self.failed)}

