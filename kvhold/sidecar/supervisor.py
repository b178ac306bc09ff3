"""Executor supervision: spawn, attach, lease, detect death, fence, promote, re-arm.

Three signals detect a dead or stuck executor, each for what it sees first:
* the robust futex of its lease slot (kvhold.protocol.liveness): a watcher thread,
  started once the executor has fetched its region descriptors, wakes with
  EOWNERDEAD when the executor's main thread dies, before the kernel tears its
  address space down (~0.2 ms after a SIGKILL). This is the main path of a crash:
  the executor is fenced and a standby promoted from it;
* its pidfd: readable once the process has fully exited. It fences an executor
  that died before it had a watcher (during start-up), confirms the exit of one
  already fenced (its lease is released, the new active is told `reaped`, and a
  `--takeover wait-exit` failover is promoted only then), and reaps the process;
* the heartbeat in its lease: a hang (SIGSTOP, a spin) keeps the process alive and
  the futex held, so lease ages are checked at the nearest deadline on
  CLOCK_MONOTONIC; an executor silent for its lease is fenced as hung.
A fenced executor's epoch is replaced, so its writes are refused and it exits if
it ever runs again; it is killed if it is hung and ours to kill, and, if it was
active, the best standby is promoted at once. The promotion names the fenced
epochs whose process has not exited yet: the new active must not reuse pages
those writers could still touch until a later `reaped` message says they are
gone. Executors are then re-spawned, forked from the zygote when one is ready
(torch already imported) or started cold, with capped exponential backoff when
they keep dying.

`protection()` says whether a crash of the active executor would still be
survived: not while executors are in a respawn loop (RESPAWN_LOOP_DEATHS deaths
in a row with none becoming ready in between: however slowly they die, an
attach that times out after seconds included), nor while a configured executor
cannot even be spawned. /health turns 503 on it.

The supervisor holds no sidecar: it gets its config section, the tables, the
weights keeper, the event loop (fd watches, posting from threads), the region
exporter, a `send` callable to executors, what a spawned executor is launched
with (`ExecutorLaunch`) and a sink for its lifecycle events (spawn, attach, ready,
promote, fence, bye, exit: kvhold.sidecar.timeline keeps them). The ranks of
tensor-parallel groups are watched by its `RankWatch` (kvhold.sidecar.rank_watch).
"""
from __future__ import annotations

import collections
import contextlib
import hmac
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from kvhold.protocol import fdpass, messages as m
from kvhold.protocol.errors import ErrorCode
from kvhold.protocol.hand_back import is_hand_back
from kvhold.protocol.layout import Role
from kvhold.protocol.leases import LeaseTable, now_ns
from kvhold.protocol.procfs import exit_code, stat_fields
from kvhold.protocol.liveness import DeathWatcher
from kvhold.protocol.naming import InstancePaths
from kvhold.protocol.page_table import PageTable
from kvhold.protocol.recovery_report import FENCE_REASONS
from kvhold.protocol.tables import Tables
from kvhold.sidecar.config import ExecutorsConfig
from kvhold.sidecar.hand_back import late_reply
from kvhold.sidecar.rank_watch import RankWatch
from kvhold.sidecar.weights_keeper import WeightsKeeper
from kvhold.sidecar.zygote_keeper import ZygoteKeeper

ZYGOTE_POLL_NS = 10_000_000     # how often a sidecar's first spawn looks whether its zygote listens

log = logging.getLogger(__name__)
TAKEOVER_GRACE_NS = 2_000_000_000   # upper bound; the first step after `takeover_done`, or the active's fence, ends it sooner
FIRST_STEP_GRACE = 10                # leases an active executor may take for its very first step
RESPAWN_LOOP_DEATHS = 3              # deaths without a ready executor in between: a respawn loop


@dataclass(slots=True)
class ExecutorHandle:
    slot: int
    pid: int
    epoch: int
    pidfd: int
    popen: subprocess.Popen | None
    spawned_ns: int
    identity: bytes | None = None
    nonce: str = ""
    ready: bool = False
    fenced: bool = False
    stopping: bool = False
    watcher: DeathWatcher | None = None
    via: str = "cold"                    # how it was started: cold, zygote, adopted, readopted
    deferred_failover: tuple[int, int] | None = None   # (fenced epoch, detect ns) for wait-exit
    info: dict = field(default_factory=dict)
    rank_pidfds: dict[int, int] = field(default_factory=dict)   # a group's ranks 1..N-1: pid -> pidfd


