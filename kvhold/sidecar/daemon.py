"""The sidecar process: owns memory and tables, supervises executors, serves clients.

One thread, one poll loop over: the executor control socket (ZeroMQ ROUTER), the
client socket (ROUTER), the descriptor socket (SOCK_SEQPACKET listener), every
executor's pidfd, and a signal wake-up pipe. Deadlines (heartbeat leases,
keepalives, re-spawn backoff) set the poll timeout. No handler blocks: a bad
message gets an error reply and the loop goes on; only a broken invariant of the
sidecar itself ends it, loudly. SIGTERM/SIGINT stop executors, write the requests
still in flight to the durable journal (kvhold.sidecar.durable_journal: the next start brings
them back) and unlink every shm object, socket and file the sidecar created. A pool
restart (kvhold.sidecar.pool_restart, kvhold.sidecar.restore) does the same, then re-execs in place.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import secrets
import signal
import socket
import sys

import zmq

from kvhold.protocol import fdpass, messages as m, wire
from kvhold.protocol.checkpoint import build_manifest
from kvhold.protocol.errors import ErrorCode
from kvhold.protocol.leases import now_ns
from kvhold.protocol.memory import CudaRegion, HostRegion
from kvhold.protocol.model_spec import ModelSpec
from kvhold.protocol.page_map import page_map
from kvhold.protocol.tables import Tables
from kvhold.sidecar.config import SidecarConfig
from kvhold.sidecar.frontend import Frontend
from kvhold.sidecar.health_responder import HealthResponder
from kvhold.sidecar.durable_journal import DurableJournal
from kvhold.sidecar.instance_lock import InstanceLock
from kvhold.sidecar.pool_restart import PoolRestart, journal_in_flight, reexec, wait_while_held
from kvhold.sidecar.restore import Restore
from kvhold.sidecar.supervisor import Supervisor
from kvhold.sidecar.tcp_endpoint import TcpClientEndpoint
from kvhold.sidecar.weights_keeper import WeightsKeeper

log = logging.getLogger(__name__)
GIL_SWITCH_S = 0.0002
SHM_PARTS = ("tables", "kv", "weights")


class Sidecar:
    def __init__(self, config: SidecarConfig):
        self.config = config
        self.paths = config.paths
        self.spec: ModelSpec | None = None
        self.manifest = None
        self._fd_callbacks: dict[int, callable] = {}
        self._identities: dict[bytes, object] = {}
        self._stop = False
        self._created_token = False
        self.tcp: TcpClientEndpoint | None = None
        self.registrar = None             # kvhold.sidecar.registry.Registrar with --registry
        self.started_ns = now_ns()

    # ------------------------------------------------------------------ start-up
    def start(self) -> "Sidecar":
        os.umask(0o077)
        # The death watcher threads need the GIL the moment the kernel wakes them; the default
        # 5 ms switch interval would let a busy loop iteration delay every failover by that much.
        sys.setswitchinterval(GIL_SWITCH_S)
        cfg = self.config
        if cfg.model is not None:
            self.spec = ModelSpec.from_dir(cfg.model)
            self.manifest = build_manifest(cfg.model, self.spec)
        geometry = cfg.table_geometry(self.spec)
        self.lock = InstanceLock(self.paths)
        self.lock.remove_stale(SHM_PARTS)
        self.durable = DurableJournal(cfg.journal_path)
        generation = self._next_generation()
        self.tables = Tables.create(self.paths.shm_name("tables"), geometry, generation)
        self.regions = self._create_regions(geometry)
        self.token, self.token_path = self._load_token()
        self.executor_settings = cfg.executor_settings(self.spec)
        self.weights = WeightsKeeper(self.tables, self.manifest)
        self.supervisor = Supervisor(self)
        self.frontend = Frontend(self)
        self.pool_restart = PoolRestart(self)
        self.restore = Restore(self)
        self.restore.restore()          # the previous pool's journaled requests, before any executor
        self._open_sockets()
        self.health = HealthResponder(self).start()
        self._write_state_file()
        log.info("sidecar %r generation %d ready: %d KV pages of %d tokens (%.1f MiB), tables %.2f MiB "
                 "(%.3f%% of the pool)", self.paths.instance, generation, geometry.num_pages,
                 geometry.kv.page_tokens, geometry.kv_pool_bytes / 2**20, geometry.total_bytes / 2**20,
                 100 * geometry.metadata_fraction)
        self.supervisor.rearm(now_ns())
        if self.config.registry:        # its thread only reads a status snapshot
            from kvhold.sidecar.registry import start_registrar
            self.registrar = start_registrar(self)
        return self

    def _create_regions(self, geometry) -> dict:
        sizes = {"kv": geometry.kv_pool_bytes}
        if self.manifest is not None:
            sizes["weights"] = self.manifest.region_bytes
        regions = {}
        if self.config.backend == "cuda":
            device = int(self.config.device.partition(":")[2] or 0)
            for index, (name, size) in enumerate(sizes.items()):
                regions[name] = CudaRegion(name, size, device, index)
        else:
            for name, size in sizes.items():
                regions[name] = HostRegion(self.paths.shm_name(name), name, size)
        return regions

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

    def _load_token(self) -> tuple[str, os.PathLike]:
        path = self.config.token_file or self.paths.token_file
        if self.config.token_file is not None:
            st = os.stat(path)
            if st.st_mode & 0o077:
                raise PermissionError(f"token file {path} is readable by others; chmod 600 it")
            return path.read_text().strip(), path
        token = secrets.token_hex(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        self._created_token = True
        return token, path

    def _open_sockets(self) -> None:
        self.zctx = zmq.Context()
        self.control = self._router(self.paths.control_endpoint, self.paths.control_socket)
        self.client = self._router(self.paths.client_endpoint, self.paths.client_socket)
        if self.config.client_tcp:
            self.tcp = TcpClientEndpoint(self.config)
        # A client is known to the frontend by transport + routing id: no TCP peer can pose as
        # a local one (or the reverse) by choosing the same routing id.
        self._client_sockets = {b"u": self.client}
        if self.tcp is not None:
            self._client_sockets[b"t"] = self.tcp.socket
        self.fd_listener = fdpass.listen(str(self.paths.fd_socket))
        self.fd_listener.setblocking(False)
        self._sig_r, self._sig_w = socket.socketpair()
        self._sig_r.setblocking(False)
        self._sig_w.setblocking(False)
        signal.set_wakeup_fd(self._sig_w.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self.poller = zmq.Poller()
        self.poller.register(self.control, zmq.POLLIN)
        self.poller.register(self.client, zmq.POLLIN)
        if self.tcp is not None:
            self.tcp.register(self.poller)
        self.watch_fd(self.fd_listener.fileno(), self._accept_fd_request)
        self.watch_fd(self._sig_r.fileno(), self._drain_signals)
        self._posted: queue.SimpleQueue = queue.SimpleQueue()
        self._post_r, self._post_w = socket.socketpair()
        self._post_r.setblocking(False)
        self.watch_fd(self._post_r.fileno(), self._run_posted)

    def _router(self, endpoint: str, path) -> zmq.Socket:
        sock = self.zctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.bind(endpoint)
        os.chmod(path, 0o600)
        return sock

    def _write_state_file(self) -> None:
        state = {"pid": os.getpid(), "generation": self.tables.generation,
                 "client_endpoint": self.paths.client_endpoint,
                 "client_tcp": self.tcp.status() if self.tcp else None,
                 "tables": self.paths.shm_name("tables"),
                 "model": str(self.config.model) if self.config.model else None}
        self.paths.state_file.write_text(json.dumps(state) + "\n")

    # ------------------------------------------------------------------ fd plumbing
    def watch_fd(self, fd: int, callback) -> None:
        self._fd_callbacks[fd] = callback
        self.poller.register(fd, zmq.POLLIN)

    def unwatch_fd(self, fd: int) -> None:
        if self._fd_callbacks.pop(fd, None) is not None:
            self.poller.unregister(fd)

    def region_infos(self, writable_weights: bool = False) -> list[dict]:
        infos = [{"name": "tables", "size": self.tables.geometry.total_bytes, "backend": "host",
                  "readonly": False}]
        for name, region in self.regions.items():
            infos.append(region.info(readonly=name == "weights" and not writable_weights).to_wire())
        return infos

    def export_region_fds(self, writable_weights: bool) -> tuple[list[str], list[int]]:
        names, fds = ["tables"], [os.dup(self.tables.fd)]
        for name, region in self.regions.items():
            names.append(name)
            fds.append(region.export_fd(readonly=name == "weights" and not writable_weights))
        return names, fds

    def _accept_fd_request(self) -> None:
        try:
            conn, _ = self.fd_listener.accept()
        except BlockingIOError:
            return
        conn.settimeout(0.5)
        self.supervisor.on_fd_request(conn)

    def post(self, callback) -> None:
        """Run `callback` on the loop thread soon; safe to call from any thread."""
        self._posted.put(callback)
        try:
            self._post_w.send(b"!")
        except (BlockingIOError, OSError):
            pass  # the loop is already due to wake

    def _run_posted(self) -> None:
        try:
            while self._post_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                callback = self._posted.get_nowait()
            except queue.Empty:
                return
            callback()

    def _on_signal(self, signum, frame) -> None:
        self._stop = True

    def _drain_signals(self) -> None:
        try:
            while self._sig_r.recv(64):
                pass
        except BlockingIOError:
            pass

    # ------------------------------------------------------------------ executor channel
    def register_executor_identity(self, identity: bytes, handle) -> None:
        self._identities[identity] = handle

    def forget_executor_identity(self, identity: bytes | None) -> None:
        self._identities.pop(identity, None)

    def send_executor(self, handle, msg) -> None:
        if handle.identity is None:
            return
        try:
            self.control.send_multipart([handle.identity, wire.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not send %s to executor pid %d: %s", msg.TYPE, handle.pid, exc)

    def _reply(self, sock: zmq.Socket, identity: bytes, msg) -> None:
        try:
            sock.send_multipart([identity, wire.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("dropped %s reply: %s", msg.TYPE, exc)

    def _decode(self, sock: zmq.Socket, identity: bytes, frame: bytes, allowed, what: str):
        """The message, or None after an error reply: a bad frame never reaches a handler."""
        try:
            return wire.decode(frame, allowed)
        except wire.WireError as exc:
            log.warning("bad %s message: %s (%s)", what, exc, exc.code.name)
            self._reply(sock, identity, m.Error(code=exc.code, message=str(exc)))
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
        m.WeightsLoading: lambda self, h, msg: None,
        m.WeightsSealed: lambda self, h, msg: self.weights.on_sealed(h, msg),
        m.StepDone: lambda self, h, msg: self.frontend.on_step(h, msg),
        m.Recovered: lambda self, h, msg: self._on_recovered(h, msg),
    }

    def _on_recovered(self, h, msg) -> None:
        self.frontend.on_recovered(h, msg)
        self.supervisor.takeover_done()

    def _on_client(self, identity: bytes, frame: bytes, via: bytes = b"u") -> None:
        sock = self._client_sockets[via]
        msg = self._decode(sock, identity, frame, m.CLIENT_IN, "client")
        if msg is None:
            return
        try:
            reply = self.frontend.handle(via + identity, msg)
        except Exception as exc:  # a bug on one request must not stop the service
            log.exception("internal error handling %s", msg.TYPE)
            reply = m.Error(code=ErrorCode.INTERNAL, message=f"internal error: {type(exc).__name__}",
                            tag=getattr(msg, "tag", 0))
        if reply is not None:
            self._reply(sock, identity, reply)

    def send_client(self, client_key: bytes, msg) -> None:
        """Send to a client as the frontend knows it: transport byte + routing id."""
        self._reply(self._client_sockets[client_key[:1]], client_key[1:], msg)

    # ------------------------------------------------------------------ loop
    def _drain(self, sock: zmq.Socket, handler, budget: int = 256) -> None:
        for _ in range(budget):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(frames) != 2:
                log.warning("dropped a %d-frame message (expected identity + body)", len(frames))
                continue
            handler(frames[0], frames[1])

    def serve_forever(self) -> None:
        while not self._stop and not self.pool_restart.draining:
            self.run_once()
            if self.pool_restart.due:
                self.pool_restart.start_drain()   # close() then stops executors and journals
        log.info("stopping on request")

    def run_once(self) -> None:
        now = now_ns()
        deadline = min(self.supervisor.next_deadline_ns(), self.frontend.next_deadline_ns())
        timeout_ms = max(0, -(-(deadline - now) // 1_000_000))
        events = dict(self.poller.poll(min(timeout_ms, 1000)))
        for fd in [fd for fd in events if isinstance(fd, int)]:
            callback = self._fd_callbacks.get(fd)
            if callback is not None:
                callback()
        if self.control in events:
            self._drain(self.control, self._on_control)
        if self.client in events:
            self._drain(self.client, self._on_client)
        if self.tcp is not None:
            self.tcp.on_events(events)
            if self.tcp.socket in events:
                self._drain(self.tcp.socket, lambda ident, frame: self._on_client(ident, frame, b"t"))
        now = now_ns()
        self.supervisor.check_heartbeats(now)
        self.supervisor.rearm(now)
        self.frontend.tick(now)

    def status(self) -> dict:
        from kvhold.protocol.page_table import PageTable

        return {"instance": self.paths.instance, "pid": os.getpid(),
                "generation": self.tables.generation,
                "uptime_s": (now_ns() - self.started_ns) / 1e9,
                "weights": {"state": self.weights.state.name.lower(),
                            "fingerprint": self.weights.fingerprint, "load_ms": self.weights.load_ms},
                "executors": self.supervisor.status(),
                "zygote": self.supervisor.zygote.status() if self.supervisor.zygote else None,
                "takeover": self.config.takeover,
                "health": self.health.status(),
                "pages": PageTable(self.tables).counts(),
                "page_map": page_map(PageTable(self.tables).snapshot()),
                "client_tcp": self.tcp.status() if self.tcp else None,
                "registry": self.registrar.status() if self.registrar else None,
                "events": list(self.supervisor.events)[-64:],
                "pool_restart": self.restore.status(),
                **self.frontend.status()}

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stop executors, then remove everything this sidecar created."""
        if self.registrar is not None:   # first: routers stop sending here at once
            self.registrar.stop()
        if getattr(self, "health", None) is not None:
            self.health.stop()
        if getattr(self, "supervisor", None) is not None:
            self.supervisor.stop_all()
        self._journal_on_stop()
        for sock in ("control", "client"):
            if hasattr(self, sock):
                getattr(self, sock).close(0)
        if self.tcp is not None:
            self.tcp.close()
        if hasattr(self, "zctx"):
            self.zctx.term()
        if hasattr(self, "fd_listener"):
            self.fd_listener.close()
            signal.set_wakeup_fd(-1)
        for region in getattr(self, "regions", {}).values():
            region.unlink()
        if getattr(self, "tables", None) is not None:
            self.tables.unlink()
        for path in (self.paths.control_socket, self.paths.client_socket, self.paths.fd_socket,
                     self.paths.state_file):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        if self._created_token:
            self.paths.token_file.unlink(missing_ok=True)
        if getattr(self, "lock", None) is not None:
            self.lock.release()
        log.info("sidecar %r stopped and cleaned up", self.paths.instance)


    def _journal_on_stop(self) -> None:
        """A stop (SIGTERM) keeps in-flight requests too: the next start brings them back."""
        pool_restart = getattr(self, "pool_restart", None)
        if pool_restart is None:
            return
        try:
            if pool_restart.draining:
                pool_restart.finish_drain()
                return
            n = journal_in_flight(self.frontend, self.durable)
            if n:
                log.warning("%d in-flight requests journaled to %s for the next start", n, self.durable.dir)
        except Exception:
            log.exception("could not journal the in-flight requests")


def run_sidecar(config: SidecarConfig) -> int:
    if not wait_while_held(config.paths):   # `kvhold pool-restart --wait-for-operator`
        return 0
    sidecar = Sidecar(config)
    try:
        sidecar.start()
        sidecar.serve_forever()
    finally:
        sidecar.close()
    if getattr(sidecar, "pool_restart", None) is not None and sidecar.pool_restart.drained:
        return reexec()                     # returns only if the exec failed
    return 0
