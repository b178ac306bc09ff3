"""The executor process: attach, map, warm up, then serve as standby or active.

Life of an executor: attach with the token and get a lease (slot, epoch) and its
settings (kvhold.protocol.settings.ExecutorSettings); fetch the region descriptors;
map tables, KV pool and weights; prepare the workload (kvhold.executor.workload: load
or verify weights, warm up); report ready (the sidecar makes it a standby); on
`promote`, take over the page table and journal (recovery) and run steps until
shutdown. The main loop writes the heartbeat; a hung loop therefore stops
beating and the sidecar fences it. Every beat checks the epoch: a fenced
executor exits with code 75 instead of writing. So does one the sidecar refuses as fenced
(a message sent under an epoch fenced since its last check: a stop in between), and one that
fails in any other way once its lease was taken: the lease is gone whatever it met on waking.

If the sidecar dies (its pidfd turns readable), the executor does not: its mappings keep
the pool's memory alive. It publishes the commit its last step left pending, then stops
stepping and waits (`sidecar_wait_ms`, still beating, so a fence by the next sidecar is
seen) for a sidecar of the same instance to adopt the tables: one that wrote its own pid
into the table header (kvhold.sidecar.adoption). It then attaches again on the same
control socket path with its pid; the new sidecar answers with the same lease (slot,
epoch), and the executor carries on in its role with its batch, KV and weights as they
were. A sidecar that does not adopt it, or no sidecar within the wait, ends it
(EXIT_SIDECAR_GONE). With `sidecar_wait_ms` 0 it exits with the sidecar (pidfd, and
PR_SET_PDEATHSIG when the sidecar spawned it). Before it attaches again it hands the new
sidecar a dup of every region descriptor it received, kept open for this
(kvhold.protocol.hand_back): CUDA VMM memory has no name to open it by, and a received
descriptor is itself the shareable handle, so the new sidecar builds its regions from them.
"""
from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvhold.protocol import messages as m
from kvhold.protocol.errors import FencedError
from kvhold.protocol.leases import Fenced, Lease
from kvhold.protocol.memory import Mapping, RegionInfo, map_region
from kvhold.protocol.naming import InstancePaths
from kvhold.protocol.procfs import pid_alive
from kvhold.protocol.settings import ExecutorSettings
from kvhold.protocol.tables import Tables
from kvhold.executor import faults
from kvhold.executor.channel import Channel
from kvhold.executor.cuda.compile_watch import CompileWatch
from kvhold.executor.workload import Workload
from kvhold.protocol.logs import set_log_context

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_SIDECAR_GONE = 69
EXIT_FENCED = 75
EXIT_CUDA_FAULT = 70      # the device context faulted (an illegal address, a kernel's trap)
SIDECAR_POLL_S = 0.01         # while waiting for a new sidecar: how often the header is read
REATTACH_TIMEOUT_MS = 30_000   # an adopting sidecar's answer to the attach after the hand-back


def is_device_fault(exc: BaseException) -> bool:
    """A CUDA error raised at a synchronisation: the context is lost, every later call fails."""
    accel = getattr(sys.modules.get("torch"), "AcceleratorError", None)   # torch >= 2.8
    if accel is not None and isinstance(exc, accel):
        return True
    return isinstance(exc, RuntimeError) and "CUDA error" in str(exc)


@dataclass(frozen=True, slots=True)
class ExecutorConfig:
    instance: str
    runtime_root: Path | None = None
    token_file: Path | None = None
    urgent: bool = False          # spawned to take over at once: defer what can wait (graph capture)
    workload_factory: Callable[[str, "ExecutorContext"], Workload] | None = None   # an engine bridge's own (launcher)

    @property
    def paths(self) -> InstancePaths:
        return InstancePaths.for_instance(self.instance, self.runtime_root)


class ExecutorContext:
    """What a workload may use: the lease, tables, mapped regions, settings, channel."""

    def __init__(self, attached: m.Attached, tables: Tables, mappings: dict[str, Mapping],
                 channel: Channel, lease: Lease, urgent: bool = False):
        self.attached = attached
        self.urgent = urgent
        self.settings: ExecutorSettings = attached.settings
        self.tables = tables
        self.mappings = mappings
        self.channel = channel
        self.lease = lease
        self.steps = 0

    @property
    def epoch(self) -> int:
        return self.lease.epoch

    def beat(self) -> None:
        self.lease.beat(self.steps)


