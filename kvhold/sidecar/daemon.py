"""The sidecar process: owns memory and tables, supervises executors, serves clients.

One thread, one poll loop (kvhold.sidecar.event_loop) over: the executor control
socket (ZeroMQ ROUTER), its frontend's sockets (kvhold.sidecar.frontend_link: the link to a
frontend process, or, with the frontend in this process, the client sockets), the descriptor
socket (SOCK_SEQPACKET listener), every executor's pidfd, and a signal wake-up pipe.
Deadlines (heartbeat leases, keepalives, re-spawn backoff) set the poll timeout.
No handler blocks: a bad message gets an error reply and the loop goes on; only a
broken invariant of the sidecar itself ends it, loudly. SIGTERM/SIGINT stop
executors, write the requests still in flight to the durable journal
(kvhold.sidecar.durable_journal: the next start brings them back) and unlink every
shm object, socket and file the sidecar created. A pool restart
(kvhold.sidecar.pool_restart, kvhold.sidecar.readmit) does the same, then re-execs in place.

`Sidecar` wires the components together; each gets only what it uses. It speaks to its
frontend only through its link end (`FrontendEnd`): `FrontendLink` to a frontend process
(`--external-frontend`), or `InprocFrontendLink` to the same frontend in this process
(kvhold.frontend.inline composes the two). Every
resource registers its cleanup on an ExitStack as it is made, so `close()` (and a
start that fails half-way) undoes them in reverse order: the registry entry is
revoked, the health monitor stopped, the executors stopped and the in-flight
requests journaled, then the state file, sockets, shm regions, tables, a token
this sidecar created and the instance lock are removed.

A spare (`kvhold sidecar --spare`, `run_sidecar(spare=True)`) is a sidecar started ahead:
it imports its code, reads the checkpoint's description and loads the tokenizer, then
holds nothing and waits in the instance lock (kvhold.sidecar.instance_lock) for the running
sidecar's death. The kernel hands it the lock at once, and it starts as a restarted
sidecar would (re-adoption, kvhold.sidecar.adoption) without a new process's start-up.
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import secrets
import signal
import sys

import zmq

from kvhold.protocol import fdpass, messages as m, wire
from kvhold.protocol.checkpoint import build_manifest
from kvhold.protocol.errors import ErrorCode
from kvhold.protocol.journal import Journal
from kvhold.protocol.leases import now_ns
from kvhold.protocol.memory import check_shm_capacity
from kvhold.protocol.model_spec import ModelSpec
from kvhold.protocol.page_map import page_map
from kvhold.protocol.page_table import PageTable
from kvhold.protocol.procfs import pid_alive
from kvhold.protocol.router_socket import bind_router, decode, drain, reply, unlink as _unlink
from kvhold.protocol.state_files import read_generation
from kvhold.protocol.tables import Tables
from kvhold.sidecar import adoption, hand_back
from kvhold.sidecar.iteration_tokens import IterationTokens
from kvhold.sidecar.config import SidecarConfig
from kvhold.sidecar.durable_journal import DurableJournal
from kvhold.sidecar.event_loop import EventLoop
from kvhold.sidecar.frontend_link import FrontendEnd, FrontendLink
from kvhold.sidecar.health_responder import HealthResponder
from kvhold.sidecar.instance_lock import SHM_DIR, InstanceLock, wait_for_holder_death
from kvhold.sidecar.pool_restart import POOL_RESTART_ENV, PoolRestart, reexec, wait_while_held
from kvhold.sidecar.regions import PoolMemory, create_regions, expected_infos, shm_needs
from kvhold.sidecar.request_deaths import RequestDeaths
from kvhold.sidecar.readmit import Readmission
from kvhold.sidecar.supervisor import ExecutorLaunch, Supervisor
from kvhold.sidecar.timeline import RecoveryTimeline
from kvhold.sidecar.weights_keeper import WeightsKeeper
from kvhold.sidecar.zygote_keeper import ZygoteKeeper

log = logging.getLogger(__name__)
GIL_SWITCH_S = 0.0002
# what a memory owner with an external frontend never imports (kvhold.frontend.process has them)
CLIENT_FACING_MODULES = ("tokenizers", "fastapi", "uvicorn", "starlette", "kvhold.serving.http_api",
                         "kvhold.frontend.frontend", "kvhold.frontend.admission", "kvhold.frontend")
SHM_PARTS = ("tables", "kv", "weights")
SPARE_FLAG = "--spare"                  # `kvhold sidecar --spare` (kvhold.cli.main)
# a test's hold at a named point: a part of the start (`parts_ms`: found, regions_back,
# components, restored, sockets) or of a pool restart (pool_restart_draining: the loop left, the
# executors not stopped yet; pool_restart_drained: the requests on disk, the lock gone, the
# re-exec next): the sidecar logs it and stops itself (SIGSTOP) there, so that a test can kill
# it in that very window, e.g. a spare that has the regions back and no socket yet
STOP_AT_ENV = "KVHOLD_SIDECAR_STOP_AT"


def _reached(parts: dict, name: str) -> None:
    """Time a part of the start (the status's adoption.parts_ms); stop here if a test asks."""
    parts[name] = now_ns()
    stop_if_asked(name)


def stop_if_asked(name: str) -> None:
    """SIGSTOP this process if a test named this point in STOP_AT_ENV."""
    if os.environ.get(STOP_AT_ENV) == name:
        log.warning("stopping at %s (%s)", name, STOP_AT_ENV)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGSTOP)