class Loop(Protocol):
    """The sidecar's event loop, as the supervisor and the zygote keeper use it."""

    def watch_fd(self, fd: int, callback: Callable[[], None]) -> None: ...
    def unwatch_fd(self, fd: int) -> None: ...
    def post(self, callback: Callable[[], None]) -> None: ...


class RegionExporter(Protocol):
    """The memory regions executors map (kvhold.sidecar.regions.PoolMemory)."""

    def infos(self, writable_weights: bool = False) -> list[dict]: ...
    def export_fds(self, writable_weights: bool) -> tuple[list[str], list[int]]: ...


# the executor program of a workload; every other workload runs `python -m kvhold.executor`
EXECUTOR_MODULES = {"vllm": "kvhold.vllm_bridge"}


@dataclass(frozen=True, slots=True)
class ExecutorLaunch:
    """What an executor is started and attached with."""

    paths: InstancePaths
    token: str
    token_path: Path
    settings: dict


class Supervisor:
    def __init__(self, config: ExecutorsConfig, tables: Tables, weights: WeightsKeeper, loop: Loop,
                 memory: RegionExporter, send: Callable[[ExecutorHandle, object], None],
                 launch: ExecutorLaunch, events: Callable[[dict], None], zygote=None, deaths=None):
        """`deaths`: the per-request death counts (kvhold.sidecar.request_deaths.RequestDeaths),
        told of every active executor that dies or hangs before its successor is promoted."""
        self.config = config
        self.tables = tables
        self.weights = weights
        self.loop = loop
        self.memory = memory
        self.send = send
        self.launch = launch
        self.leases = LeaseTable(tables)
        self.handles: dict[int, ExecutorHandle] = {}      # by lease slot
        self.pending_epochs: set[int] = set()              # fenced, process not exited yet
        self.record_event = events        # the sink of lifecycle events (RecoveryTimeline.event)
        self.active_slot: int | None = None
        self.want_active = True
        self._unserved_failover = (0, 0)   # (fenced epoch, detect ns) waiting for an executor
        self._failures: collections.deque = collections.deque(maxlen=32)
        self._next_spawn_ns = 0
        self._takeover_until_ns = 0   # re-arming waits while a promoted standby takes over
        self._takeover_reported = False   # ... and then for its first step (step_done)
        self._stopping = False
        self._last_ready_ns = 0
        self._spawn_error: str | None = None   # why the last spawn failed; None once one succeeds
        self.zygote: ZygoteKeeper | None = zygote
        self._spawned_any = False
        self.context_faults: list[tuple[int, int]] = []   # (ns, pid) of executors whose CUDA context faulted
        self.deaths = deaths
        self.ranks = RankWatch(loop, self.handles, self.fence, launch)   # tensor-parallel groups' ranks

    # ------------------------------------------------------------------ events
    def _event(self, kind: str, h: ExecutorHandle | None = None, **extra) -> dict:
        ev = {"kind": kind, "ns": now_ns()}
        if h is not None:
            ev.update(slot=h.slot, pid=h.pid, epoch=h.epoch)
        ev.update(extra)
        self.record_event(ev)
        return ev

    # ------------------------------------------------------------------ spawning
    def target_executors(self) -> int:
        return 1 + self.config.standbys if self.config.spawn_executors else 0

    def live_handles(self) -> list[ExecutorHandle]:
        return [h for h in self.handles.values() if not h.fenced and not h.stopping]

    def spawn(self) -> ExecutorHandle | None:
        slot = self.leases.free_slot()
        if slot is None:
            log.error("no free lease slot to spawn an executor (%d in use)", len(self.handles))
            self._spawn_error = f"no free lease slot ({len(self.handles)} in use)"
            return None
        paths = self.launch.paths
        argv = ["--instance", paths.instance, "--runtime-root", str(paths.runtime_dir.parent),
                "--token-file", str(self.launch.token_path),
                "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel()),
                *self.config.executor_args]
        if self.active_slot is None and self._unserved_failover[0]:
            argv.append("--urgent")      # it takes over as soon as it is ready
        env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}  # idle threads must not spin
        popen, via = None, "zygote"
        pid = self.zygote.fork(argv, env) if self.zygote is not None else None
        if pid is None:
            via = "cold"
            try:
                module = EXECUTOR_MODULES.get(self.launch.settings.workload, "kvhold.executor")
                popen = subprocess.Popen([sys.executable, "-m", module, *argv],
                                         env=dict(os.environ, KVHOLD_PARENT_PID=str(os.getpid()), **env),
                                         stdin=subprocess.DEVNULL, close_fds=True)
            except OSError as exc:
                log.error("could not start an executor: %s", exc)
                self._spawn_error = f"could not start an executor: {exc}"
                return None
            pid = popen.pid
        self._spawn_error = None
        self._spawned_any = True
        pidfd = os.pidfd_open(pid)
        epoch = self.leases.grant(slot, pid)
        h = ExecutorHandle(slot=slot, pid=pid, epoch=epoch, pidfd=pidfd, popen=popen,
                           spawned_ns=now_ns(), via=via)
        self.handles[slot] = h
        self.loop.watch_fd(pidfd, lambda h=h: self.on_exit(h))
        self._event("spawn", h, via=via)
        log.info("spawned executor pid %d (%s, lease %d, epoch %d)", h.pid, via, slot, epoch)
        return h

    def rearm(self, now: int) -> None:
        """Keep 1 active + N standbys alive, backing off when executors keep dying."""
        if self._stopping:
            return
        if self.zygote is not None:
            self.zygote.keep_alive(now)
        if now < max(self._next_spawn_ns, self._takeover_until_ns) or self._waiting_for_zygote(now):
            return
        missing = self.target_executors() - len(self.live_handles())
        for _ in range(max(0, missing)):
            if self.spawn() is None:
                break
        recent = [t for t in self._failures if now - t < 60e9]
        if len(recent) >= 3 and self.config.restart_backoff_ms[1] > 0:
            lo, hi = self.config.restart_backoff_ms
            delay_ms = min(hi, lo * 2 ** (len(recent) - 3))
            self._next_spawn_ns = now + int(delay_ms * 1e6)

    def _waiting_for_zygote(self, now: int) -> bool:
        """A sidecar's first executors (none spawned or adopted yet) are forked from its zygote
        once it is ready rather than started cold beside it (ZygoteKeeper.starting)."""
        return self.zygote is not None and not self.handles and not self._spawned_any \
            and self.zygote.starting(now)

    # ------------------------------------------------------------------ attach
    def on_attach(self, identity: bytes, msg: m.Attach):
        if not hmac.compare_digest(msg.token.encode(), self.launch.token.encode()):
            log.warning("refused attach from pid %d: wrong executor token", msg.pid)
            self._event("refused", pid=msg.pid, reason="bad token")
            return m.Error(code=ErrorCode.UNAUTHORIZED, message="bad executor token")
        h = next((x for x in self.handles.values() if x.pid == msg.pid and not x.fenced), None)
        if h is None:
            h = self._adopt(msg.pid)
            if h is None:
                return m.Error(code=ErrorCode.OVERLOADED, message="no free lease slot")
        if h.identity is not None and h.identity != identity:
            return m.Error(code=ErrorCode.UNAUTHORIZED, message="pid already attached")
        if h.via == "readopted" and h.identity is None:
            self.loop.post(lambda h=h: self._after_reattach(h))   # after the Attached reply
        h.identity = identity
        h.nonce = secrets.token_hex(16)
        self._event("attach", h)
        weights = self.weights.attach_info(h)
        return m.Attached(slot=h.slot, epoch=h.epoch, generation=self.tables.generation,
                          nonce=h.nonce, regions=self.memory.infos(weights["loader"]),
                          settings=self.launch.settings, weights=weights)

    def _adopt(self, pid: int) -> ExecutorHandle | None:
        """An executor we did not spawn (systemd, a test): lease it and watch its pidfd."""
        slot = self.leases.free_slot()
        if slot is None:
            return None
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:
            log.warning("refused attach from pid %d: %s", pid, exc)
            return None
        epoch = self.leases.grant(slot, pid)
        h = ExecutorHandle(slot=slot, pid=pid, epoch=epoch, pidfd=pidfd, popen=None,
                           spawned_ns=now_ns(), via="adopted")
        self.handles[slot] = h
        self.loop.watch_fd(pidfd, lambda h=h: self.on_exit(h))
        log.info("adopted external executor pid %d (lease %d, epoch %d)", pid, slot, epoch)
        return h

    # ------------------------------------------------------------------ re-adoption
    def adopt(self, live, dead) -> None:
        """Take over a dead sidecar's executors (kvhold.sidecar.adoption): each live lease keeps
        its slot, epoch and role, and is watched (liveness mutex, pidfd, heartbeat) at once, a
        group's ranks once the loop runs; it gets its handle's identity when it attaches again.
        A dead ACTIVE lease is fenced and its requests left to a takeover; other dead leases are
        freed."""
        now = now_ns()
        for holder in live:
            try:
                pidfd = os.pidfd_open(holder.pid)
            except OSError:
                dead = [*dead, holder]
                continue
            h = ExecutorHandle(slot=holder.slot, pid=holder.pid, epoch=self.leases.epoch(holder.slot),
                               pidfd=pidfd, popen=None, spawned_ns=now, via="readopted", ready=True)
            self.handles[h.slot] = h
            self.loop.watch_fd(pidfd, lambda h=h: self.on_exit(h))
            self._watch_liveness(h)
            if holder.role == Role.ACTIVE:
                self.active_slot = h.slot
            self.loop.post(lambda h=h: self.ranks.watch_readopted(h))   # once the loop runs
            self._event("readopt", h, role=holder.role.name)
            log.warning("re-adopted executor pid %d (lease %d, %s, epoch %d)", h.pid, h.slot,
                        holder.role.name, h.epoch)
        for holder in dead:
            role = self.leases.role(holder.slot)
            if role == Role.ACTIVE:
                old_epoch = self.leases.fence(holder.slot)
                if self.deaths is not None:   # its exit status went to another parent: unknown
                    self.deaths.executor_died(holder.slot, old_epoch)
                    self.deaths.exit_known(old_epoch, -1)
                self._unserved_failover = (old_epoch, now)
                self.want_active = True
                self._failures.append(now)
                self._event("fence", reason="died", detail="while no sidecar ran", role=role.name,
                            slot=holder.slot, pid=holder.pid, epoch=old_epoch, detect_ns=now,
                            fenced_ns=self.leases.fenced_ns(holder.slot), fenced_epoch=old_epoch)
                log.warning("executor pid %d (lease %d, ACTIVE, epoch %d) died while no sidecar ran: "
                            "a standby takes over", holder.pid, holder.slot, old_epoch)
            elif role == Role.STARTING or role == Role.STANDBY:
                self.leases.fence(holder.slot)
            self.leases.release(holder.slot, -1)

    def _after_reattach(self, h: ExecutorHandle) -> None:
        """A re-adopted executor attached again: the ACTIVE one gets its promotion once more (the
        dead sidecar may not have delivered it; an active executor ignores it), and a standby
        takes over if the active died meanwhile."""
        if h.fenced or self.handles.get(h.slot) is not h:
            return
        role = self.leases.role(h.slot)
        if role == Role.ACTIVE:
            self.send(h, m.Promote(epoch=h.epoch, pending_epochs=sorted(self.pending_epochs)))
            # pages it quarantined for fenced writers the dead sidecar never reported gone: every
            # process of this pool but the live leases' has exited (kvhold.sidecar.adoption)
            live = {x.epoch for x in self.handles.values()} | self.pending_epochs
            gone = sorted(PageTable(self.tables).quarantined_epochs() - live)
            if gone:
                self.send(h, m.Reaped(epochs=gone))
        elif role == Role.STANDBY and self.active_slot is None and self.want_active:
            fenced_epoch, detect_ns = self._unserved_failover
            self._unserved_failover = (0, 0)
            self.promote(h, fenced_epoch=fenced_epoch, detect_ns=detect_ns)

    def on_fd_request(self, conn: socket.socket) -> None:
        """Hand region descriptors to the process that holds a lease (checked by SO_PEERCRED)."""
        try:
            req, stray = fdpass.recv(conn)
            if is_hand_back(req):      # an executor of an adopted pool, after the regions came back
                fdpass.send(conn, late_reply(req, stray))
                return
            for fd in stray:
                os.close(fd)
            pid, uid, _ = fdpass.peer_credentials(conn)
            h = self.handles.get(req.get("slot")) if isinstance(req.get("slot"), int) else None
            if (h is None or h.fenced or h.pid != pid or uid != os.getuid()
                    or not hmac.compare_digest(str(req.get("nonce", "")), h.nonce)
                    or req.get("epoch") != h.epoch):
                log.warning("refused region descriptors to pid %d (no matching lease)", pid)
                fdpass.send(conn, {"ok": False, "error": "no matching lease"})
                return
            writable_weights = self.weights.may_write(h)
            names, fds = self.memory.export_fds(writable_weights)
            try:
                fdpass.send(conn, {"ok": True, "regions": names}, fds)
            finally:
                for fd in fds:
                    os.close(fd)
            self._watch_liveness(h)
        except (OSError, fdpass.FdPassError) as exc:
            log.warning("region descriptor request failed: %s", exc)
        finally:
            conn.close()

    def _watch_liveness(self, h: ExecutorHandle) -> None:
        """Fast death signal: wakes when h's main thread dies (see kvhold.protocol.liveness)."""
        if h.watcher is not None:
            return

        def died(h=h, epoch=h.epoch):
            ns = now_ns()
            self.loop.post(lambda: self.on_liveness_lost(h, epoch, ns))

        h.watcher = DeathWatcher(self.tables.liveness_mutex(h.slot), died, name=f"liveness-{h.slot}")
        h.watcher.start()

    def on_liveness_lost(self, h: ExecutorHandle, epoch: int, detect_ns: int) -> None:
        if self.handles.get(h.slot) is h and h.epoch == epoch and not h.fenced:
            reason = "exited" if h.stopping else "died"
            self.fence(h, reason, detect_ns)

    # ------------------------------------------------------------------ lifecycle messages
    def handle_for(self, identity: bytes, slot: int, epoch: int) -> ExecutorHandle | None:
        h = self.handles.get(slot)
        if h is None or h.identity != identity:
            return None
        return h

    def on_ready(self, h: ExecutorHandle, msg: m.Ready) -> None:
        h.ready = True
        self._last_ready_ns = now_ns()
        h.info["warm_ms"] = msg.warm_ms
        h.info["private_mib"] = msg.private_mib
        h.info["warm_phases_ms"] = msg.phases
        h.info["spawn_to_ready_ms"] = round((now_ns() - h.spawned_ns) / 1e6, 1)
        if msg.ranks and not self.ranks.watch(h, msg.ranks):
            return
        if self.leases.role(h.slot) == Role.STARTING:
            self.leases.set_role(h.slot, Role.STANDBY)
        self._event("ready", h, warm_ms=msg.warm_ms, private_mib=msg.private_mib)
        log.info("executor pid %d ready as standby (warm-up %.0f ms, %.0f ms from spawn: %s)", h.pid, msg.warm_ms,
                 h.info["spawn_to_ready_ms"], ", ".join(f"{k} {v}" for k, v in msg.phases.items()))
        if self.active_slot is None and self.want_active:
            fenced_epoch, detect_ns = self._unserved_failover
            self._unserved_failover = (0, 0)
            self.promote(h, fenced_epoch=fenced_epoch, detect_ns=detect_ns)

    def takeover_done(self) -> None:
        """The promoted executor reported its takeover (validated and resumed, before its first
        step): re-arming waits on for that step, so a new standby's start (its context, its
        mappings, its warm-up on the same GPU) does not compete with the first resumed token."""
        self._takeover_reported = True

    def step_done(self, h: ExecutorHandle) -> None:
        """The active executor published a step: after a reported takeover, re-arm standbys now.
        With nothing to step, TAKEOVER_GRACE_NS ends the wait."""
        if self._takeover_reported and h.slot == self.active_slot:
            self._takeover_reported = False
            self._takeover_until_ns = 0

    def on_bye(self, h: ExecutorHandle, msg: m.Bye) -> None:
        h.stopping = True
        self._event("bye", h, reason=msg.reason)

    def on_failing(self, h: ExecutorHandle, msg: m.Failing) -> None:
        """The executor's device context faulted: fence and kill it now (a standby takes
        over), and remember the fault so the driver's Xid for it is not taken for a new one."""
        self.context_faults.append((now_ns(), h.pid))
        del self.context_faults[:-8]
        log.error("executor pid %d lost its device context: %s", h.pid, msg.reason)
        self.fence(h, "cuda_fault", now_ns(), kill=True)

    def recent_context_fault(self, window_ns: int, now: int | None = None) -> int | None:
        """The pid of an executor whose device context faulted within `window_ns`, if any."""
        now = now_ns() if now is None else now
        recent = [pid for ns, pid in self.context_faults if now - ns <= window_ns]
        return recent[-1] if recent else None

    def promote(self, h: ExecutorHandle, fenced_epoch: int, detect_ns: int) -> None:
        if fenced_epoch:  # a failover: give the takeover the CPU and GPU before starting a new standby
            self._takeover_until_ns = now_ns() + TAKEOVER_GRACE_NS
            self._takeover_reported = False
        self.leases.set_role(h.slot, Role.ACTIVE)
        self.active_slot = h.slot
        isolate = self.deaths.isolate() if self.deaths is not None else None
        self._event("promote", h, fenced_epoch=fenced_epoch, isolated=len(isolate or ()))
        self.send(h, m.Promote(epoch=h.epoch, pending_epochs=sorted(self.pending_epochs),
                               fenced_epoch=fenced_epoch, detect_ns=detect_ns, isolate=isolate))
        log.info("promoted executor pid %d (lease %d, epoch %d) to active", h.pid, h.slot, h.epoch)

    @property
    def active(self) -> ExecutorHandle | None:
        return self.handles.get(self.active_slot) if self.active_slot is not None else None

    # ------------------------------------------------------------------ failure handling
    def restart_active(self, reason: str) -> int | None:
        """Fence and kill the active executor on purpose (a health event); the standby takes
        over as after a crash. Returns the pid, or None when there was no active executor."""
        h = self.active
        if h is None:
            return None
        self.fence(h, "health", now_ns(), kill=True, detail=reason)
        return h.pid

    def fence(self, h: ExecutorHandle, reason: str, detect_ns: int, kill: bool = False,
              detail: str = "", exit_hint: int | None = None) -> None:
        """Revoke h's epoch; if it was active, promote a standby right away. `reason` is one of
        FENCE_REASONS (a metric label); `detail` says more (an exit code, a health event);
        `exit_hint`: the exit status that settles a death (a group's: its dead rank's), if known."""
        if reason not in FENCE_REASONS:
            raise ValueError(f"fence reason {reason!r} is not one of {FENCE_REASONS}")
        if h.fenced:
            return
        was_active = self.active_slot == h.slot
        role = self.leases.role(h.slot)
        old_epoch = self.leases.fence(h.slot)
        h.fenced = True
        self.pending_epochs.add(old_epoch)
        fenced_ns = self.leases.fenced_ns(h.slot)
        self._event("fence", h, reason=reason, detail=detail, role=role.name, detect_ns=detect_ns,
                    fenced_ns=fenced_ns, fenced_epoch=old_epoch)
        self.weights.on_fenced(h, [x for x in self.live_handles() if x.identity is not None])
        if (kill or reason == "hang") and self.config.kill_fenced:
            try:
                signal.pidfd_send_signal(h.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.ranks.kill(h)            # every rank of a group, one stopped or in a collective too
        elif reason in ("died", "exited"):
            self.ranks.kill(h)            # rank 0 is gone: its ranks die with it (PDEATHSIG) or now
        if not h.stopping and not self._stopping:
            self._failures.append(detect_ns)
        log.warning("fenced executor pid %d (lease %d, was %s, epoch %d): %s%s",
                    h.pid, h.slot, role.name, old_epoch, reason, f" ({detail})" if detail else "")
        if was_active:
            with self.deaths.saves_after() if self.deaths is not None else contextlib.nullcontext():
                self._fail_over_from(h, reason, old_epoch, detect_ns, exit_hint)

    def _fail_over_from(self, h: ExecutorHandle, reason: str, old_epoch: int, detect_ns: int,
                        exit_hint: int | None) -> None:
        """The fenced executor was the active one: count the death against its step's requests,
        then promote a standby (or wait for the exit, with `--takeover wait-exit`)."""
        self.active_slot = None
        self._takeover_until_ns = 0   # whatever takeover ran is over: re-arming may start now
        self._takeover_reported = False
        if reason in ("died", "hang", "cuda_fault") and not h.stopping and self.deaths is not None:
            # before the successor is promoted; a death is settled by its exit status (on_exit)
            self.deaths.executor_died(h.slot, old_epoch, cause_known=reason != "died")
            early = exit_hint if exit_hint is not None else (
                self._exit_code_while_exiting(h) if reason == "died" else None)
            if early is not None:      # settled before the promotion: an outside kill isolates nothing
                self.deaths.exit_known(old_epoch, early)
        if self.config.takeover == "wait-exit" and (reason != "hang" or self.config.kill_fenced):
            h.deferred_failover = (old_epoch, detect_ns)   # on_exit promotes
            self.want_active = True
        else:
            self.failover(old_epoch, detect_ns)

    def failover(self, fenced_epoch: int, detect_ns: int) -> None:
        standby = next((x for x in self.live_handles()   # attached: a re-adopted one may not be yet
                        if x.ready and x.identity is not None
                        and self.leases.role(x.slot) == Role.STANDBY), None)
        if standby is not None:
            self.promote(standby, fenced_epoch, detect_ns)
        else:
            self.want_active = True
            if not self._unserved_failover[0]:
                self._unserved_failover = (fenced_epoch, detect_ns)
            log.warning("no warm standby: the next executor to become ready takes over")
        self.rearm(now_ns())

    def on_exit(self, h: ExecutorHandle) -> None:
        detect_ns = now_ns()
        self.loop.unwatch_fd(h.pidfd)
        if h.watcher is not None:
            h.watcher.cancel()
        exit_code = self._reap(h)
        if not h.fenced:
            self.fence(h, "exited" if h.stopping else "died", detect_ns, detail=f"exit code {exit_code}")
        if self.deaths is not None:
            self.deaths.exit_known(h.epoch, exit_code)
        released = [h.epoch] if h.epoch in self.pending_epochs else []
        self.pending_epochs.discard(h.epoch)
        self.leases.release(h.slot, exit_code)
        os.close(h.pidfd)
        self.ranks.close(h)
        del self.handles[h.slot]
        self._event("exit", h, exit_code=exit_code)
        log.info("executor pid %d exited with code %d", h.pid, exit_code)
        if released and self.active is not None:
            self.send(self.active, m.Reaped(epochs=released))
        if h.deferred_failover is not None and not self._stopping:
            self.failover(*h.deferred_failover)
        self.rearm(now_ns())

    @staticmethod
    def _exit_code_while_exiting(h: ExecutorHandle) -> int | None:
        """How a dying executor is exiting (128 + N: signal N), read before it is a zombie, or None.

        The kernel sets a task's exit code at the start of its exit, before it releases its
        robust futexes (the liveness mutex whose release is the death signal) and long before
        a GPU process becomes a zombie (its CUDA context's teardown takes ~100 ms on an H200).
        /proc/PID/stat's last field shows it; 0 there means not known yet."""
        fields = stat_fields(h.pid)
        try:
            raw = int(fields[-1]) if fields else 0
        except ValueError:
            return None
        return exit_code(raw) if raw else None

    @staticmethod
    def _reap(h: ExecutorHandle) -> int:
        if h.popen is not None:
            code = h.popen.wait()
            return code if code >= 0 else 128 - code
        # not our child (the zygote's, or adopted): its parent reaps it, but until then the
        # zombie's /proc stat holds its wait status (its last field)
        fields = stat_fields(h.pid)
        if fields and fields[0] == "Z":
            try:
                return exit_code(int(fields[-1]))
            except ValueError:
                pass
        return -1  # reaped already: unknown

    def _lease_ms(self, h: ExecutorHandle) -> float:
        """Starting executors get the start-up lease; an active one gets FIRST_STEP_GRACE leases
        until it says it is warm (its first step loads kernels lazily: on a GPU, seconds)."""
        role = self.leases.role(h.slot)
        if role == Role.STARTING:
            return self.config.startup_lease_ms
        if role == Role.ACTIVE and not self.leases.is_warm(h.slot):
            return self.config.lease_ms * FIRST_STEP_GRACE
        return self.config.lease_ms

    def check_heartbeats(self, now: int) -> None:
        for h in list(self.handles.values()):
            if not h.fenced and self.leases.heartbeat_age_ns(h.slot, now) > self._lease_ms(h) * 1e6:
                self.fence(h, "hang", now)

    def next_deadline_ns(self) -> int:
        deadline = now_ns() + 1_000_000_000
        for h in self.handles.values():
            if not h.fenced:
                last = self.leases.heartbeat_ns(h.slot)
                deadline = min(deadline, last + int(self._lease_ms(h) * 1e6))
        for t in (self._next_spawn_ns, self._takeover_until_ns):
            if t:
                deadline = min(deadline, t)
        if self._waiting_for_zygote(now_ns()):
            deadline = min(deadline, now_ns() + ZYGOTE_POLL_NS)   # spawn as soon as it listens
        return deadline

    # ------------------------------------------------------------------ shutdown
    def stop_all(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        if self.zygote is not None:
            self.zygote.stop()
        for h in self.handles.values():
            h.stopping = True
            if h.identity is not None:
                self.send(h, m.Shutdown(reason="sidecar stopping"))
        deadline = now_ns() + int(timeout_s * 1e9)
        for h in list(self.handles.values()):
            self._wait_or_kill(h, deadline)

    def _wait_or_kill(self, h: ExecutorHandle, deadline: int) -> None:
        import select

        # An executor still starting reads no Shutdown until its warm-up ends: signal it now.
        steps = (None, signal.SIGTERM, signal.SIGKILL) if h.ready else (signal.SIGTERM, signal.SIGKILL)
        for sig in steps:
            if sig is not None:
                try:
                    signal.pidfd_send_signal(h.pidfd, sig)
                except ProcessLookupError:
                    pass
            wait_s = max(0.0, (deadline - now_ns()) / 1e9) if sig is None else 1.0
            if select.select([h.pidfd], [], [], wait_s)[0]:
                break
        self._reap(h)
        os.close(h.pidfd)

    def protection(self, now: int | None = None) -> dict:
        """Would a crash of the active executor be survived? {"ok", "reason", ...}: not while
        executors keep dying before any becomes ready, nor while one cannot be spawned."""
        now = now_ns() if now is None else now
        deaths = [t for t in self._failures if t > self._last_ready_ns]
        out = {"ok": True, "reason": "", "deaths_since_ready": len(deaths)}
        if not self.config.spawn_executors:
            return out
        if len(deaths) >= RESPAWN_LOOP_DEATHS:
            out.update(ok=False, reason=f"executors in a respawn loop: {len(deaths)} died in the last "
                                        f"{(now - deaths[0]) / 1e9:.0f} s, none became ready in between")
        elif self._spawn_error is not None and len(self.live_handles()) < self.target_executors():
            out.update(ok=False, reason=f"cannot spawn an executor: {self._spawn_error}")
        return out

    def status(self) -> list[dict]:
        now = now_ns()
        out = []
        for slot in range(self.tables.geometry.num_leases):
            role = self.leases.role(slot)
            if role == Role.FREE:
                continue
            h = self.handles.get(slot)
            out.append({"slot": slot, "pid": self.leases.pid(slot), "role": role.name.lower(),
                        "epoch": self.leases.epoch(slot),
                        "heartbeat_age_ms": self.leases.heartbeat_age_ns(slot, now) / 1e6,
                        "steps": self.leases.steps(slot),
                        "ready": bool(h and h.ready), "via": h.via if h else "",
                        **(h.info if h else {})})
        return out