def _set_parent_death_signal() -> None:
    if os.environ.get("KVHOLD_PARENT_PID") != str(os.getppid()):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _make_device_context(device: int) -> None:
    """Create torch's CUDA context on `device` (what mapping a CUDA region needs first)."""
    import torch

    torch.cuda.init()
    torch.cuda.set_device(device)
    torch.zeros(1, device=f"cuda:{device}")


class ExecutorRuntime:
    def __init__(self, config: ExecutorConfig):
        self.config = config
        self.paths = config.paths
        self.active = False
        self.compile_watch: CompileWatch | None = None     # once active on a GPU
        self.sidecar_pidfd = -1
        self.sidecar_pid = 0
        self.stop_reason = ""
        self.kept: dict[str, tuple[int, RegionInfo]] = {}   # a dup of each region descriptor received
        self.lease: Lease | None = None     # once attached

    def _on_sigterm(self, signum, frame) -> None:
        self.stop_reason = signal.Signals(signum).name

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        token_path = self.config.token_file or self.paths.token_file
        self.token = Path(token_path).read_text().strip()
        self.channel = Channel(self.paths)
        try:
            return self._run(self.channel, self.token)
        except Fenced as exc:
            log.warning("%s; exiting", exc)
            return EXIT_FENCED
        except FencedError as exc:
            # the sidecar refused a message sent under an epoch it fenced after the send's last
            # lease check (a stop in between): the refusal may be read before the next beat
            log.warning("the sidecar refused this executor's lease (%s): fenced; exiting", exc)
            return EXIT_FENCED
        except Exception:
            if not self._fenced():
                raise
            # whatever failed, this executor's lease was taken meanwhile: it exits as fenced (a
            # generic failure's exit code would report a crash of a process the sidecar let go)
            log.warning("lease %d epoch %d was fenced (now %d); exiting after this error:",
                        self.lease.slot, self.lease.epoch, self.lease.current_epoch, exc_info=True)
            return EXIT_FENCED
        finally:
            self.channel.close()

    def _fenced(self) -> bool:
        """This executor holds a lease and the sidecar has revoked its epoch."""
        if self.lease is None:
            return False
        try:
            return not self.lease.valid
        except Exception:        # the tables cannot be read: nothing is known
            return False

    def _run(self, channel: Channel, token: str) -> int:
        t_attach = time.monotonic()
        laps: dict[str, float] = {}       # the start's parts, ms (Ready.phases)
        mark = [t_attach]

        def lap(name: str) -> None:
            now = time.monotonic()
            laps[name] = round((now - mark[0]) * 1e3, 2)
            mark[0] = now

        attached = channel.attach(token)
        if not self._outlives_sidecar(attached.settings):
            _set_parent_death_signal()
        lap("attach")
        fds = channel.fetch_fds(attached)
        infos = {d["name"]: RegionInfo.from_wire(d) for d in attached.regions}
        lap("fetch_fds")
        try:
            tables = Tables.attach_fd(fds.pop("tables"))
            mappings = {}
            for name, fd in fds.items():
                if infos[name].backend == "cuda" and "device_context" not in laps:
                    _make_device_context(infos[name].device)
                    lap("device_context")
                mappings[name] = map_region(fd, infos[name])
                lap(f"map_{name}")
            if self._outlives_sidecar(attached.settings):   # for a restarted sidecar (kvhold.protocol.hand_back)
                self.kept = {name: (os.dup(fd), infos[name]) for name, fd in fds.items()}
        finally:
            for fd in fds.values():
                os.close(fd)
        tables.liveness_mutex(attached.slot).hold()  # released by the kernel when we die
        lease = self.lease = Lease(tables, attached.slot, attached.epoch)
        set_log_context(role="standby", epoch=attached.epoch)
        self._watch_sidecar(tables.sidecar_pid)
        ctx = ExecutorContext(attached, tables, mappings, channel, lease, urgent=self.config.urgent)
        log.info("attached: lease %d epoch %d generation %d", attached.slot, attached.epoch,
                 attached.generation)
        faults.point("attached")           # crash tests: executors that die before they are ready
        t0 = time.monotonic()
        mapped_ms = round((t0 - t_attach) * 1e3, 2)
        workload = (self.config.workload_factory or make_workload)(attached.settings.workload, ctx)
        try:
            workload.prepare()
            ctx.beat()
            channel.send(m.Ready(slot=attached.slot, epoch=attached.epoch,
                                 warm_ms=(time.monotonic() - t0) * 1e3, private_mib=float(workload.private_mib),
                                 phases={"attach_and_map": mapped_ms, **laps, **workload.phases},
                                 ranks=list(getattr(workload, "group_ranks", ()))))
            return self._loop(ctx, workload)
        except Exception as exc:
            if not is_device_fault(exc):
                raise
            self._die_of_device_fault(ctx, exc)

    @staticmethod
    def _die_of_device_fault(ctx: ExecutorContext, exc: BaseException) -> None:
        """Nothing more may run in a faulted context: say so, and exit without tearing down.

        The fault raised before this step's commit, so nothing of it was published; the
        sidecar fences this lease on `Failing` (or on the exit) and the standby takes over."""
        reason = " ".join(str(exc).split())[:300]
        log.error("CUDA context lost (%s); exiting without publishing", reason)
        try:
            ctx.channel.send(m.Failing(slot=ctx.attached.slot, epoch=ctx.epoch, reason=reason))
            ctx.channel.sock.close(200)    # term() waits while ZeroMQ's I/O thread delivers it (<= 200 ms)
            ctx.channel.ctx.term()
        except Exception as send_exc:      # the exit fences us just the same, a moment later
            log.warning("could not tell the sidecar: %s", send_exc)
        logging.shutdown()
        os._exit(EXIT_CUDA_FAULT)

    def _watch_sidecar(self, pid: int) -> None:
        self.sidecar_pid = pid        # the sidecar this executor serves (its death is this pid's)
        try:
            self.sidecar_pidfd = os.pidfd_open(pid)
        except OSError:
            log.warning("cannot watch sidecar pid %d; relying on the control socket", pid)

    def _sidecar_gone(self) -> bool:
        return self.sidecar_pidfd >= 0 and bool(select.select([self.sidecar_pidfd], [], [], 0)[0])

    @staticmethod
    def _outlives_sidecar(settings: ExecutorSettings) -> bool:
        """Whether this executor waits for a new sidecar when its own dies."""
        return settings.sidecar_wait_ms > 0

    def _await_sidecar(self, ctx: ExecutorContext, workload: Workload) -> bool:
        """The sidecar died: keep the mappings, stop stepping, and wait for a sidecar that adopts
        this instance's tables; True once attached to it under the same lease, False if none came."""
        if not self._outlives_sidecar(ctx.settings):
            log.error("sidecar exited; exiting")
            return False
        # the pid that died, not the header's: a new sidecar may have written its own already
        old_pid = self.sidecar_pid
        if self.active:
            workload.flush()      # the pending commit is published: nothing of this step is lost
        os.close(self.sidecar_pidfd)
        self.sidecar_pidfd = -1
        ctx.channel.close()
        wait_s = ctx.settings.sidecar_wait_ms / 1e3
        log.warning("sidecar pid %d exited; waiting up to %.0f s for a sidecar to adopt this "
                    "executor (lease %d epoch %d, %s)", old_pid, wait_s, ctx.attached.slot, ctx.epoch,
                    "active" if self.active else "standby")
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not self.stop_reason:
            ctx.beat()                    # Fenced (the new sidecar did not keep this lease) ends it
            pid = ctx.tables.sidecar_pid
            if pid != old_pid and pid_alive(pid):
                if self._reattach(ctx, pid):
                    return True
                if pid_alive(pid):        # a live sidecar that did not take this executor back
                    return False
                # it died while adopting (a spare killed mid-takeover): the next sidecar to claim
                # the tables gets the descriptors, and the wait starts again from this death
                log.warning("sidecar pid %d died while adopting this executor; waiting up to %.0f s "
                            "for the next one", pid, wait_s)
                self._unwatch_sidecar()
                ctx.channel.close()
                old_pid, deadline = pid, time.monotonic() + wait_s
                continue
            time.sleep(min(ctx.settings.heartbeat_ms / 1e3, SIDECAR_POLL_S))
        log.error("no sidecar adopted this executor within %.0f s; exiting", wait_s)
        return False

    def _unwatch_sidecar(self) -> None:
        if self.sidecar_pidfd >= 0:
            os.close(self.sidecar_pidfd)
            self.sidecar_pidfd = -1

    def _reattach(self, ctx: ExecutorContext, pid: int) -> bool:
        """Hand the region descriptors back to the adopting sidecar `pid`, then attach to it: it
        must give back this very lease. Whether it kept the descriptors is its decision: one
        that did not adopt the pool refuses the attach (or has killed this executor)."""
        self.channel = ctx.channel = Channel(self.paths)
        self._watch_sidecar(pid)          # its death ends the wait for its answer at once
        try:
            reply = ctx.channel.hand_back(self.token, ctx.attached.slot, ctx.epoch, self.kept)
            if reply.get("ok"):
                log.info("handed the region descriptors back to sidecar pid %d (%s)", pid,
                         "kept" if reply.get("kept") else reply.get("reason", "not needed"))
            else:
                log.error("sidecar pid %d refused the region descriptors: %s", pid, reply.get("error"))
        except (OSError, RuntimeError) as exc:
            log.warning("could not hand the region descriptors back to sidecar pid %d: %s", pid, exc)
        try:    # the sidecar binds its control socket once it has the regions and its streams
            attached = ctx.channel.attach(self.token, timeout_ms=REATTACH_TIMEOUT_MS, wake_fd=self.sidecar_pidfd)
        except Exception as exc:      # refused (a stale lease), no answer in time, or it died
            log.error("the sidecar pid %d that adopted the tables did not take this executor back: "
                      "%s; exiting", pid, exc)
            return False
        if (attached.slot, attached.epoch) != (ctx.attached.slot, ctx.epoch):
            log.error("sidecar pid %d offered lease %d epoch %d, not this executor's lease %d epoch "
                      "%d; exiting", pid, attached.slot, attached.epoch, ctx.attached.slot, ctx.epoch)
            return False
        ctx.lease.check()
        log.warning("re-attached to sidecar pid %d (lease %d epoch %d, %s)", pid, attached.slot,
                    attached.epoch, "active" if self.active else "standby")
        return True

    def _loop(self, ctx: ExecutorContext, workload: Workload) -> int:
        heartbeat_ms = ctx.settings.heartbeat_ms
        handlers = {
            m.Promote: lambda msg: self._promote(ctx, workload, msg),
            m.Wake: lambda msg: workload.on_wake(),
            m.Reaped: lambda msg: workload.on_reaped(msg.epochs),
        }
        while True:
            ctx.beat()
            busy = self.active and workload.has_work()
            # idle: woken by the sidecar's death too (its pidfd), so a standby hands back the
            # regions' descriptors to a new sidecar at once instead of after a heartbeat
            msg = ctx.channel.recv(0 if busy else heartbeat_ms, wake_fd=self.sidecar_pidfd)
            while msg is not None:
                if isinstance(msg, m.Shutdown):
                    log.info("shutdown requested: %s", msg.reason)
                    self._flush(ctx, workload)
                    ctx.channel.send(m.Bye(slot=ctx.attached.slot, epoch=ctx.epoch, reason="shutdown"))
                    return EXIT_OK
                handler = handlers.get(type(msg))
                if handler is None:
                    log.warning("ignored unexpected %s from the sidecar", msg.TYPE)
                else:
                    handler(msg)
                msg = ctx.channel.recv(0)
            if self.stop_reason:
                log.info("stopping on %s", self.stop_reason)
                self._flush(ctx, workload)
                ctx.channel.send(m.Bye(slot=ctx.attached.slot, epoch=ctx.epoch, reason=self.stop_reason))
                return EXIT_OK
            if self._sidecar_gone():
                if not self._await_sidecar(ctx, workload):
                    return EXIT_SIDECAR_GONE
                continue
            if not self.active:
                workload.idle()
            else:
                workload.maintain()
            if self.active and workload.has_work():
                slots = workload.step()
                ctx.steps += 1
                if ctx.steps == 1:
                    ctx.lease.mark_warm()
                if slots:
                    ctx.channel.send(m.StepDone(slot=ctx.attached.slot, epoch=ctx.epoch, slots=slots,
                                                marks=workload.take_marks(),
                                                step_tokens=workload.take_step_tokens()))

    def _flush(self, ctx: ExecutorContext, workload: Workload) -> None:
        """On a graceful stop, publish the commit the last step left pending (kvhold.executor.commit)
        so that the successor need not recompute it."""
        if not self.active:
            return
        slots = workload.flush()       # Fenced propagates: the run ends EXIT_FENCED, the successor recomputes
        if slots:
            ctx.channel.send(m.StepDone(slot=ctx.attached.slot, epoch=ctx.epoch, slots=slots, marks={}))

    def _promote(self, ctx: ExecutorContext, workload: Workload, msg: m.Promote) -> None:
        if msg.epoch != ctx.epoch:
            log.warning("ignored promote for epoch %d (mine is %d)", msg.epoch, ctx.epoch)
            return
        if self.active:   # an adopting sidecar re-sends it: the promotion may not have arrived
            log.info("already active (lease %d, epoch %d)", ctx.attached.slot, ctx.epoch)
            return
        ctx.lease.check()
        self.active = True
        set_log_context(role="active")
        if "triton" in sys.modules and self.compile_watch is None:   # a GPU executor's kernels
            watch = CompileWatch(ctx.lease)
            self.compile_watch = watch if watch.install() else None
        report = workload.promote(msg)
        if not workload.cold_first_step:
            ctx.lease.mark_warm()
        log.info("active (lease %d, epoch %d)", ctx.attached.slot, ctx.epoch)
        if report is not None:
            ctx.channel.send(m.Recovered(slot=ctx.attached.slot, epoch=ctx.epoch, report=report))


