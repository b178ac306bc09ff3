"""The zygote: a process with torch and the engine imported, and no CUDA context, that
forks fresh executors on the sidecar's request.

An executor started cold spends most of its start-up importing Python and torch
(seconds on a GPU host). The zygote pays that once, in the background, and then
forks: a child starts with everything imported and creates its own CUDA context
after the fork. CUDA does not survive a fork once initialised, so the zygote
never initialises it (it checks, and refuses to serve if something did). Given the
executors' kernel shapes, it also compiles their Triton kernels for the GPU ahead of
time (kvhold.executor.cuda.triton_aot), so a child's first launches skip the JIT.

Protocol: the sidecar (our parent) connects to a SOCK_SEQPACKET socket in its
owner-only runtime directory and sends {"argv": [...], "env": {...}}; the zygote
forks and answers {"ok": true, "pid": N}. Only the sidecar's pid, checked by
SO_PEERCRED, is served; the reply also says how many threads the zygote had when
it forked. Children are not tied to the zygote's life: they watch
the sidecar (not the zygote) and outlive a zygote crash; the zygote reaps those
that exit while it lives, ZOMBIE_KEEP_S after they exit (until then the sidecar reads how
each died from its /proc stat), and logs their exit codes. The zygote exits when the
sidecar does.

With `--spare`, the zygote keeps one child forked ahead of the next request (`Spare`):
the child makes its CUDA context, loads the prepared Triton kernels, runs the sampler's
and cuBLAS's first calls (each a module load under lazy loading) and waits on a pipe. A
fork request is then handed to it (the reply says `spare`), and the next spare is forked
SPARE_DELAY_S later, so that its start does not compete with the replacement's. A request
whose environment changes a CUDA variable the spare was started with gets a fresh fork.
A spare costs its context's GPU memory; one that dies is replaced, up to SPARE_FAILURES
in a row. The zygote's own process never touches CUDA.

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
import json
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
# the next spare is forked this long after one was handed a request: the replacement has taken
# over and run its first steps by then (~0.2-0.6 s on the H200), and the spare is warm about
# 0.8 s later, so a kill two seconds after the last one finds one
SPARE_DELAY_S = 1.0
SPARE_FAILURES = 3      # spares that die before their request, in a row, before none is made
CUDA_ENV = ("CUDA_", "NVIDIA_", "PYTORCH_CUDA", "TORCH_CUDA")   # set at a CUDA context's creation


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
    will run at (kvhold.executor.cuda.kernel_shapes), compile its Triton kernels ahead of time
    (kvhold.executor.cuda.triton_aot); returns the time it took (ms)."""
    t0 = time.monotonic()
    import torch  # noqa: F401

    import kvhold.executor.engine_workload  # noqa: F401
    import kvhold.executor.recovery  # noqa: F401
    if device.startswith("cuda"):
        import kvhold.executor.cuda.attention  # noqa: F401
        import kvhold.executor.cuda.checksum  # noqa: F401
        import kvhold.executor.cuda.layers  # noqa: F401
        import kvhold.executor.cuda.runner  # noqa: F401
        from kvhold.executor.cuda import triton_aot
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
    """The GPU's architecture (kvhold.executor.cuda.triton_aot.gpu_arch), asked in a short-lived child
    process: NVML, which it reads, starts a thread in the process that initialises it, and
    nvmlShutdown does not end that thread. The zygote must stay a single thread."""
    code = "from kvhold.executor.cuda.triton_aot import gpu_arch; print(gpu_arch())"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=timeout_s, check=True, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("could not ask for the GPU architecture: %s", exc)
        return None
    lines = out.stdout.split()
    return int(lines[-1]) if lines and lines[-1].isdigit() else None


