"""The zygote: a process with torch and the engine imported, and no CUDA context, that
forks fresh executors on the sidecar's request.

An executor started cold spends most of its start-up importing Python and torch
(seconds on a GPU host). The zygote pays that once, in the background, and then
forks: a child starts with everything imported and creates its own CUDA context
after the fork. CUDA does not survive a fork once initialised, so the zygote
never initialises it (it checks, and refuses to serve if something did). Given the
executors' kernel shapes, it also compiles their Triton kernels for the GPU ahead of
time (kvhold.executor.triton_aot), so a child's first launches skip the JIT.

Protocol: the sidecar (our parent) connects to a SOCK_SEQPACKET socket in its
owner-only runtime directory and sends {"argv": [...], "env": {...}}; the zygote
forks and answers {"ok": true, "pid": N}. Only the sidecar's pid, checked by
SO_PEERCRED, is served; the reply also says how many threads the zygote had when
it forked. Children are not tied to the zygote's life: they watch
the sidecar (not the zygote) and outlive a zygote crash; the zygote reaps those
that exit while it lives, ZOMBIE_KEEP_S after they exit (until then the sidecar reads how
each died from its /proc stat), and logs their exit codes. The zygote exits when the
sidecar does.

Forking is safe only from a single-threaded process: a lock some other thread
held at the fork (malloc's, a thread pool's, the import lock) stays locked
forever in the child, which then deadlocks. The zygote's main thread is its only
thread by construction: it starts no thread of its own (a select loop, no zmq, no
logging thread) and runs no torch op (whose intra-op pool would start). Two
threads its preload would start are kept out: OpenBLAS's pool (numpy loads it,
one worker per core) is sized to none by `OPENBLAS_NUM_THREADS=1`, set by the
keeper before the zygote's interpreter starts (numpy BLAS in a forked executor is
single-threaded; the engine computes with torch), and NVML's thread (NVML tells
the Triton AOT the GPU's architecture; nvmlShutdown leaves its thread running) by
asking NVML in a short-lived child process. The zygote counts its threads (/proc/self/task) at
every fork request and refuses to fork while it has more than one, naming them:
the supervisor then starts that executor cold.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time

from kvhold.protocol import fdpass

log = logging.getLogger(__name__)
POLL_S = 0.5
ZOMBIE_KEEP_S = 2.0     # an exited child stays a zombie this long before it is reaped
TASK_DIR = "/proc/self/task"


def threads() -> list[str]:
    """This process's threads (kernel tasks), by name."""
    names = []
    for tid in sorted(os.listdir(TASK_DIR)):
        try:
            with open(f"{TASK_DIR}/{tid}/comm") as f:
                names.append(f"{tid}:{f.read().strip()}")
        except FileNotFoundError:       # it ended meanwhile
            pass
    return names


def preload(device: str, kernel_shapes=None) -> float:
    """Import what an executor needs before it attaches and, given the shapes its kernels
    will run at (kvhold.executor.kernel_shapes), compile its Triton kernels ahead of time
    (kvhold.executor.triton_aot); returns the time it took (ms)."""
    t0 = time.monotonic()
    import torch  # noqa: F401

    import kvhold.executor.engine_workload  # noqa: F401
    import kvhold.executor.recovery  # noqa: F401
    if device.startswith("cuda"):
        import kvhold.executor.cuda_attention  # noqa: F401
        import kvhold.executor.cuda_checksum  # noqa: F401
        import kvhold.executor.cuda_layers  # noqa: F401
        import kvhold.executor.cuda_runner  # noqa: F401
        from kvhold.executor import triton_aot
        if kernel_shapes is not None and os.environ.get("KVHOLD_TRITON_AOT", "1") != "0":
            arch = gpu_arch_in_a_child()
            if arch is None:
                log.warning("Triton AOT: GPU architecture unknown (no NVML, or mixed GPUs; set "
                            "KVHOLD_TRITON_AOT_ARCH): kernels take the JIT")
            else:
                triton_aot.prepare(kernel_shapes, arch=arch)
        if torch.cuda.is_initialized() or triton_aot.cuda_driver_initialised():
            raise RuntimeError("CUDA was initialised during preload: forked children would crash")
    return (time.monotonic() - t0) * 1e3


def gpu_arch_in_a_child(timeout_s: float = 60.0) -> int | None:
    """The GPU's architecture (kvhold.executor.triton_aot.gpu_arch), asked in a short-lived child
    process: NVML, which it reads, starts a thread in the process that initialises it, and
    nvmlShutdown does not end that thread. The zygote must stay a single thread."""
    code = "from kvhold.executor.triton_aot import gpu_arch; print(gpu_arch())"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=timeout_s, check=True, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("could not ask for the GPU architecture: %s", exc)
        return None
    lines = out.stdout.split()
    return int(lines[-1]) if lines and lines[-1].isdigit() else None