class Sidecar:
    """The memory owner. It serves no client: its frontend does, over its link end
    (`self.link`, kvhold.sidecar.frontend_link). Here the link is to a frontend process
    (`kvhold frontend`, kvhold.frontend.process); kvhold.frontend.inline.InlineSidecar runs the
    same frontend in this process over an in-process link, so that this module and the
    owner's parts import no client-facing code."""
    link_class: type = FrontendLink      # what `_make_link` makes (its KIND, BINDS_CLIENT_SOCKET)

    def __init__(self, config: SidecarConfig):
        self.config = config
        self.link: FrontendEnd | None = None
        self.paths = config.paths
        self.spec: ModelSpec | None = None
        self.manifest = None
        self.registrar = None             # kvhold.sidecar.registry.Registrar with --registry
        self.pool_restart: PoolRestart | None = None
        self.timeline = RecoveryTimeline()
        self.iteration_tokens = IterationTokens()      # the engine's steps' token counts (StepDone)
        self.started_ns = now_ns()
        self._stack = contextlib.ExitStack()
        self._started = False     # a start refused (instance busy) made nothing to clean up
        self.adoption: dict | None = None   # what this start re-adopted (kvhold.sidecar.adoption)
        self.fd_listener = None
        self._held_lock: int | None = None  # a spare's lock, taken at its predecessor's death
        self.spare: dict | None = None      # a spare's takeover: whom it followed, how fast
        self._old_tables = False            # a predecessor's tables were found at this start

    # ------------------------------------------------------------------ a spare's wait
    def prepare(self) -> None:
        """What a start needs that no predecessor holds: the checkpoint's description and, with
        the frontend in this process, its code and tokenizer (a spare does this ahead)."""
        cfg = self.config
        if cfg.pool.model is not None and self.spec is None:
            self.spec = ModelSpec.from_dir(cfg.pool.model)
            self.manifest = build_manifest(cfg.pool.model, self.spec)

    def wait_as_spare(self) -> None:
        """Prepare, then wait until this instance's running sidecar dies, holding nothing but a
        file that says this spare waits (`InstancePaths.spare_file`). SIGTERM/SIGINT end the wait."""
        self.prepare()
        marker = self.paths.spare_file(os.getpid())

        def stop(signum, frame):
            raise SystemExit(0)

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        waiting_on = [0]

        def on_waiting(pid: int) -> None:
            if pid != waiting_on[0]:
                waiting_on[0] = pid
                partial = marker.with_name(marker.name + ".new")    # never seen half-written
                partial.write_text(f"{pid}\n")
                partial.replace(marker)
                log.info("spare sidecar of instance %r ready: waiting for sidecar pid %d",
                         self.paths.instance, pid)
        try:
            self._held_lock, dead = wait_for_holder_death(self.paths, on_waiting)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            marker.unlink(missing_ok=True)
        self.started_ns = now_ns()
        self.spare = {"previous_pid": dead, "lock_taken_ns": self.started_ns}
        log.warning("sidecar pid %d of instance %r died: this spare takes over", dead, self.paths.instance)

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
        self.paths.exit_file.unlink(missing_ok=True)   # a reason a failed start gave is past
        return self

    def _start(self, stack: contextlib.ExitStack) -> None:
        cfg = self.config
        self.prepare()
        geometry = cfg.table_geometry(self.spec)
        self.lock = InstanceLock(self.paths, held_fd=self._held_lock)
        stack.callback(self.lock.release)
        self.durable = DurableJournal(cfg.journal_path)
        parts = {"lock": now_ns()}                  # a re-adoption's timed parts (status: adoption.parts_ms)
        found = self._find_adoptable(geometry)      # a dead predecessor's live pool, if any
        _reached(parts, "found")
        keep_client_socket = not self.link_class.BINDS_CLIENT_SOCKET     # a frontend process's
        # a frontend process may still map a predecessor's tables (their space stays taken)
        self._old_tables = found is None and (SHM_DIR / self.paths.shm_name("tables").lstrip("/")).exists()
        self.lock.remove_stale(SHM_PARTS, keep_shm=found is not None, keep_client_socket=keep_client_socket)
        if found is not None:
            found = self._take_back_regions(stack, found, geometry)
            if found is None:           # no executor handed its descriptors back: a fresh pool
                self.lock.remove_stale(SHM_PARTS, keep_client_socket=keep_client_socket)
        _reached(parts, "regions_back")
        generation = self._next_generation() if found is None else found.tables.generation
        self.token, self.token_path = self._load_token(stack, reuse=found is not None)
        self.memory = self._create_memory(stack, geometry, generation, found)
        self.executor_settings = cfg.executor_settings(self.spec)
        self.weights = WeightsKeeper(self.tables, self.manifest, adopted=found is not None)
        self.loop = EventLoop()
        stack.callback(self.loop.close)
        self._make_components()
        _reached(parts, "components")
        # the previous pool's journaled requests (or an adopted pool's streams), before any executor
        self.link = self._make_link()
        self.link.tables_name = self.paths.shm_name("tables")
        self.link.start(stack, adopting=found is not None)
        _reached(parts, "restored")
        if found is not None:
            self.supervisor.adopt(found.live, found.dead)
        self._open_sockets(stack)
        self._write_state_file(stack)
        _reached(parts, "sockets")
        if found is not None:           # the header names this sidecar since the hand-back
            self.adoption = {"previous_pid": found.previous_pid, "killed": found.killed,
                             "hand_back": found.taken_back.record,
                             "executors": [{"pid": h.pid, "slot": h.slot, "role": h.role.name.lower()}
                                           for h in found.live],
                             "dead": [h.pid for h in found.dead], "adopted_ns": now_ns(),
                             "ms": (now_ns() - self.started_ns) / 1e6,
                             # ms from the start (a spare: from taking the lock) to the end of each part
                             "parts_ms": {k: round((v - self.started_ns) / 1e6, 2) for k, v in parts.items()}}
            log.warning("re-adopted the pool of sidecar pid %d: %d live executors, %d in-flight "
                        "requests", found.previous_pid, len(found.live), self.link.requests_adopted())
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
        cfg = self.config
        zygote = None
        if cfg.uses_zygote():
            spare = cfg.executors.zygote_spare
            zygote = ZygoteKeeper(self.paths.runtime_dir / "zygote.sock", cfg.pool.device, self.loop,
                                  self.executor_settings, self.tables.geometry,
                                  spare=spare == "on" or (spare == "auto" and cfg.pool.device.startswith("cuda")))
        launch = ExecutorLaunch(paths=self.paths, token=self.token, token_path=self.token_path,
                                settings=self.executor_settings)
        self.deaths = RequestDeaths(self.tables, lambda *failed: self.link.fail_request(*failed),
                                    store=self.durable.dir / "request_deaths.json")
        self.supervisor = Supervisor(cfg.executors, self.tables, self.weights, self.loop, self.memory,
                                     self.send_executor, launch, self.timeline.event, zygote, self.deaths)
        # the drain of a pool restart is the frontend's; this one says whether to re-execute
        self.pool_restart = PoolRestart(None, self.durable, self.paths, generation=self.tables.generation,
                                        send_client=lambda *a: False)

    def _make_link(self) -> FrontendEnd:
        """The link to a frontend process, which adopts the streams of the requests that the
        owner re-admits into a fresh pool (kvhold.sidecar.readmit)."""
        fingerprint = self.manifest.fingerprint if self.manifest is not None else ""
        readmission = Readmission(Journal(self.tables), self.durable, fingerprint=fingerprint,
                                  vocab_size=self.spec.vocab_size if self.spec else 0,
                                  generation=self.tables.generation, started_ns=self.started_ns)
        return FrontendLink(self.tables, wake=self.wake_executor, status=self.status,
                            readmission=readmission, paths=self.paths)

    def _make_health(self) -> HealthResponder:
        link = self.link
        health = HealthResponder(self.config.health, self.config.pool.device, self.loop.post,
                                 self.supervisor.restart_active, link.close_admissions,
                                 link.open_admissions, lambda: link.closed,
                                 recent_context_fault=self.supervisor.recent_context_fault)
        link.on_admissions_query = lambda reopen: self._query_admissions(health, reopen)
        return health.start()

    @staticmethod
    def _query_admissions(health: HealthResponder, reopen: bool) -> dict:
        """The frontend asked on behalf of a local operator (it checks the transport)."""
        return dict(health.on_admissions(b"u", m.Admissions(tag=0, reopen=reopen)).closed_by)

    def _start_registrar(self):
        from kvhold.sidecar.registry import SnapshotSource, start_registrar

        def active_ready() -> bool:
            active = self.supervisor.active
            return active is not None and active.ready

        src = SnapshotSource(paths=self.paths, model=self.config.pool.model, tables=self.tables,
                             weights=self.weights, tcp=self.link.client_tcp,
                             admissions_closed=self.link.admissions_closed,
                             active_ready=active_ready, in_flight=self.link.in_flight)
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
            # a frontend process keeps the old tables mapped through a pool restart: a start asks
            # for room for them too, unless they are out of the free space already (a pool
            # restart's new image, or a predecessor's tables found at this start)
            reserve = not (self.link_class.BINDS_CLIENT_SOCKET or os.environ.get(POOL_RESTART_ENV)
                           or self._old_tables)
            check_shm_capacity(shm_needs(geometry.total_bytes, sizes, self.config.pool.backend, reserve))
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
        gen = read_generation(path) + 1            # a damaged file is set aside: counts as none
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
        self.control = bind_router(self.zctx, self.paths.control_endpoint, self.paths.control_socket, stack)
        if self.fd_listener is None:            # not opened already to take regions back
            self._listen_fds(stack)
        self.loop.register(self.control)
        self.link.open(stack, self.zctx, self.loop)
        self.loop.watch_fd(self.fd_listener.fileno(), self._accept_fd_request)

    def _listen_fds(self, stack: contextlib.ExitStack) -> None:
        stack.callback(_unlink, self.paths.fd_socket)
        self.fd_listener = fdpass.listen(str(self.paths.fd_socket))
        stack.callback(self.fd_listener.close)
        self.fd_listener.setblocking(False)

    def _write_state_file(self, stack: contextlib.ExitStack) -> None:
        state = {"pid": os.getpid(), "generation": self.tables.generation,
                 "client_endpoint": self.paths.client_endpoint,
                 "frontend": self.link.KIND,
                 "client_tcp": self.link.client_tcp.status() if self.link.client_tcp else None,
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

    def _on_control(self, identity: bytes, frame: bytes) -> None:
        msg = decode(self.control, identity, frame, m.CONTROL_IN, "control")
        if msg is None:
            return
        if isinstance(msg, m.Attach):
            reply(self.control, identity, self.supervisor.on_attach(identity, msg))
            return
        h = self.supervisor.handle_for(identity, msg.slot, msg.epoch)
        if h is None or h.fenced or msg.epoch != h.epoch:
            log.warning("refused %s from a stale or unknown executor (lease %d epoch %d)",
                        msg.TYPE, msg.slot, msg.epoch)
            reply(self.control, identity, m.Error(code=ErrorCode.FENCED, message="stale or unknown lease"))
            return
        answer = self._control_handlers[type(msg)](self, h, msg)
        if answer is not None:
            reply(self.control, identity, answer)

    _control_handlers = {
        m.Ready: lambda self, h, msg: self.supervisor.on_ready(h, msg),
        m.Bye: lambda self, h, msg: self.supervisor.on_bye(h, msg),
        m.Failing: lambda self, h, msg: self.supervisor.on_failing(h, msg),
        m.WeightsLoading: lambda self, h, msg: None,
        m.WeightsSealed: lambda self, h, msg: self.weights.on_sealed(h, msg),
        m.StepDone: lambda self, h, msg: self._on_step(h, msg),
        m.Recovered: lambda self, h, msg: self._on_recovered(h, msg),
    }

    def _on_step(self, h, msg: m.StepDone) -> None:
        self.supervisor.step_done(h)
        received_ns = now_ns()
        # the frontend streams the tokens (in this process: within this call), then the timeline
        # marks a recovery's first resumed token
        self.link.committed(msg.slots, self.timeline.num_recovered)
        self.timeline.step_done(h.epoch, msg.marks, received_ns)
        self.iteration_tokens.observe(msg.step_tokens)

    def _on_recovered(self, h, msg) -> None:
        self.timeline.recovered(h.pid, h.epoch, msg.report)
        self.supervisor.takeover_done()

    # ------------------------------------------------------------------ loop
    def serve_forever(self) -> None:
        # what start-up built (modules, tables, the tokenizer) is kept for good: the cyclic GC's
        # full collections, which can land between a fence and the first resumed token, then
        # scan only what was made since
        gc.freeze()
        while not self.loop.stop_requested and self.link.pool_restart is None:
            self.run_once()
        if self.link.pool_restart is not None:
            stop_if_asked("pool_restart_draining")
        log.info("stopping on request")      # close() stops executors, the frontend journals

    def run_once(self) -> None:
        now = now_ns()
        deadline = min(self.supervisor.next_deadline_ns(), self.link.next_deadline_ns())
        timeout_ms = max(0, -(-(deadline - now) // 1_000_000))
        events = self.loop.poll(min(timeout_ms, 1000))
        if self.control in events:
            drain(self.control, self._on_control)
        self.link.on_events(events)
        now = now_ns()
        self.supervisor.check_heartbeats(now)
        self.supervisor.rearm(now)
        self.link.tick(now)             # the frontend's turn, in this process (its stats line too)
        self.loop.turn_ended()

    def status(self) -> dict:
        """The owner's status; its frontend adds its part (requests, streams, clients)."""
        return {**self._owner_status(PageTable(self.tables)), "recoveries": self.timeline.records(),
                "memory_owner": {"pid": os.getpid(), "frontend": self.link.status(),
                                 "client_facing_modules": sorted(
                                     n for n in CLIENT_FACING_MODULES if n in sys.modules),
                                 "restore": self.link.restore_report or None}}

    def _owner_status(self, pages) -> dict:
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
                "registry": self.registrar.status() if self.registrar else None,
                "events": self.timeline.events(),
                "loop": self.loop.stats(),
                "request_deaths": self.deaths.status(),
                "iteration_tokens": self.iteration_tokens.status(),
                "adoption": self.adoption,
                "spare": self.spare,            # this sidecar took over as a spare: whom it followed
                "spares": [pid for pid in self.paths.spare_pids() if pid_alive(pid)],   # waiting now
                # what an HTTP API in front of this sidecar needs (`kvhold serve --sidecar-endpoint`)
                "serving": {"model": str(self.config.pool.model) if self.config.pool.model else None,
                            "page_tokens": self.tables.geometry.kv.page_tokens,
                            "kv_dtype": self.tables.geometry.kv.dtype,
                            "prefix_caching": self.config.uses_prefix_caching(),
                            "max_seq_len": self.tables.geometry.max_seq_len,
                            "lease_ms": self.config.executors.lease_ms,
                            "max_prompt_bytes": self.config.pool.max_prompt_bytes}}

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
        """A stop (SIGTERM) keeps in-flight requests too: the next start brings them back. The
        frontend holds their records; it journals them (a pool restart's with its drain record)."""
        n = self.link.journal_on_stop()
        if n and not self.link.BINDS_CLIENT_SOCKET:     # (a frontend in this process logs it itself)
            log.warning("%d in-flight requests journaled by the frontend for the next start", n)
        if self.link.pool_restart is not None:     # re-exec (the frontend wrote the hold file)
            self.pool_restart.drained = n is not None
            if n is None:
                log.error("pool restart: the frontend did not journal the in-flight requests; "
                          "stopping instead")


def run_sidecar(config: SidecarConfig, spare: bool = False, sidecar_class: type[Sidecar] | None = None) -> int:
    """`spare`: wait for the running sidecar's death first (`Sidecar.wait_as_spare`);
    `sidecar_class`: the memory owner alone (`--external-frontend`) by default, the frontend in
    process over an in-process link with kvhold.frontend.inline.InlineSidecar."""
    if not wait_while_held(config.paths):   # `kvhold pool-restart --wait-for-operator`
        return 0
    sidecar = (sidecar_class or Sidecar)(config)
    try:
        if spare:
            sidecar.wait_as_spare()
        sidecar.start()
        sidecar.serve_forever()
    finally:
        sidecar.close()
    if sidecar.pool_restart is not None and sidecar.pool_restart.drained:
        # a spare that took over is the owner: its new image starts the pool, never waits as a spare
        stop_if_asked("pool_restart_drained")
        return reexec(drop=(SPARE_FLAG,))   # returns only if the exec failed
    return 0
