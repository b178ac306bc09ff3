"""The frontend process (`kvhold frontend`): everything client-facing, apart from the memory.

It runs beside a memory owner started with `kvhold sidecar --external-frontend` for the same
instance and flags, and owns what the owner does not: the client sockets (ipc, and TCP with
--client-tcp) and the clients' identities (kvhold.frontend.client_peers), admission and the
tokenizer (kvhold.frontend.frontend, admission), detokenization and the token streams, the
durable journal's records (kvhold.sidecar.durable_journal), the streams of restored requests
and the results nobody claimed yet (kvhold.frontend.restore). It maps the tables by name: it
writes the journal's admission half, reads the committed tokens and releases finished
slots, as the in-process frontend does. Everything else goes over the link to the owner
(kvhold.protocol.frontend_link): wake-ups for the executor, the owner's nudges after a
step, requests it failed, admission closures of health actions, status.

It can die at any moment without touching memory or executors: the executors go on
committing to the journal. A new frontend process
1. says hello until the owner answers with its pool (generation, tables name);
2. maps the tables and adopts a stream for each request in the shm journal from the durable
   journal's records (`Restore.restore(adopting=True, readmit=False)`), silent until its
   client resumes: the SDK, after a silence, sends Resume(next index) and gets the rest;
   a request that ended meanwhile has its result kept for pickup;
3. ends the streams of the requests the owner failed meanwhile, then binds the client
   sockets.
An owner that restarts and re-adopts the pool is greeted by the next hello; one that made a
new pool (another generation: a pool restart, or a pool it could not adopt) makes this
process re-execute itself (same pid, same arguments) to serve the new pool; should the exec
fail it exits, and `kvhold serve` starts a frontend again. SIGTERM refuses what is not yet
acknowledged and stops; at the owner's stop, once its executors are stopped, the frontend
writes the in-flight requests with their committed tokens to the durable journal.
A pool restart (`kvhold pool-restart`, local socket only) is the frontend's to take: it
closes admissions, tells its clients (`Restarting`) and asks the owner, which stops its
executors; the frontend then journals every in-flight request with its drain record (and
the hold file), the owner re-executes into the next generation and re-admits them into the
new tables, and the re-executed frontend adopts their streams for their clients to resume.

The same class is the frontend of `kvhold sidecar` without --external-frontend
(kvhold.frontend.inline): there it runs in the owner's process, on the owner's loop and
thread, and its `OwnerPort` is a direct call into the owner's in-process link end
(kvhold.sidecar.frontend_link.InprocFrontendLink), which calls `deliver` with the owner's
messages: the same typed messages, never encoded, handled at once (a step's `Committed`
streams its tokens within the owner's handling of the step). It then shares the owner's
tables, durable journal, recovery timeline and checkpoint description, needs no hello
after the first, re-admits the durable journal's requests itself (those not in a
re-adopted pool's journal too: `Restore.restore(adopting, readmit=True)`), and ends with
the owner: it refuses what is not acknowledged before it journals what is in flight.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import itertools
import logging
import os
import sys
from typing import Protocol

import zmq

from kvhold.protocol import frontend_link as fl, messages as m, wire
from kvhold.protocol.checkpoint import build_manifest
from kvhold.protocol.errors import ErrorCode
from kvhold.protocol.leases import now_ns
from kvhold.protocol.model_spec import ModelSpec
from kvhold.protocol.naming import http_routing_id
from kvhold.protocol.page_table import PageTable
from kvhold.protocol.settings import UNSUPPORTED_SAMPLING
from kvhold.protocol.tables import Tables
from kvhold.frontend.client_side import ClientSide
from kvhold.sidecar.config import SidecarConfig
from kvhold.sidecar.durable_journal import DurableJournal
from kvhold.sidecar.event_loop import EventLoop
from kvhold.frontend.frontend import Frontend
from kvhold.sidecar.pool_restart import PoolRestart, journal_in_flight, reexec
from kvhold.frontend.restore import Restore
from kvhold.sidecar.stats_log import StatsLog
from kvhold.sidecar.timeline import RecoveryTimeline

log = logging.getLogger(__name__)
QUERY_TIMEOUT_NS = 2_000_000_000     # an owner that does not answer a status query in this: left out
OWNER_WAIT_LOG_S = 10.0
NO_HELLO_NS = 1 << 62


class OwnerPort(Protocol):
    """How the frontend speaks to its memory owner: `send` a frontend -> owner message; `recv`
    the next owner -> frontend one (None: none now), `poll` for one. An owner in this process
    calls `FrontendProcess.deliver` instead, and its port has no socket."""
    sock: zmq.Socket | None
    heartbeat: bool            # say hello every HELLO_INTERVAL_S (the owner's sign of a live frontend)

    def send(self, msg) -> None: ...
    def recv(self): ...
    def poll(self, timeout_ms: int) -> bool: ...


class DealerPort:
    """The link to an owner process: a DEALER on its ROUTER (kvhold.protocol.frontend_link)."""
    heartbeat = True

    def __init__(self, zctx: zmq.Context, paths, stack: contextlib.ExitStack):
        self.sock = zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 50)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 200)
        stack.callback(self.sock.close, 0)
        self.sock.connect(fl.link_endpoint(paths))

    def send(self, msg) -> None:
        try:
            self.sock.send(wire.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass              # no sidecar connected: the next hello finds it

    def recv(self):
        try:
            return wire.decode(self.sock.recv(zmq.NOBLOCK), fl.TO_FRONTEND)
        except zmq.Again:
            return None
        except wire.WireError as exc:
            log.warning("bad message from the sidecar: %s", exc)
            return None

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms))


class InprocPort:
    """The link to the owner in this process: a message is its link end's `handle` call
    (kvhold.sidecar.frontend_link.InprocFrontendLink); its answers come to `deliver`."""
    sock = None
    heartbeat = False          # the frontend lives and dies with its owner

    def __init__(self, owner_end):
        self.owner_end = owner_end

    def send(self, msg) -> None:
        self.owner_end.handle(self.owner_end.IDENTITY, msg)

    def recv(self):
        return None

    def poll(self, timeout_ms: int) -> bool:
        return False


@dataclasses.dataclass
class OwnerShared:
    """What a frontend in the owner's process takes from the owner rather than making its own:
    its loop (one poll loop, one thread), the tables it made, the durable journal, the recovery
    timeline (the first resumed token's mark), the checkpoint's description and fingerprint
    (read ahead by a spare) and when it started."""
    loop: EventLoop
    tables: Tables
    durable: DurableJournal
    timeline: RecoveryTimeline
    spec: ModelSpec | None
    fingerprint: str
    started_ns: int


class FrontendProcess(ClientSide):
    def __init__(self, config: SidecarConfig, owner: OwnerPort | None = None, shared: OwnerShared | None = None):
        """`owner` and `shared`: the frontend of an owner in this process (kvhold.frontend.inline);
        by default the frontend process, with a DEALER to the owner's link."""
        self.config = config
        self.paths = config.paths
        self.owner = owner
        self.shared = shared
        self.started_ns = shared.started_ns if shared is not None else now_ns()
        self._stack = contextlib.ExitStack()
        self._inbox: collections.deque = collections.deque()   # owner messages before it serves
        self._serving = False
        self._pending_finished = False
        self.owner_pid = 0
        self.owner_closed: dict[str, str] = {}
        self._tags = itertools.count(1)
        self._queries: dict[int, tuple] = {}   # link tag -> (kind, client key, client tag, deadline)
        self._next_hello_ns = 0
        self.exit_code = 0

    # ------------------------------------------------------------------ start-up
    def start(self) -> "FrontendProcess":
        os.umask(0o077)
        with contextlib.ExitStack() as stack:
            self._start(stack)
            self._stack = stack.pop_all()
        return self

    def _start(self, stack: contextlib.ExitStack) -> None:
        self._lock(stack)
        self.loop = EventLoop()
        stack.callback(self.loop.close)
        self.zctx = zmq.Context()
        stack.callback(self.zctx.term)
        self.owner = DealerPort(self.zctx, self.paths, stack)
        hello = self._wait_for_owner()
        # the pool's requests, with the records of their admission: streams until their clients resume
        self._serve_pool(stack, hello, adopting=True, readmit=False)
        self._open_client_sockets(stack)
        self.loop.register(self.owner.sock)
        log.info("frontend for sidecar %r (pid %d, generation %d) serving on %s: %d streams adopted",
                 self.paths.instance, self.owner_pid, self.generation, self.paths.client_endpoint,
                 len(self.frontend.streams))

    def start_in_process(self, stack: contextlib.ExitStack, adopting: bool) -> None:
        """In the owner's process, on its `stack`, before any executor runs: the streams of the
        requests in the pool's journal (`adopting`: a dead sidecar's, re-adopted) and the durable
        journal's requests re-admitted into it."""
        self.loop = self.shared.loop
        self._serve_pool(stack, self._wait_for_owner(), adopting=adopting, readmit=True)

    def open_in_process(self, stack: contextlib.ExitStack, zctx: zmq.Context) -> None:
        """The client sockets, on the owner's ZeroMQ context and poller."""
        self.zctx = zctx
        self._open_client_sockets(stack)

    def _serve_pool(self, stack: contextlib.ExitStack, hello: fl.OwnerHello, *, adopting: bool,
                    readmit: bool) -> None:
        cfg, shared = self.config, self.shared
        self.owner_pid = hello.pid
        if shared is not None:
            self.tables = shared.tables
        else:
            self.tables = Tables.attach_name(hello.tables)
            stack.callback(self.tables.close)
        self.generation = self.tables.generation
        if self.generation != hello.generation:
            raise RuntimeError(f"the tables {hello.tables} are of generation {self.generation}, "
                               f"the sidecar's pool of {hello.generation}")
        if shared is not None:
            self.spec, fingerprint, self.durable = shared.spec, shared.fingerprint, shared.durable
        else:
            self.spec = ModelSpec.from_dir(cfg.pool.model) if cfg.pool.model is not None else None
            fingerprint = build_manifest(cfg.pool.model, self.spec).fingerprint if self.spec else ""
            self.durable = DurableJournal(cfg.journal_path)
        self.frontend = Frontend(self.tables, self.spec, cfg.pool.model,
                                 runs_model=cfg.executors.workload in ("engine", "vllm", "trtllm"), durable=self.durable,
                                 fingerprint=fingerprint,
                                 timeline=shared.timeline if shared is not None else RecoveryTimeline(),
                                 host=self, max_prompt_bytes=cfg.pool.max_prompt_bytes,
                                 unsupported=UNSUPPORTED_SAMPLING.get(cfg.executors.workload, ()),
                                 prefix_caching=cfg.uses_prefix_caching(), seed=cfg.pool.seed)
        stack.callback(self._finish_pending)
        self.restore = Restore(self.frontend, self.durable, fingerprint=fingerprint,
                               vocab_size=self.spec.vocab_size if self.spec else 0,
                               generation=self.generation, started_ns=self.started_ns,
                               send_client=self.send_client, unclaimed_cancel_s=cfg.journal.unclaimed_cancel_s)
        self.frontend.restored = self.restore
        self.frontend.add_handler(m.Resume, self.restore.on_resume)
        self.frontend.add_handler(m.Status, self._on_status)
        self.frontend.add_handler(m.Admissions, self._on_admissions)
        self.pool_restart = PoolRestart(self.frontend, self.durable, self.paths, generation=self.generation,
                                        send_client=self.send_client)
        self.frontend.add_handler(m.PoolRestart, self.pool_restart.on_request)
        self.restore.restore(adopting=adopting, readmit=readmit)
        self.stats_log = StatsLog(cfg.logs.stats_interval_s)
        self.recoveries_total = 0       # takeovers since this frontend started (the owner counts them)
        # the owner's count at its last Committed (an owner in this process started with this frontend)
        self._owner_recoveries: int | None = 0 if shared is not None else None
        self._on_owner_hello(hello)
        self._serving = True
        for msg in list(self._inbox):   # what the owner said meanwhile
            self._on_owner_message(msg)
        self._inbox.clear()

    def _lock(self, stack: contextlib.ExitStack) -> None:
        """One frontend per instance: a second start is refused while the first holds the lock."""
        self.paths.runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.paths.runtime_dir / "frontend.lock", os.O_RDWR | os.O_CREAT, 0o600)
        stack.callback(os.close, fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"a frontend of instance {self.paths.instance!r} is running already") from None

    def _wait_for_owner(self) -> fl.OwnerHello:
        """Say hello until the memory owner answers with its pool."""
        waited = 0.0
        while not self.loop.stop_requested:
            self._send_owner(fl.Hello(pid=os.getpid()))
            if self._inbox or self.owner.poll(int(fl.HELLO_INTERVAL_S * 1000)):
                msg = self._recv_owner()
                if isinstance(msg, fl.OwnerHello):
                    return msg
            waited += fl.HELLO_INTERVAL_S
            if waited >= OWNER_WAIT_LOG_S:
                log.warning("waiting for the sidecar of instance %r (its link %s)", self.paths.instance,
                            fl.link_socket(self.paths))
                waited = 0.0
        raise SystemExit(0)

    # ------------------------------------------------------------------ the link
    def _send_owner(self, msg) -> None:
        self.owner.send(msg)

    def _recv_owner(self):
        return self._inbox.popleft() if self._inbox else self.owner.recv()

    def _on_link(self) -> None:
        for _ in range(256):
            msg = self._recv_owner()
            if msg is None:
                return
            self._on_owner_message(msg)

    def deliver(self, msg) -> None:
        """An owner message by a direct call (the owner in this process): handled now, or, while
        this frontend is not serving yet, once it is."""
        if self._serving:
            handler = self._link_handlers.get(type(msg))
            if handler is not None:
                handler(self, msg)
        else:
            self._inbox.append(msg)

    def _on_owner_message(self, msg) -> None:
        handler = self._link_handlers.get(type(msg))
        if handler is not None:
            handler(self, msg)

    def _on_owner_hello(self, msg: fl.OwnerHello) -> None:
        if msg.generation != self.generation:
            log.error("the sidecar (pid %d) serves a new pool (generation %d, this frontend's %d): "
                      "exiting so that a frontend over it starts", msg.pid, msg.generation, self.generation)
            self.exit_code = fl.EXIT_POOL_GONE
            self.loop.stop_requested = True
            return
        if msg.pid != self.owner_pid:
            log.info("connected to the sidecar pid %d (generation %d)", msg.pid, msg.generation)
            if self.owner_pid:          # its spare re-adopted the pool: a drain under way is off
                self.pool_restart.owner_died(self.owner_pid, msg.pid)
        self.owner_pid = msg.pid
        self._on_admissions_changed(fl.AdmissionsChanged(closed=msg.closed))
        for rid, slot, text in msg.failed:
            self._on_fail(fl.FailRequest(request_id=int(rid), slot=int(slot), message=str(text)))
        self.frontend._wake_executor()

    def _on_admissions_changed(self, msg: fl.AdmissionsChanged) -> None:
        fe = self.frontend
        for by in set(self.owner_closed) - set(msg.closed):
            fe.open_admissions(by)
        for by, reason in msg.closed.items():
            fe.close_admissions(by, reason)
        self.owner_closed = dict(msg.closed)

    def _on_fail(self, msg: fl.FailRequest) -> None:
        st = self.frontend.streams.get(msg.request_id)
        if st is not None and st.failed:
            return                                  # told already (a hello repeats the list)
        if st is not None and st.awaiting_resume:   # an adopted stream: its client hears it on resuming
            self.restore.failed_requests[msg.request_id] = (st.identity, msg.message)
            while len(self.restore.failed_requests) > 4096:
                del self.restore.failed_requests[next(iter(self.restore.failed_requests))]
        self.frontend.fail_request(msg.request_id, msg.slot, msg.message)

    def _on_executors_stopped(self, msg: fl.ExecutorsStopped) -> None:
        """The sidecar stops: its executors are stopped, the shm journal is still. A frontend in
        its process stops with it: what is not acknowledged yet is refused first."""
        if self.shared is not None:
            self._finish_pending()
        self.frontend.close_admissions("stop", "the sidecar is stopping")
        if self.pool_restart.draining:      # its drain's record and hold file, as the sidecar's own
            self.pool_restart.finish_drain()
            self._send_owner(fl.InFlightJournaled(requests=self.pool_restart.report["requests_journaled"]))
            return
        n = journal_in_flight(self.frontend, self.durable)
        if n:
            log.warning("%d in-flight requests journaled to %s for the next start", n, self.durable.dir)
        self._send_owner(fl.InFlightJournaled(requests=n))

    def _on_answer(self, msg) -> None:
        query = self._queries.pop(msg.tag, None)
        if query is None:
            return
        kind, key, tag, _ = query
        if kind == "status":
            self.send_client(key, m.StatusReply(tag=tag, status=self._merged_status(msg.status)))
        else:
            self.send_client(key, m.AdmissionsReply(tag=tag, open=not self.frontend.closed,
                                                    closed_by=dict(self.frontend.closed)))

    def _on_committed(self, msg: fl.Committed) -> None:
        self.frontend.on_committed(msg.slots)
        # the owner's count of takeovers, for the stats line; a restarted owner counts from 0
        seen = self._owner_recoveries
        if seen is not None:        # the first message gives the count this frontend starts from
            self.recoveries_total += msg.recoveries - seen if msg.recoveries >= seen else msg.recoveries
        self._owner_recoveries = msg.recoveries

    _link_handlers = {
        fl.OwnerHello: _on_owner_hello,
        fl.Committed: lambda self, msg: self._on_committed(msg),
        fl.FailRequest: _on_fail,
        fl.AdmissionsChanged: _on_admissions_changed,
        fl.ExecutorsStopped: _on_executors_stopped,
        fl.OwnerStatus: _on_answer,
        fl.AdmissionsAnswer: lambda self, msg: (self._on_admissions_changed(fl.AdmissionsChanged(
            closed=msg.closed)), self._on_answer(msg)),
    }

    # ------------------------------------------------------------------ FrontendHost
    def wake_executor(self) -> None:
        self._send_owner(fl.WakeExecutor())

    def post(self, callback) -> None:
        self.loop.post(callback)

    def status(self) -> dict:
        return self._merged_status(None)

    # ------------------------------------------------------------------ client requests it relays
    def _query(self, kind: str, key: bytes, tag: int, msg_for_owner) -> None:
        self._queries[msg_for_owner.tag] = (kind, key, tag, now_ns() + QUERY_TIMEOUT_NS)
        self._send_owner(msg_for_owner)

    def _on_status(self, key: bytes, msg: m.Status):
        self._query("status", key, msg.tag, fl.OwnerStatusQuery(tag=next(self._tags)))
        return None

    def _on_admissions(self, key: bytes, msg: m.Admissions):
        if key[:1] != b"u":
            return m.Error(code=ErrorCode.UNAUTHORIZED, tag=msg.tag,
                           message="admissions are managed only on the local ipc socket")
        self._query("admissions", key, msg.tag, fl.AdmissionsQuery(tag=next(self._tags), reopen=msg.reopen))
        return None

    def _expire_queries(self, now: int) -> None:
        for link_tag, (kind, key, tag, deadline) in list(self._queries.items()):
            if now < deadline:
                continue
            del self._queries[link_tag]
            if kind == "status":       # the frontend's part alone: the sidecar does not answer
                self.send_client(key, m.StatusReply(tag=tag, status=self._merged_status(None)))
            else:
                self.send_client(key, m.Error(code=ErrorCode.UNAVAILABLE, tag=tag,
                                              message="the sidecar did not answer"))

    def _merged_status(self, owner: dict | None) -> dict:
        """The owner's status with the frontend's part (requests, admissions, streams, clients);
        `frontend` names this process when it is not the owner's."""
        fe = self.frontend.status()
        fe.pop("recoveries")          # the owner's timeline has them
        pool_restart = self.restore.status()
        owner_restore = ((owner or {}).get("memory_owner") or {}).get("restore")
        if owner_restore:             # the owner re-admitted them, this process adopted their streams
            mine = pool_restart["restore"]
            pool_restart["restore"] = {**{k: v for k, v in owner_restore.items() if k != "previous_drain"},
                                       **{k: mine[k] for k in ("requests_adopted", "first_token_ns") if k in mine}}
            pool_restart["previous_drain"] = pool_restart["previous_drain"] or owner_restore.get("previous_drain")
        merged = {**(owner or {"instance": self.paths.instance, "pid": self.owner_pid or None,
                               "generation": self.generation, "uptime_s": (now_ns() - self.started_ns) / 1e9,
                               "executors": [], "events": [], "recoveries": [], "memory_owner": None}),
                  **fe, "client_tcp": self.tcp.status() if self.tcp else None,
                  "client_peers": {**self.peers.status(),
                                   "http_server": self.peers.held_by(http_routing_id(self.paths.instance))},
                  "pool_restart": {**pool_restart, "interrupted": self.pool_restart.interrupted}}
        if self.shared is None:
            merged["frontend"] = {"pid": os.getpid(), "uptime_s": (now_ns() - self.started_ns) / 1e9,
                                  "owner_pid": self.owner_pid, "owner_answered": owner is not None,
                                  "generation": self.generation, "loop": self.loop.stats()}
        return merged

    # ------------------------------------------------------------------ its owner's view (in process)
    def admissions_closed(self) -> bool:
        return bool(self.frontend.closed)

    def in_flight(self) -> int:
        return len(self.frontend.streams)

    def requests_adopted(self) -> int:
        return self.restore.report.get("requests_adopted", 0)

    def _finish_pending(self) -> None:
        if not self._pending_finished:
            self._pending_finished = True
            self.frontend.finish_pending()

    # ------------------------------------------------------------------ loop
    def serve_forever(self) -> int:
        while not self.loop.stop_requested:
            self.run_once()
        return self.exit_code

    def run_once(self) -> None:
        now = now_ns()
        events = self.loop.poll(min(max(0, -(-(self.next_deadline_ns() - now) // 1_000_000)), 1000))
        self.on_events(events)
        self.after_events(now_ns())
        self.loop.turn_ended()

    def next_deadline_ns(self) -> int:
        return min(self.frontend.next_deadline_ns(), self._next_hello_ns if self.owner.heartbeat else NO_HELLO_NS)

    def on_events(self, events) -> None:
        """A poll's events: the owner's messages, the clients'."""
        if self.owner.sock is not None and self.owner.sock in events:
            self._on_link()
        self._on_client_events(events)

    def after_events(self, now: int) -> None:
        """The rest of a loop turn (in the owner's process: after the owner's part of it)."""
        if self.owner.heartbeat and now >= self._next_hello_ns:   # the owner's liveness is its answer; this is ours
            self._send_owner(fl.Hello(pid=os.getpid(), generation=self.generation))
            self._next_hello_ns = now + int(fl.HELLO_INTERVAL_S * 1e9)
        self.frontend.tick(now)
        if self.pool_restart.due:           # the reply went out: tell the clients, then the owner
            self.pool_restart.start_drain()
            self._send_owner(fl.PoolRestartAsked(hold=self.pool_restart.request.hold))
        self._expire_queries(now)
        if self.stats_log.due(now):
            fe, counts = self.frontend, PageTable(self.tables).counts()
            waiting = fe.num_waiting()
            self.stats_log.tick(now, prompt_tokens=fe.num_prompt_tokens, generated_tokens=fe.num_tokens,
                                running=len(fe.streams) - waiting, waiting=waiting,
                                pages_used=counts["total"] - counts["free"] - counts["cached"],
                                pages_total=counts["total"] - 1, prefix_cache=fe.prefix_cache_status(),
                                recoveries=self.shared.timeline.num_recovered if self.shared is not None
                                else self.recoveries_total)

    def close(self) -> None:
        self._stack.close()


def run_frontend(config: SidecarConfig) -> int:
    sys.setswitchinterval(0.0005)
    proc = FrontendProcess(config)
    try:
        proc.start()
        code = proc.serve_forever()
    finally:
        proc.close()
    if code == fl.EXIT_POOL_GONE:          # a new pool: this image starts over it (same pid)
        return reexec()
    return code