def warm_spare(device: str, kernel_shapes) -> dict[str, float]:
    """What a spare child does before its request (ms per part): on CUDA, make the context,
    load the prepared Triton kernels, and make the first calls of the sampler's operations at
    a decode step's shape and of cuBLAS. Nothing of it touches the sidecar's memory."""
    phases: dict[str, float] = {}
    if not device.startswith("cuda"):
        return phases
    import torch

    from kvhold.executor.cuda import triton_aot
    from kvhold.executor.sampler import sample
    from kvhold.executor.sequence import Sequence
    from kvhold.protocol.sampling import SamplingParams

    t = [time.monotonic()]

    def lap(name: str) -> None:
        torch.cuda.synchronize()
        now = time.monotonic()
        phases[name] = round((now - t[0]) * 1e3, 2)
        t[0] = now

    dev = torch.device(device)
    torch.cuda.init()
    torch.cuda.set_device(dev)
    torch.zeros(1, device=dev)
    lap("cuda_context")
    phases["triton_kernels_loaded"] = triton_aot.load_all(torch.cuda.current_device())
    lap("triton_modules")
    if kernel_shapes is not None:
        rows, vocab = kernel_shapes.max_batch, kernel_shapes.vocab_size
        logits = torch.randn(rows, vocab, device=dev)
        for temperature in (0.0, 0.8):
            seqs = [Sequence(slot=-1, request_id=0, prompt_len=1, tokens=[0], sampling=SamplingParams(
                        max_tokens=1, seed=i, temperature=temperature, top_p=0.9, top_k=40, ignore_eos=True))
                    for i in range(rows)]
            sample(logits, seqs, pad_rows=rows)
            sample(logits[:2], seqs[:2])
        del logits
        lap("sampler")
        x = torch.randn(16, kernel_shapes.hidden_size, device=dev, dtype=kernel_shapes.torch_dtype)
        torch.nn.functional.linear(x, x)
        lap("cublas")
    torch.cuda.empty_cache()
    return phases


class Spare:
    """A child forked ahead of the next request, warming up, then waiting for it on a pipe."""

    def __init__(self, pid: int, request_fd: int, ready_fd: int, env: dict[str, str]):
        self.pid = pid
        self.request_fd = request_fd      # the zygote writes the request here
        self.ready_fd = ready_fd          # the spare writes its warm-up parts here once warm
        self.env = env                    # the environment it made its context with
        self.warm: dict | None = None     # its warm-up parts, once it said so

    def takes(self, env: dict) -> bool:
        """Whether a request with `env` may run in this spare (same CUDA environment)."""
        keys = {k for k in (*env, *self.env) if k.startswith(CUDA_ENV)}
        return all(str(env.get(k, self.env.get(k))) == str(self.env.get(k)) for k in keys)

    def read_ready(self) -> None:
        try:
            data = os.read(self.ready_fd, 65536)
        except OSError:
            data = b""
        if data:
            try:
                self.warm = json.loads(data.decode())
            except ValueError:
                self.warm = {"unreadable": True}
        self.close_ready()

    def close_ready(self) -> None:
        if self.ready_fd >= 0:
            os.close(self.ready_fd)
            self.ready_fd = -1

    def hand(self, argv: list[str], env: dict) -> None:
        """Give it its request: it becomes an executor."""
        try:
            os.write(self.request_fd, json.dumps({"argv": argv, "env": env}).encode())
        finally:
            os.close(self.request_fd)
            self.request_fd = -1
        self.close_ready()

    def close(self) -> None:
        for fd in (self.request_fd, self.ready_fd):
            if fd >= 0:
                os.close(fd)
        self.request_fd = self.ready_fd = -1

    def discard(self) -> None:
        """Kill it (never handed a request) and reap it."""
        self.close()
        if self.pid <= 0:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


