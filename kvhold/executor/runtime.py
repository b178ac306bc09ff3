"""The executor process: attach, map, warm up, then serve as standby or active.

Life of an executor: attach with the token and get a lease (slot, epoch) and its
settings (kvhold.protocol.settings.ExecutorSettings); fetch the region descriptors;
map tables, KV pool and weights; prepare the workload (kvhold.executor.workload: load
or verify weights, warm up); report ready (the sidecar makes it a standby); on
`promote`, take over the page table and journal (recovery) and run steps until
shutdown. The main loop writes the heartbeat; a hung loop therefore stops
beating and the sidecar fences it. Every beat checks the epoch: a fenced
executor exits with code 75 instead of writing. If the sidecar dies the executor
exits too (pidfd on the sidecar, and PR_SET_PDEATHSIG when the sidecar spawned it).
"""
from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvhold.protocol import messages as m
from kvhold.protocol.leases import Fenced, Lease
from kvhold.protocol.memory import Mapping, RegionInfo, map_region
from kvhold.protocol.naming import InstancePaths
from kvhold.protocol.settings import ExecutorSettings
from kvhold.protocol.tables import Tables
from kvhold.executor.channel import Channel
from kvhold.executor.workload import Workload
from kvhold.protocol.logs import set_log_context

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_SIDECAR_GONE = 69
EXIT_FENCED = 75


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


class ExecutorRuntime:
    def __init__(self, config: ExecutorConfig):
        self.config = config
        self.paths = config.paths
        self.active = False
        self.sidecar_pidfd = -1
        self.stop_reason = ""

    def _on_sigterm(self, signum, frame) -> None:
        self.stop_reason = signal.Signals(signum).name

    def run(self) -> int:
        _set_parent_death_signal()
        signal.signal(signal.SIGTERM, self._on_sigterm)
        token_path = self.config.token_file or self.paths.token_file
        token = Path(token_path).read_text().strip()
        channel = Channel(self.paths)
        try:
            return self._run(channel, token)
        except Fenced as exc:
            log.warning("%s; exiting", exc)
            return EXIT_FENCED
        finally:
            channel.close()

    def _run(self, channel: Channel, token: str) -> int:
        t_attach = time.monotonic()
        attached = channel.attach(token)
        fds = channel.fetch_fds(attached)
        infos = {d["name"]: RegionInfo.from_wire(d) for d in attached.regions}
        try:
            tables = Tables.attach_fd(fds.pop("tables"))
            mappings = {name: map_region(fd, infos[name]) for name, fd in fds.items()}
        finally:
            for fd in fds.values():
                os.close(fd)
        tables.liveness_mutex(attached.slot).hold()  # released by the kernel when we die
        lease = Lease(tables, attached.slot, attached.epoch)
        set_log_context(role="standby", epoch=attached.epoch)
        self._watch_sidecar(tables.sidecar_pid)
        ctx = ExecutorContext(attached, tables, mappings, channel, lease, urgent=self.config.urgent)
        log.info("attached: lease %d epoch %d generation %d", attached.slot, attached.epoch,
                 attached.generation)
        t0 = time.monotonic()
        mapped_ms = round((t0 - t_attach) * 1e3, 2)
        workload = (self.config.workload_factory or make_workload)(attached.settings.workload, ctx)
        workload.prepare()
        ctx.beat()
        channel.send(m.Ready(slot=attached.slot, epoch=attached.epoch,
                             warm_ms=(time.monotonic() - t0) * 1e3, private_mib=float(workload.private_mib),
                             phases={"attach_and_map": mapped_ms, **workload.phases}))
        return self._loop(ctx, workload)

    def _watch_sidecar(self, pid: int) -> None:
        try:
            self.sidecar_pidfd = os.pidfd_open(pid)
        except OSError:
            log.warning("cannot watch sidecar pid %d; relying on the control socket", pid)

    def _sidecar_gone(self) -> bool:
        return self.sidecar_pidfd >= 0 and bool(select.select([self.sidecar_pidfd], [], [], 0)[0])

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
            msg = ctx.channel.recv(0 if busy else heartbeat_ms)
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
                log.error("sidecar exited; exiting")
                return EXIT_SIDECAR_GONE
            if self.active and workload.has_work():
                slots = workload.step()
                ctx.steps += 1
                if ctx.steps == 1:
                    ctx.lease.mark_warm()
                if slots:
                    ctx.channel.send(m.StepDone(slot=ctx.attached.slot, epoch=ctx.epoch, slots=slots,
                                                marks=workload.take_marks()))

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
        ctx.lease.check()
        self.active = True
        set_log_context(role="active")
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
