"""The sidecar's side of the zygote (see kvhold.executor.zygote): start it, ask it to fork, restart it.

The zygote is an optimisation, never a dependency: while it is starting (importing
torch takes seconds), dead, or slow to answer, `fork()` returns None and the
supervisor starts the executor cold instead. Only a sidecar's first executors wait
for it (`starting`, at most FIRST_WAIT_NS): started cold beside it, each would import
torch again, and the sidecar is ready no sooner. A zygote that dies is restarted,
no sooner than `RESTART_DELAY_NS` after the previous start. The keeper gets the
socket path, the device, the event loop (to watch the zygote's pidfd) and the
settings and table geometry executors will run with (for the kernel shapes).
With `spare`, the zygote keeps a child forked and warmed ahead of the next request
(kvhold.executor.zygote, `Spare`). The zygote is started with `OPENBLAS_NUM_THREADS=1`, so that importing numpy starts
no BLAS threads in it: it must stay single-threaded to fork safely.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys

from kvhold.protocol import fdpass
from kvhold.protocol.settings import KernelShapesRequest

log = logging.getLogger(__name__)
FORK_TIMEOUT_S = 1.0
RESTART_DELAY_NS = 2_000_000_000
FIRST_WAIT_NS = 30_000_000_000   # a sidecar's first executors wait this long at most for the zygote


class ZygoteKeeper:
    def __init__(self, socket_path, device: str, loop, settings: dict, geometry, spare: bool = False):
        self.socket_path = str(socket_path)
        self.device = device
        self.loop = loop                  # watch_fd / unwatch_fd (kvhold.sidecar.event_loop)
        self.settings = settings
        self.geometry = geometry
        self.popen: subprocess.Popen | None = None
        self.pidfd = -1
        self.started_ns = 0
        self.forks = 0
        self.threads_at_fork: int | None = None   # the zygote's thread count at its last fork
        self.spare = spare                # the zygote keeps a warmed child for the next request
        self.spare_forks = 0              # requests a warmed spare took
        self.last_spare: dict | None = None   # the last spare handed a request: its warm-up parts
        self.restarts = -1

    # ------------------------------------------------------------------ lifecycle
    def keep_alive(self, now: int) -> None:
        if self.popen is None and now - self.started_ns >= RESTART_DELAY_NS:
            self._start(now)

    def _start(self, now: int) -> None:
        try:
            os.unlink(self.socket_path)          # a dead zygote's socket: nobody listens there
        except FileNotFoundError:
            pass
        cmd = [sys.executable, "-m", "kvhold.executor.zygote", "--socket", self.socket_path,
               "--sidecar-pid", str(os.getpid()), "--device", self.device,
               "--kernel-shapes", self._kernel_shapes(), *(["--spare"] if self.spare else []),
               "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel())]
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1")   # no BLAS thread pool: forks stay safe
        self.popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, close_fds=True, env=env)
        self.pidfd = os.pidfd_open(self.popen.pid)
        self.loop.watch_fd(self.pidfd, self._on_exit)
        self.started_ns = now
        self.restarts += 1
        log.info("started zygote pid %d", self.popen.pid)

    def starting(self, now: int) -> bool:
        """Whether the zygote is alive and still getting ready (importing torch, compiling kernels),
        for at most FIRST_WAIT_NS since its start: a sidecar's first executors wait for it rather
        than each importing torch themselves beside it."""
        return (self.popen is not None and not os.path.exists(self.socket_path)
                and now - self.started_ns < FIRST_WAIT_NS)

    def _kernel_shapes(self) -> str:
        """What executors will run their kernels at (kvhold.executor.cuda.kernel_shapes.from_settings), so
        the zygote can compile them before forking: their settings plus the table geometry."""
        try:
            return KernelShapesRequest(self.settings, self.geometry).to_json()
        except (AttributeError, TypeError, ValueError) as exc:    # an optimisation: never fatal
            log.warning("zygote gets no kernel shapes (%s): executors JIT-compile Triton kernels", exc)
            return ""

    def _on_exit(self) -> None:
        self.loop.unwatch_fd(self.pidfd)
        os.close(self.pidfd)
        code = self.popen.wait()
        log.warning("zygote pid %d exited with code %d; executors start cold until it is back",
                    self.popen.pid, code)
        self.popen, self.pidfd = None, -1

    def stop(self) -> None:
        if self.popen is None:
            return
        self.loop.unwatch_fd(self.pidfd)
        self.popen.send_signal(signal.SIGTERM)
        if not select.select([self.pidfd], [], [], 2.0)[0]:
            self.popen.kill()
        self.popen.wait()
        os.close(self.pidfd)
        self.popen, self.pidfd = None, -1
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ forking
    def fork(self, argv: list[str], env: dict[str, str]) -> int | None:
        """The pid of a freshly forked executor, or None when the zygote cannot serve now."""
        if self.popen is None or not os.path.exists(self.socket_path):
            return None
        try:
            conn = fdpass.connect(self.socket_path, timeout=FORK_TIMEOUT_S)
        except OSError:
            return None                           # still importing torch, or just died
        try:
            fdpass.send(conn, {"argv": argv, "env": env})
            reply, stray = fdpass.recv(conn)
            for fd in stray:
                os.close(fd)
        except (OSError, fdpass.FdPassError) as exc:
            log.warning("zygote fork request failed: %s; starting cold", exc)
            return None
        finally:
            conn.close()
        if not reply.get("ok") or not isinstance(reply.get("pid"), int):
            log.warning("zygote refused to fork: %s; starting cold", reply.get("error"))
            return None
        self.forks += 1
        self.threads_at_fork = reply.get("threads")
        if reply.get("spare"):
            self.spare_forks += 1
            self.last_spare = {"pid": reply["pid"], "warm": reply.get("spare_warm")}
            log.info("zygote handed the request to its spare pid %d (warm: %s)", reply["pid"],
                     reply.get("spare_warm"))
        return reply["pid"]

    def status(self) -> dict:
        return {"pid": self.popen.pid if self.popen else None,
                "ready": self.popen is not None and os.path.exists(self.socket_path),
                "forks": self.forks, "threads_at_fork": self.threads_at_fork,
                "spare": self.spare, "spare_forks": self.spare_forks, "last_spare": self.last_spare,
                "restarts": max(0, self.restarts)}