class Zygote:
    def __init__(self, socket_path: str, sidecar_pid: int, spare_device: str | None = None,
                 kernel_shapes=None):
        self.socket_path = socket_path
        self.sidecar_pid = sidecar_pid
        self.children: set[int] = set()
        self._exited: dict[int, float] = {}     # exited child -> when first seen so (a zombie kept)
        self.spare_device = spare_device        # None: no spare
        self.kernel_shapes = kernel_shapes
        self.spare: Spare | None = None
        self.spare_due = time.monotonic()       # when the next spare may be forked
        self.spare_failures = 0

    def serve(self) -> int:
        listener = fdpass.listen(self.socket_path)
        sidecar_fd = os.pidfd_open(self.sidecar_pid)
        log.info("zygote ready on %s%s", self.socket_path, " (keeps a spare)" if self.spare_device else "")
        try:
            while True:
                self._keep_spare(listener)
                watched = [listener, sidecar_fd]
                if self.spare is not None and self.spare.ready_fd >= 0:
                    watched.append(self.spare.ready_fd)
                ready = select.select(watched, [], [], POLL_S)[0]
                self._reap()
                if sidecar_fd in ready:
                    log.info("sidecar exited; zygote exiting")
                    return 0
                if self.spare is not None and self.spare.ready_fd in ready:
                    self.spare.read_ready()
                    log.info("spare pid %d warm: %s", self.spare.pid, self.spare.warm)
                if listener in ready:
                    conn, _ = listener.accept()
                    with conn:
                        self._serve_one(conn, listener)
        finally:
            if self.spare is not None:
                self.spare.discard()
                self.spare = None
            listener.close()
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass

    # ------------------------------------------------------------------ the spare
    def _keep_spare(self, listener) -> None:
        if (self.spare_device is None or self.spare is not None or time.monotonic() < self.spare_due
                or self.spare_failures >= SPARE_FAILURES):
            return
        if len(threads()) != 1:
            return                      # never fork while another thread runs (module docstring)
        request_r, request_w = os.pipe()
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(request_w)
            os.close(ready_r)
            self._become_spare(request_r, ready_w, listener)      # never returns
        os.close(request_r)
        os.close(ready_w)
        self.spare = Spare(pid, request_w, ready_r, dict(os.environ))
        log.info("forked spare pid %d", pid)

    def _become_spare(self, request_fd: int, ready_fd: int, listener) -> None:
        code = 1
        try:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            t0 = time.monotonic()
            phases = warm_spare(self.spare_device, self.kernel_shapes)
            phases["total_ms"] = round((time.monotonic() - t0) * 1e3, 2)
            try:
                os.write(ready_fd, json.dumps(phases).encode())
            except OSError:
                pass                    # handed a request before it was warm: nobody reads this
            os.close(ready_fd)
            chunks = []
            while chunk := os.read(request_fd, 1 << 20):      # until the zygote closes its end
                chunks.append(chunk)
            os.close(request_fd)
            if not chunks:
                os._exit(0)             # the zygote went away, or discarded us
            request = json.loads(b"".join(chunks).decode())
            self._become_executor(request["argv"], request.get("env") or {}, None, None)   # never returns
        except BaseException:
            logging.getLogger("executor").exception("zygote spare failed")
        finally:
            os._exit(code)

    def _hand_to_spare(self, argv: list[str], env: dict) -> Spare | None:
        """The spare that took the request, or None (none, or it cannot take this one)."""
        spare = self.spare
        if spare is None:
            return None
        if not spare.takes(env):
            log.info("spare pid %d discarded: the request changes its CUDA environment", spare.pid)
            spare.discard()
            self.spare = None
            return None
        try:
            spare.hand(argv, env)
        except OSError as exc:          # it died meanwhile: _reap counts it
            log.warning("spare pid %d could not take the request: %s", spare.pid, exc)
            return None
        self.spare = None
        self.spare_failures = 0
        self.spare_due = time.monotonic() + SPARE_DELAY_S
        self.children.add(spare.pid)
        return spare

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
            spare = self._hand_to_spare(argv, env)
            if spare is not None:
                fdpass.send(conn, {"ok": True, "pid": spare.pid, "threads": len(running), "spare": True,
                                   "spare_warm": spare.warm})
                log.info("handed the request to spare pid %d (warm: %s)", spare.pid, spare.warm)
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
            for sock in (conn, listener):
                if sock is not None:
                    sock.close()
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
        spare = self.spare
        if spare is not None:
            try:
                died = os.waitpid(spare.pid, os.WNOHANG)[0] == spare.pid
            except ChildProcessError:
                died = True
            if died:               # reaped above
                self.spare = None
                spare.close()
                self.spare_failures += 1
                self.spare_due = now + SPARE_DELAY_S
                log.warning("spare died before its request (%d in a row)%s", self.spare_failures,
                            "; no more spares" if self.spare_failures >= SPARE_FAILURES else "")
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
    from kvhold.executor.cuda.kernel_shapes import KernelShapes
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
                             "see kvhold.executor.cuda.kernel_shapes); their Triton kernels are then compiled here")
    parser.add_argument("--spare", action="store_true",
                        help="keep one child forked ahead, warmed up (CUDA context, kernels, sampler), "
                             "and hand it the next request")
    parser.add_argument("--log-level", default=os.environ.get("KVHOLD_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    from kvhold.protocol.logs import setup_logging
    setup_logging(args.log_level, role="zygote")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    shapes = _kernel_shapes(args.kernel_shapes)
    ms = preload(args.device, shapes)
    gc.freeze()     # children must not copy the preloaded heap on their first collection
    running = threads()
    log.info("preloaded torch and the engine in %.0f ms (%d thread%s)", ms, len(running),
             "" if len(running) == 1 else "s: " + ", ".join(running))
    return Zygote(args.socket, args.sidecar_pid, args.device if args.spare else None, shapes).serve()


if __name__ == "__main__":
    sys.exit(main())
