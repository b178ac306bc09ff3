"""The sidecar process: owns memory and tables, supervises executors, serves clients.

One thread, one poll loop (kvhold.sidecar.event_loop) over: the executor control
socket (ZeroMQ ROUTER), the client socket (ROUTER), the descriptor socket
(SOCK_SEQPACKET listener), every executor's pidfd, and a signal wake-up pipe.
Deadlines (heartbeat leases, keepalives, re-spawn backoff) set the poll timeout.
No handler blocks: a bad message gets an error reply and the loop goes on; only a
broken invariant of the sidecar itself ends it, loudly. SIGTERM/SIGINT stop
executors, write the requests still in flight to the durable journal
(kvhold.sidecar.durable_journal: the next start brings them back) and unlink every
shm object, socket and file the sidecar created. A pool restart
(kvhold.sidecar.pool_restart, kvhold.sidecar.restore) does the same, then re-execs in place.

`Sidecar` wires the components together; each gets only what it uses. Every
resource registers its cleanup on an ExitStack as it is made, so `close()` (and a
start that fails half-way) undoes them in reverse order: the registry entry is
revoked, the health monitor stopped, the executors stopped and the in-flight
requests journaled, then the state file, sockets, shm regions, tables, a token
this sidecar created and the instance lock are removed.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import sys

import zmq

from kvhold.protocol import fdpass, messages as m, wire
from kvhold.protocol.checkpoint import build_manifest
from kvhold.protocol.errors import ErrorCode
from kvhold.protocol.leases import now_ns
from kvhold.protocol.memory import check_shm_capacity
from kvhold.protocol.model_spec import ModelSpec
from kvhold.protocol.page_map import page_map
from kvhold.protocol.page_table import PageTable
from kvhold.protocol.tables import Tables
from kvhold.sidecar import adoption, hand_back
from kvhold.sidecar.client_peers import CURVE, NOBODY, PEERCRED, ClientPeers, split_client_key
from kvhold.sidecar.config import SidecarConfig
from kvhold.sidecar.durable_journal import DurableJournal
from kvhold.sidecar.event_loop import EventLoop
from kvhold.sidecar.frontend import Frontend
from kvhold.sidecar.health_responder import HealthResponder
from kvhold.sidecar.instance_lock import InstanceLock
from kvhold.sidecar.pool_restart import PoolRestart, journal_in_flight, reexec, wait_while_held
from kvhold.sidecar.regions import PoolMemory, create_regions, expected_infos
from kvhold.sidecar.request_deaths import RequestDeaths
from kvhold.sidecar.restore import Restore
from kvhold.sidecar.stats_log import StatsLog
from kvhold.sidecar.supervisor import ExecutorLaunch, Supervisor
from kvhold.sidecar.tcp_endpoint import TcpClientEndpoint
from kvhold.sidecar.timeline import RecoveryTimeline
from kvhold.sidecar.weights_keeper import WeightsKeeper
from kvhold.sidecar.zygote_keeper import ZygoteKeeper

log = logging.getLogger(__name__)
GIL_SWITCH_S = 0.0002
DRAIN_SLICE_NS = 1_000_000    # a socket's messages handled per loop turn: at most about this long
FRAME_SLACK = 64 << 10        # a Generate's fields besides its prompt text
SHM_PARTS = ("tables", "kv", "weights")


class Sidecar:
    def __init__(self, config: SidecarConfig):
        self.config = config
        self.paths = config.paths
        self.spec: ModelSpec | None = None
        self.manifest = None
        self.tcp: TcpClientEndpoint | None = None
        self.registrar = None             # kvhold.sidecar.registry.Registrar with --registry
        self.pool_restart: PoolRestart | None = None
        self.timeline = RecoveryTimeline()
        self.started_ns = now_ns()
        self._stack = contextlib.ExitStack()
        self._started = False     # a start refused (instance busy) made nothing to clean up
        self.adoption: dict | None = None   # what this start re-adopted (kvhold.sidecar.adoption)
        self.fd_listener = None

    # ------------------------------------------------------------------ start-up
    def start(self) -> "Sidecar":
        os.umask(0o077)
        # The death watcher threads need the GIL the moment the kernel wakes them; the default
        # 5 ms switch interval would let a busy loop iteration delay every failover by that much.
        sys.setswitchinterval(GIL_SWITCH_S)
        with contextlib.ExitStack() as stack:   # a start that fails undoes what it made
            self._start(stack)
            self._stack = stack.pop_all()
        self._started = True
        return self

    def _start(self, stack: contextlib.ExitStack) -> None:
        cfg = self.config
        if cfg.pool.model is not None:
            self.spec = ModelSpec.from_dir(cfg.pool.model)
            self.manifest = build_manifest(cfg.pool.model, self.spec)
        geometry = cfg.table_geometry(self.spec)
        self.lock = InstanceLock(self.paths)
        stack.callback(self.lock.release)
        self.durable = DurableJournal(cfg.journal_path)
        found = self._find_adoptable(geometry)      # a dead predecessor's live pool, if any
        self.lock.remove_stale(SHM_PARTS, keep_shm=found is not None)
        if found is not None:
            found = self._take_back_regions(stack, found, geometry)
            if found is None:           # no executor handed its descriptors back: a fresh pool
                self.lock.remove_stale(SHM_PARTS)
        generation = self._next_generation() if found is None else found.tables.generation
        self.token, self.token_path = self._load_token(stack, reuse=found is not None)
        self.memory = self._create_memory(stack, geometry, generation, found)
        self.executor_settings = cfg.executor_settings(self.spec)
        self.weights = WeightsKeeper(self.tables, self.manifest, adopted=found is not None)
        self.loop = EventLoop()
        stack.callback(self.loop.close)
        self._make_components()
        # the previous pool's journaled requests (or an adopted pool's streams), before any executor
        self.restore.restore(adopting=found is not None)
        if found is not None:
            self.supervisor.adopt(found.live, found.dead)
        self._open_sockets(stack)
        self._write_state_file(stack)
        if found is not None:           # the header names this sidecar since the hand-back
            self.adoption = {"previous_pid": found.previous_pid, "killed": found.killed,
                             "hand_back": found.taken_back.record,
                             "executors": [{"pid": h.pid, "slot": h.slot, "role": h.role.name.lower()}
                                           for h in found.live],
                             "dead": [h.pid for h in found.dead], "adopted_ns": now_ns(),
                             "ms": (now_ns() - self.started_ns) / 1e6}
            log.warning("re-adopted the pool of sidecar pid %d: %d live executors, %d in-flight "
                        "requests", found.previous_pid, len(found.live),
                        self.restore.report.get("requests_adopted", 0))
        stack.callback(self._stop_executors)
        self.health = self._make_health()
        stack.callback(self.health.stop)
        log.info("sidecar %r generation %d ready: %d KV pages of %d tokens (%.1f MiB), tables %.2f MiB "
                 "(%.3f%% of the pool)", self.paths.instance, generation, geometry.num_pages,
                 geometry.kv.page_tokens, geometry.kv_pool_bytes / 2**20, geometry.total_bytes / 2**20,
                 100 * geometry.metadata_fraction)
        self.supervisor.rearm(now_ns())
        if cfg.registry.url:            # its thread only reads a status snapshot
            self.registrar = self._start_registrar()
            stack.callback(self.registrar.stop)   # first at a stop: routers stop sending here at once

    def _make_components(self) -> None:
        cfg, fingerprint = self.config, self.manifest.fingerprint if self.manifest is not None else ""
        zygote = None
        if cfg.executors.zygote:
            spare = cfg.executors.zygote_spare
            zygote = ZygoteKeeper(self.paths.runtime_dir / "zygote.sock", cfg.pool.device, self.loop,
                                  self.executor_settings, self.tables.geometry,
                                  spare=spare == "on" or (spare == "auto" and cfg.pool.device.startswith("cuda")))
        launch = ExecutorLaunch(paths=self.paths, token=self.token, token_path=self.token_path,
                                settings=self.executor_settings)
        self.deaths = RequestDeaths(self.tables, lambda *failed: self.frontend.fail_request(*failed))
        self.supervisor = Supervisor(cfg.executors, self.tables, self.weights, self.loop, self.memory,
                                     self.send_executor, launch, self.timeline.event, zygote, self.deaths)
        self.frontend = Frontend(self.tables, self.spec, cfg.pool.model,
                                 runs_model=cfg.executors.workload in ("engine", "vllm"), durable=self.durable,
                                 fingerprint=fingerprint, timeline=self.timeline, host=self,
                                 max_prompt_bytes=cfg.pool.max_prompt_bytes)
        self.pool_restart = PoolRestart(self.frontend, self.durable, self.paths,
                                        generation=self.tables.generation, send_client=self.send_client)
        self.restore = Restore(self.frontend, self.durable, fingerprint=fingerprint,
                               vocab_size=self.spec.vocab_size if self.spec else 0,
                               generation=self.tables.generation, started_ns=self.started_ns,
                               send_client=self.send_client,
                               unclaimed_cancel_s=cfg.journal.unclaimed_cancel_s)
        self.frontend.restored = self.restore
        self.stats_log = StatsLog(cfg.logs.stats_interval_s)
        self.frontend.add_handler(m.PoolRestart, self.pool_restart.on_request)
        self.frontend.add_handler(m.Resume, self.restore.on_resume)

    def _make_health(self) -> HealthResponder:
        health = HealthResponder(self.config.health, self.config.pool.device, self.loop.post,
                                 self.supervisor.restart_active, self.frontend.close_admissions,
                                 self.frontend.open_admissions, lambda: self.frontend.closed,
                                 recent_context_fault=self.supervisor.recent_context_fault)
        self.frontend.add_handler(m.Admissions, health.on_admissions)
        return health.start()

    def _start_registrar(self):
        from kvhold.sidecar.registry import SnapshotSource, start_registrar

        def active_ready() -> bool:
            active = self.supervisor.active
            return active is not None and active.ready

        src = SnapshotSource(paths=self.paths, model=self.config.pool.model, tables=self.tables,
                             weights=self.weights, tcp=self.tcp,
                             admissions_closed=lambda: bool(self.frontend.closed),
                             active_ready=active_ready, in_flight=lambda: len(self.frontend.streams))
        return start_registrar(self.config.registry, self.config.pool.device, src)

    def _region_sizes(self, geometry) -> dict[str, int]:
        sizes = {"kv": geometry.kv_pool_bytes}
        if self.manifest is not None:
            sizes["weights"] = self.manifest.region_bytes
        return sizes

    def _find_adoptable(self, geometry):
        """A dead predecessor's pool with live executors, to adopt (kvhold.sidecar.adoption)."""
        cfg = self.config
        return adoption.find(self.paths, geometry, backend=cfg.pool.backend,
                             generation=self.durable.last_generation,
                             fingerprint=self.manifest.fingerprint if self.manifest is not None else "",
                             token_path=cfg.executors.token_file or self.paths.token_file,
                             region_sizes=self._region_sizes(geometry))

    def _create_memory(self, stack: contextlib.ExitStack, geometry, generation: int,
                       found=None) -> PoolMemory:
        """The tables segment, the KV pool and (with a model) the weights region; `found`: a
        dead predecessor's, adopted by name instead."""
        sizes = self._region_sizes(geometry)
        if found is not None:
            self.tables = found.tables
        else:
            check_shm_capacity({"tables": geometry.total_bytes,
                                **(sizes if self.config.pool.backend == "host" else {})})
            self.tables = Tables.create(self.paths.shm_name("tables"), geometry, generation)
        stack.callback(self.tables.unlink)
        regions = create_regions(sizes, self.config.pool, self.paths,
                                 lambda region: stack.callback(region.unlink), adopt=found is not None,
                                 taken_back=found.taken_back.regions if found is not None else None)
        return PoolMemory(self.tables, regions)

    def _take_back_regions(self, stack: contextlib.ExitStack, found, geometry):
        """Open the descriptor socket, name this sidecar in the header and wait for a live
        executor to hand the regions' descriptors back (kvhold.sidecar.hand_back); `found`
        with them, or None (its executors killed) if none did in time."""
        cfg = self.config
        self._listen_fds(stack)
        found.tables.claim(os.getpid())         # the waiting executors' sign to hand back and attach
        token_path = cfg.executors.token_file or self.paths.token_file
        expected = expected_infos(self._region_sizes(geometry), cfg.pool)
        receiver = hand_back.Receiver(found, expected, token_path.read_text().strip(), self.paths,
                                      cfg.pool.backend)
        log.info("waiting up to %.1f s for an executor to hand back the regions' descriptors",
                 cfg.executors.sidecar_wait_ms / 1e3)
        found.taken_back = receiver.wait(self.fd_listener, cfg.executors.sidecar_wait_ms / 1e3)
        if found.taken_back is not None:
            return found
        adoption.abandon(found, "no live executor handed back the regions' descriptors"
                         + (f" (refused: {receiver.refused})" if receiver.refused else ""))
        self.fd_listener.close()       # remove_stale unlinks its path; _open_sockets binds it anew
        self.fd_listener = None
        return None

    def _next_generation(self) -> int:
        path = self.paths.runtime_dir / "generation"
        try:
            gen = int(path.read_text().strip()) + 1
        except (FileNotFoundError, ValueError):
            gen = 1
        # the durable journal's generation survives a reboot: request ids never repeat
        gen = max(gen, self.durable.last_generation + 1)
        path.write_text(f"{gen}\n")
        self.durable.set_generation(gen)
        return gen

    def _load_token(self, stack: contextlib.ExitStack, reuse: bool = False) -> tuple[str, os.PathLike]:
        """`reuse`: keep the token an adopted pool's executors attach with."""
        token_file = self.config.executors.token_file
        if reuse and token_file is None:
            stack.callback(self.paths.token_file.unlink, missing_ok=True)
            return self.paths.token_file.read_text().strip(), self.paths.token_file
        if token_file is not None:
            st = os.stat(token_file)
            if st.st_mode & 0o077:
                raise PermissionError(f"token file {token_file} is readable by others; chmod 600 it")
            return token_file.read_text().strip(), token_file
        path = self.paths.token_file
        token = secrets.token_hex(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        stack.callback(path.unlink, missing_ok=True)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return token, path

    def _open_sockets(self, stack: contextlib.ExitStack) -> None:
        self.zctx = zmq.Context()
        stack.callback(self.zctx.term)
        self.control = self._router(self.paths.control_endpoint, self.paths.control_socket, stack)
        self.client = self._router(self.paths.client_endpoint, self.paths.client_socket, stack)
        if self.config.client_tcp.address:
            self.tcp = TcpClientEndpoint(self.config.client_tcp)
            stack.callback(self.tcp.close)
        # A client is known to the frontend by transport + authenticated principal + routing id
        # (kvhold.sidecar.client_peers): presenting another's routing id makes nobody its owner.
        self._client_sockets = {b"u": self.client}
        self.peers = ClientPeers()
        stack.callback(self.peers.close)
        self.peers.add(b"u", self.client, PEERCRED)
        if self.tcp is not None:
            self._client_sockets[b"t"] = self.tcp.socket
            self.peers.add(b"t", self.tcp.socket, CURVE if self.tcp.curve else NOBODY)
        if self.fd_listener is None:            # not opened already to take regions back
            self._listen_fds(stack)
        self.loop.register(self.control)
        self.loop.register(self.client)
        if self.tcp is not None:
            self.tcp.register(self.loop.poller)
        self.loop.watch_fd(self.fd_listener.fileno(), self._accept_fd_request)

    def _listen_fds(self, stack: contextlib.ExitStack) -> None:
        stack.callback(_unlink, self.paths.fd_socket)
        self.fd_listener = fdpass.listen(str(self.paths.fd_socket))
        stack.callback(self.fd_listener.close)
        self.fd_listener.setblocking(False)

    def _router(self, endpoint: str, path, stack: contextlib.ExitStack) -> zmq.Socket:
        sock = self.zctx.socket(zmq.ROUTER)
        stack.callback(_unlink, path)     # after the close: the socket file goes last
        stack.callback(sock.close, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.bind(endpoint)
        os.chmod(path, 0o600)
        return sock

    def _write_state_file(self, stack: contextlib.ExitStack) -> None:
        state = {"pid": os.getpid(), "generation": self.tables.generation,
                 "client_endpoint": self.paths.client_endpoint,
                 "client_tcp": self.tcp.status() if self.tcp else None,
                 "tables": self.paths.shm_name("tables"),
                 "model": str(self.config.pool.model) if self.config.pool.model else None}
        stack.callback(_unlink, self.paths.state_file)
        self.paths.state_file.write_text(json.dumps(state) + "\n")

    # ------------------------------------------------------------------ fd plumbing
    def _accept_fd_request(self) -> None:
        try:
            conn, _ = self.fd_listener.accept()
        except BlockingIOError:
            return
        conn.settimeout(0.5)
        self.supervisor.on_fd_request(conn)

    # ------------------------------------------------------------------ executor channel
    def send_executor(self, handle, msg) -> None:
        if handle.identity is None:
            return
        try:
            self.control.send_multipart([handle.identity, wire.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not send %s to executor pid %d: %s", msg.TYPE, handle.pid, exc)

    def post(self, callback) -> None:
        """Run `callback` on the loop thread (from a worker thread of the frontend)."""
        self.loop.post(callback)

    def wake_executor(self) -> None:
        """New work in the journal: wake the active executor if it sleeps."""
        active = self.supervisor.active
        if active is not None:
            self.send_executor(active, m.Wake())

    def _reply(self, sock: zmq.Socket, identity: bytes, msg) -> None:
        try:
            sock.send_multipart([identity, wire.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("dropped %s reply: %s", msg.TYPE, exc)

    def _decode(self, sock: zmq.Socket, identity: bytes, frame: bytes, allowed, what: str,
                max_array_len: int | None = None):
        """The message, or None after an error reply: a bad frame never reaches a handler."""
        try:
            return wire.decode(frame, allowed, max_array_len=max_array_len)
        except wire.WireError as exc:
            log.warning("bad %s message: %s (%s)", what, exc, exc.code.name)
            self._reply(sock, identity, m.Error(code=exc.code, message=str(exc), tag=wire.peek_tag(frame)))
            return None

    def _on_control(self, identity: bytes, frame: bytes) -> None:
        msg = self._decode(self.control, identity, frame, m.CONTROL_IN, "control")
        if msg is None:
            return
        if isinstance(msg, m.Attach):
            self._reply(self.control, identity, self.supervisor.on_attach(identity, msg))
            return
        h = self.supervisor.handle_for(identity, msg.slot, msg.epoch)
        if h is None or h.fenced or msg.epoch != h.epoch:
            log.warning("refused %s from a stale or unknown executor (lease %d epoch %d)",
                        msg.TYPE, msg.slot, msg.epoch)
            self._reply(self.control, identity, m.Error(code=ErrorCode.FENCED,
                                                        message="stale or unknown lease"))
            return
        reply = self._control_handlers[type(msg)](self, h, msg)
        if reply is not None:
            self._reply(self.control, identity, reply)

    _control_handlers = {
        m.Ready: lambda self, h, msg: self.supervisor.on_ready(h, msg),
        m.Bye: lambda self, h, msg: self.supervisor.on_bye(h, msg),
        m.Failing: lambda self, h, msg: self.supervisor.on_failing(h, msg),
        m.WeightsLoading: lambda self, h, msg: None,
        m.WeightsSealed: lambda self, h, msg: self.weights.on_sealed(h, msg),
        m.StepDone: lambda self, h, msg: self.frontend.on_step(h, msg),
        m.Recovered: lambda self, h, msg: self._on_recovered(h, msg),
    }

    def _on_recovered(self, h, msg) -> None:
        self.timeline.recovered(h.pid, h.epoch, msg.report)
        self.supervisor.takeover_done()

    def _on_client(self, identity: bytes, frame: zmq.Frame, via: bytes = b"u") -> None:
        sock = self._client_sockets[via]
        key = self.peers.seen(via, identity, frame)
        geometry = self.tables.geometry    # a prompt's text, or its ids and a moved request's tokens
        limit = max(self.config.pool.max_prompt_bytes, 18 * geometry.max_seq_len) + FRAME_SLACK
        if len(frame) > limit:       # refused undecoded: the loop does not wait on a client's bytes
            self._reply(sock, identity, m.Error(
                code=ErrorCode.PROMPT_TOO_LARGE, tag=wire.peek_tag(frame.buffer),
                message=f"a message of {len(frame)} bytes exceeds "
                f"this sidecar's limit of {limit} bytes (see --max-prompt-bytes)"))
            return
        # no list a client sends is longer than the context (prompt, tokens) or the request slots
        msg = self._decode(sock, identity, frame.bytes, m.CLIENT_IN, "client",
                           max_array_len=max(geometry.max_seq_len, geometry.num_slots, 1024))
        if msg is None:
            return
        try:
            reply = self.frontend.handle(key, msg)
        except Exception as exc:  # a bug on one request must not stop the service
            log.exception("internal error handling %s", msg.TYPE)
            reply = m.Error(code=ErrorCode.INTERNAL, message=f"internal error: {type(exc).__name__}",
                            tag=getattr(msg, "tag", 0))
        if reply is not None:
            self._reply(sock, identity, reply)

    def client_connection(self, client_key: bytes) -> int:
        """The number of the connection a client key speaks on now (0: none; client_peers)."""
        via, principal, identity = split_client_key(client_key)
        return self.peers.connection(via, identity, principal)

    def send_client(self, client_key: bytes, msg, connection: int = 0) -> bool:
        """Send to a client as the frontend knows it (transport, principal, routing id); False,
        sending nothing, while the connection under that routing id is not that principal's
        (or, with `connection`, not that one: client_peers)."""
        via, principal, identity = split_client_key(client_key)
        if not self.peers.may_send(via, identity, principal, connection):
            return False
        self._reply(self._client_sockets[via], identity, msg)
        return True

    # ------------------------------------------------------------------ loop
    def _drain(self, sock: zmq.Socket, handler, budget: int = 256, copy: bool = True) -> None:
        deadline = now_ns() + DRAIN_SLICE_NS     # the rest waits a turn: death signals go first
        for _ in range(budget):
            if now_ns() > deadline:
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                return
            if len(frames) != 2:
                log.warning("dropped a %d-frame message (expected identity + body)", len(frames))
                continue
            handler(frames[0] if copy else frames[0].bytes, frames[1])

    def serve_forever(self) -> None:
        while not self.loop.stop_requested and not self.pool_restart.draining:
            self.run_once()
            if self.pool_restart.due:
                self.pool_restart.start_drain()   # close() then stops executors and journals
        log.info("stopping on request")

    def run_once(self) -> None:
        now = now_ns()
        deadline = min(self.supervisor.next_deadline_ns(), self.frontend.next_deadline_ns())
        timeout_ms = max(0, -(-(deadline - now) // 1_000_000))
        events = self.loop.poll(min(timeout_ms, 1000))
        if self.control in events:
            self._drain(self.control, self._on_control)
        if self.client in events:   # frames, not bytes: the client's credentials are properties
            self._drain(self.client, self._on_client, copy=False)
        if self.tcp is not None:
            self.tcp.on_events(events)
            if self.tcp.socket in events:
                self._drain(self.tcp.socket, lambda ident, frame: self._on_client(ident, frame, b"t"),
                            copy=False)
        now = now_ns()
        self.supervisor.check_heartbeats(now)
        self.supervisor.rearm(now)
        self.frontend.tick(now)
        if self.stats_log.due(now):
            self._log_stats(now)
        self.loop.turn_ended()

    def _log_stats(self, now: int) -> None:
        fe, counts = self.frontend, PageTable(self.tables).counts()
        waiting = fe.num_waiting()
        self.stats_log.tick(now, prompt_tokens=fe.num_prompt_tokens, generated_tokens=fe.num_tokens,
                            running=len(fe.streams) - waiting, waiting=waiting,
                            pages_used=counts["total"] - counts["free"], pages_total=counts["total"] - 1,
                            recoveries=fe.timeline.num_recovered)     # page 0, the null page, counts as free

    def status(self) -> dict:
        pages = PageTable(self.tables)
        return {"instance": self.paths.instance, "pid": os.getpid(),
                "generation": self.tables.generation,
                "uptime_s": (now_ns() - self.started_ns) / 1e9,
                "weights": {"state": self.weights.state.name.lower(),
                            "fingerprint": self.weights.fingerprint, "load_ms": self.weights.load_ms},
                "executors": self.supervisor.status(),
                "protection": self.supervisor.protection(),
                "zygote": self.supervisor.zygote.status() if self.supervisor.zygote else None,
                "takeover": self.config.executors.takeover,
                "health": self.health.status(),
                "pages": pages.counts(),
                "page_map": page_map(pages.snapshot()),
                "client_tcp": self.tcp.status() if self.tcp else None,
                "client_peers": self.peers.status(),
                "registry": self.registrar.status() if self.registrar else None,
                "events": self.timeline.events(),
                "pool_restart": self.restore.status(),
                "loop": self.loop.stats(),
                "request_deaths": self.deaths.status(),
                "adoption": self.adoption,
                # what an HTTP API in front of this sidecar needs (`kvhold serve --sidecar-endpoint`)
                "serving": {"model": str(self.config.pool.model) if self.config.pool.model else None,
                            "max_seq_len": self.tables.geometry.max_seq_len,
                            "lease_ms": self.config.executors.lease_ms},
                **self.frontend.status()}

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Undo what start() made, newest first (see the module docstring for the order)."""
        self._stack.close()
        if self._started:
            log.info("sidecar %r stopped and cleaned up", self.paths.instance)

    def _stop_executors(self) -> None:
        """Stop the executors (the shm journal is then still), then journal what is in flight."""
        self.supervisor.stop_all()
        self._journal_on_stop()

    def _journal_on_stop(self) -> None:
        """A stop (SIGTERM) keeps in-flight requests too: the next start brings them back."""
        try:
            self.frontend.finish_pending()       # unacknowledged admissions: refused, records dropped
            if self.pool_restart.draining:
                self.pool_restart.finish_drain()
                return
            n = journal_in_flight(self.frontend, self.durable)
            if n:
                log.warning("%d in-flight requests journaled to %s for the next start", n, self.durable.dir)
        except Exception:
            log.exception("could not journal the in-flight requests")


def _unlink(path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def run_sidecar(config: SidecarConfig) -> int:
    if not wait_while_held(config.paths):   # `kvhold pool-restart --wait-for-operator`
        return 0
    sidecar = Sidecar(config)
    try:
        sidecar.start()
        sidecar.serve_forever()
    finally:
        sidecar.close()
    if sidecar.pool_restart is not None and sidecar.pool_restart.drained:
        return reexec()                     # returns only if the exec failed
    return 0
