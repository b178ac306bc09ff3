"""Executor leases: who may write, under which epoch, and whether it is alive.

A lease slot names one executor process (pid), its role, its epoch and its last
heartbeat (CLOCK_MONOTONIC ns, comparable across processes on one host). The
sidecar grants, promotes, fences and frees slots; the executor only writes its
heartbeat and step counter. Fencing replaces the epoch with a new, larger one:
every executor write is stamped with the epoch it was granted, and `Lease.check`
fails once the slot's epoch moved on, so a fenced process that wakes up learns
it and exits instead of writing.
"""
from __future__ import annotations

import time

from kvhold.protocol.layout import LeaseFlag, Role
from kvhold.protocol.tables import Tables


class InvalidTransition(RuntimeError):
    pass


class Fenced(RuntimeError):
    """This executor's epoch was revoked: it must stop writing and exit."""


TRANSITIONS: dict[Role, frozenset[Role]] = {
    Role.FREE: frozenset({Role.STARTING}),
    Role.STARTING: frozenset({Role.STANDBY, Role.ACTIVE, Role.FENCED, Role.FREE}),
    Role.STANDBY: frozenset({Role.ACTIVE, Role.FENCED, Role.FREE}),
    Role.ACTIVE: frozenset({Role.FENCED, Role.FREE}),
    Role.FENCED: frozenset({Role.FREE}),
}


def now_ns() -> int:
    return time.monotonic_ns()


class LeaseTable:
    """Sidecar-side operations on the lease slots."""

    def __init__(self, tables: Tables):
        self.tables = tables
        self.leases = tables.leases

    def role(self, slot: int) -> Role:
        return Role(int(self.leases["role"][slot]))

    def epoch(self, slot: int) -> int:
        return int(self.leases["epoch"][slot])

    def pid(self, slot: int) -> int:
        return int(self.leases["pid"][slot])

    def free_slot(self) -> int | None:
        free = (self.leases["role"] == Role.FREE).nonzero()[0]
        return int(free[0]) if len(free) else None

    def _move(self, slot: int, new: Role) -> None:
        old = self.role(slot)
        if new not in TRANSITIONS[old]:
            raise InvalidTransition(f"lease {slot}: {old.name} -> {new.name}")
        self.leases["role"][slot] = new

    def grant(self, slot: int, pid: int) -> int:
        """Give a free slot to `pid` (STARTING) under a new epoch."""
        self._move(slot, Role.STARTING)
        self.tables.liveness_mutex(slot).init()  # its last holder has exited: slots free on exit
        epoch = self.tables.next_epoch()
        now = now_ns()
        lease = self.leases
        lease["pid"][slot] = pid
        lease["epoch"][slot] = epoch
        lease["heartbeat_ns"][slot] = now
        lease["attached_ns"][slot] = now
        lease["fenced_ns"][slot] = 0
        lease["steps"][slot] = 0
        lease["open_step"][slot] = 0
        lease["flags"][slot] = 0
        lease["exit_code"][slot] = 0
        return epoch

    def set_role(self, slot: int, role: Role) -> None:
        self._move(slot, role)
        self.leases["heartbeat_ns"][slot] = now_ns()  # a role change restarts the lease clock

    def fence(self, slot: int) -> int:
        """Revoke the slot's epoch; returns the fenced (old) epoch."""
        old_epoch = self.epoch(slot)
        self._move(slot, Role.FENCED)
        self.leases["epoch"][slot] = self.tables.next_epoch()
        self.leases["fenced_ns"][slot] = now_ns()
        return old_epoch

    def release(self, slot: int, exit_code: int = 0) -> None:
        self._move(slot, Role.FREE)
        self.leases["exit_code"][slot] = exit_code

    def heartbeat_age_ns(self, slot: int, now: int | None = None) -> int:
        return (now or now_ns()) - self.heartbeat_ns(slot)

    def heartbeat_ns(self, slot: int) -> int:
        return int(self.leases["heartbeat_ns"][slot])

    def fenced_ns(self, slot: int) -> int:
        """When the slot was last fenced (0 if never since its grant)."""
        return int(self.leases["fenced_ns"][slot])

    def is_warm(self, slot: int) -> bool:
        """The executor said its steps now come at their steady rate (Lease.mark_warm)."""
        return bool(int(self.leases["flags"][slot]) & LeaseFlag.WARM)

    def steps(self, slot: int) -> int:
        return int(self.leases["steps"][slot])

    def open_step(self, slot: int) -> int:
        """The step the slot's executor was running (Lease.open_step), 0 if between steps."""
        return int(self.leases["open_step"][slot])


class Lease:
    """Executor-side view of its own lease slot."""

    def __init__(self, tables: Tables, slot: int, epoch: int):
        self.tables = tables
        self.slot = slot
        self.epoch = epoch
        self._leases = tables.leases

    @property
    def current_epoch(self) -> int:
        """The slot's epoch now: this lease's own until the sidecar fences it."""
        return int(self._leases["epoch"][self.slot])

    @property
    def valid(self) -> bool:
        return self.current_epoch == self.epoch

    def check(self) -> None:
        if not self.valid:
            raise Fenced(f"lease {self.slot} epoch {self.epoch} was fenced (now {self.current_epoch})")

    def mark_warm(self) -> None:
        """Tell the sidecar this executor's steps now come at their steady rate."""
        self.check()
        self._leases["flags"][self.slot] |= LeaseFlag.WARM

    def mark_cold(self) -> None:
        """Tell the sidecar a step may take a first step's time again (a kernel compiles in it:
        kvhold.executor.cuda.compile_watch); `mark_warm` ends it."""
        self.check()
        self._leases["flags"][self.slot] = int(self._leases["flags"][self.slot]) & ~int(LeaseFlag.WARM)

    def is_warm(self) -> bool:
        return bool(int(self._leases["flags"][self.slot]) & LeaseFlag.WARM)

    def open_step(self, step: int) -> None:
        """Publish the number of the step about to run (0: the step is over). The journal names
        the requests in it (Journal.mark_step), so the sidecar knows who was in a step that
        killed its executor."""
        self.check()
        self._leases["open_step"][self.slot] = step

    def beat(self, steps: int | None = None) -> None:
        """Record liveness; raises Fenced rather than beating under a revoked epoch."""
        self.check()
        self._leases["heartbeat_ns"][self.slot] = now_ns()
        if steps is not None:
            self._leases["steps"][self.slot] = steps