def make_workload(name: str, ctx: ExecutorContext) -> Workload:
    if name == "idle":
        from kvhold.executor.idle import IdleWorkload
        return IdleWorkload(ctx)
    if name == "churn":
        from kvhold.executor.churn import ChurnWorkload
        return ChurnWorkload(ctx)
    if name == "engine" and ctx.settings.kv_mode == "foreign":
        from kvhold.executor.foreign_pool import ForeignEngineWorkload
        return ForeignEngineWorkload(ctx)
    if name == "engine":
        from kvhold.executor.engine_workload import EngineWorkload
        return EngineWorkload(ctx)
    if name in ("vllm", "trtllm"):
        raise ValueError(f"the {name} workload runs its own executor program ("
                         + ("python -m kvhold.vllm_bridge" if name == "vllm" else
                            "python -m kvhold.trtllm_bridge.launcher") + "), not python -m kvhold.executor")
    raise ValueError(f"unknown workload {name!r}")


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="kvhold executor",
                                     description="Run one kvhold executor under a sidecar.")
    parser.add_argument("--instance", default=os.environ.get("KVHOLD_INSTANCE", "default"))
    parser.add_argument("--runtime-root", type=Path, default=None)
    parser.add_argument("--token-file", type=Path, default=None)
    parser.add_argument("--log-level", default=os.environ.get("KVHOLD_LOG_LEVEL", "INFO"))
    parser.add_argument("--urgent", action="store_true",
                        help="take over at once: defer the CUDA graph capture to a later step")
    args = parser.parse_args(argv)
    from kvhold.protocol.logs import setup_logging
    setup_logging(args.log_level, role="executor")
    cfg = ExecutorConfig(instance=args.instance, runtime_root=args.runtime_root,
                         token_file=args.token_file, urgent=args.urgent)
    try:
        return ExecutorRuntime(cfg).run()
    except KeyboardInterrupt:
        return EXIT_OK