class Zygote:
    def __init__(self, socket_path: str, sidecar_pid: int):
        self.socket_path = socket_path
        self.sidecar_pid = sidecar_pid
        self.children: set[int] = set()
        self._exited: dict[int, float] = {}     # exited child -> when first seen so (a zombie kept)

    def serve(self) -> int:
        listener = fdpass.listen(self.socket_path)
        sidecar_fd = os.pidfd_open(self.sidecar_pid)
        log.info("zygote ready on %s", self.socket_path)
        try:
            while True:
                ready = select.select([listener, sidecar_fd], [], [], POLL_S)[0]
                self._reap()
                if sidecar_fd in ready:
                    log.info("sidecar exited; zygote exiting")
                    return 0
                if listener in ready:
                    conn, _ = listener.accept()
                    with conn:
                        self._serve_one(conn, listener)
        finally:
            listener.close()
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass

    def _serve_one(self, conn: socket.socket, listener: socket.socket) -> None:
        conn.settimeout(2.0)
        try:
            pid, _, _ = fdpass.peer_credentials(conn)
            request, stray = fdpass.recv(conn)
            for fd in stray:
                os.close(fd)
            if pid != self.sidecar_pid:
                log.warning("refused a fork request from pid %d (not the sidecar)", pid)
                fdpass.send(conn, {"ok": False, "error": "only the sidecar may ask"})
                return
            argv, env = request.get("argv"), request.get("env") or {}
            if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
                fdpass.send(conn, {"ok": False, "error": "argv must be a list of strings"})
                return
            running = threads()
            if len(running) != 1:
                log.error("not forking: the zygote has %d threads (%s); a fork now could leave the "
                          "child a lock no thread will release", len(running), ", ".join(running))
                fdpass.send(conn, {"ok": False, "error": f"the zygote has {len(running)} threads"})
                return
            child = os.fork()
            if child == 0:
                self._become_executor(argv, env, conn, listener)   # never returns
            self.children.add(child)
            fdpass.send(conn, {"ok": True, "pid": child, "threads": len(running)})
            log.info("forked executor pid %d", child)
        except (OSError, fdpass.FdPassError) as exc:
            log.warning("fork request failed: %s", exc)

    @staticmethod
    def _become_executor(argv: list[str], env: dict, conn, listener) -> None:
        code = 1
        try:
            conn.close()
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.environ.update({str(k): str(v) for k, v in env.items()})
            os.environ.pop("KVHOLD_PARENT_PID", None)   # our parent is the zygote: no PDEATHSIG
            from kvhold.executor.runtime import main
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            logging.getLogger("executor").exception("forked executor failed")
        finally:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def _reap(self) -> None:
        """Reap children that exited at least ZOMBIE_KEEP_S ago. Until then the zombie's /proc
        stat holds its wait status for the sidecar (which counts a death against a request only
        if it was a crash, not a kill from outside: kvhold.sidecar.request_deaths)."""
        now = time.monotonic()
        for pid in list(self.children):
            try:
                exited = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                self.children.discard(pid)
                self._exited.pop(pid, None)
                continue
            if exited is None:
                continue
            first = self._exited.setdefault(pid, now)
            if now - first < ZOMBIE_KEEP_S:
                continue
            try:
                _, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                status = 0
            self.children.discard(pid)
            self._exited.pop(pid, None)
            log.info("executor pid %d exited with code %d", pid, os.waitstatus_to_exitcode(status))


def _kernel_shapes(text: str):
    """Bad or missing shapes cost the ahead-of-time kernels, never the zygote."""
    if not text:
        return None
    from kvhold.executor.kernel_shapes import KernelShapes
    try:
        return KernelShapes.from_json(text)
    except Exception as exc:
        log.warning("ignoring --kernel-shapes (%s: %s): Triton kernels will be JIT-compiled in executors",
                    type(exc).__name__, exc)
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvhold.executor.zygote",
                                     description="Fork kvhold executors with torch already imported "
                                                 "(started by the sidecar with --zygote).")
    parser.add_argument("--socket", required=True, help="SOCK_SEQPACKET path to listen on")
    parser.add_argument("--sidecar-pid", type=int, required=True, help="the only pid served")
    parser.add_argument("--device", default="cpu", help="preload the CUDA kernels' modules for cuda:N")
    parser.add_argument("--kernel-shapes", default="",
                        help="JSON: the executors' settings and the table geometry (a KernelShapesRequest, "
                             "see kvhold.executor.kernel_shapes); their Triton kernels are then compiled here")
    parser.add_argument("--log-level", default=os.environ.get("KVHOLD_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    from kvhold.protocol.logs import setup_logging
    setup_logging(args.log_level, role="zygote")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ms = preload(args.device, _kernel_shapes(args.kernel_shapes))
    gc.freeze()     # children must not copy the preloaded heap on their first collection
    running = threads()
    log.info("preloaded torch and the engine in %.0f ms (%d thread%s)", ms, len(running),
             "" if len(running) == 1 else "s: " + ", ".join(running))
    return Zygote(args.socket, args.sidecar_pid).serve()


if __name__ == "__main__":
    sys.exit(main())
