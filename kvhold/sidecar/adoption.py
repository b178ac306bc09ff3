"""Re-adoption: a sidecar that starts where one of its instance died takes over its live pool.

A sidecar killed outright (SIGKILL, OOM, a crash) leaves its tables segment, its memory
regions and (with `sidecar_wait_ms` > 0) its executors behind: they keep
their mappings, and so the memory, and wait (kvhold.executor.runtime). The next sidecar
of the instance, once it holds the instance lock, looks at what is there before it cleans
anything (`find`):

* the tables segment by name, validated as any reader does (magic, layout version, header
  CRC, offsets), then against this start: the same geometry, a READY pool of the durable
  journal's generation, the same sealed weights (fingerprint), the executor
  token still in place;
* each lease's holder, by its liveness mutex (kvhold.protocol.liveness): held (EBUSY) is a
  live executor, EOWNERDEAD one that died, free one that never took it;
* the KV and weights regions by name, with the sizes this pool needs (host memory; CUDA
  memory has no name: its descriptors are handed back, below).

If some ACTIVE or STANDBY executor is alive and everything agrees, the pool is adoptable. It
is adopted once a live executor has handed back the regions' descriptors and they passed
the checks of kvhold.sidecar.hand_back (the same object as the host region's name; for CUDA,
device memory of the pool's size); if none does within `--sidecar-wait-ms`, `abandon` kills
the executors and the start makes a fresh pool. Adopted:
nothing is unlinked, the generation is kept, and `Adoptable` says which leases live. A
live executor that was still starting or was already fenced is killed first, and waited
for (so is a dead lease's process that has not fully exited), so that no writer of unknown
state remains: a fenced lease no longer holds the epoch
its writes carry, which the next takeover would need to quarantine its pages. Otherwise
(no live executor, anything disagrees) the pool is not adopted; its live executors, which
map memory no one will serve, are killed, and the start goes on as after any crash (stale
names removed, a fresh pool, the durable journal restored).

Fencing stays sound through the gap: the lease table, not the new sidecar's memory, says
who is active. The adopting sidecar keeps every live lease with its epoch and role (the
ACTIVE one stays the only writer; a standby stays idle until promoted), fences only leases
whose holder is dead, and promotes a standby only once it has attached again and no ACTIVE
lease has a live holder (kvhold.sidecar.supervisor, `Supervisor.adopt`).
"""
from __future__ import annotations

import errno
import logging
import os
import select
import signal
import time
from dataclasses import dataclass, field

import posix_ipc

from kvhold.protocol.layout import PoolState, Role, WeightsState
from kvhold.protocol.leases import LeaseTable
from kvhold.protocol.memory import HOST_ALIGN, SHM_DIR, round_up
from kvhold.protocol.tables import Tables, TableFormatError

log = logging.getLogger(__name__)
KILL_WAIT_S = 5.0


class AdoptionError(RuntimeError):
    """The predecessor's pool could have been adopted, but one of its processes would not exit."""


@dataclass(frozen=True, slots=True)
class LeaseHolder:
    slot: int
    pid: int
    role: Role
    epoch: int


@dataclass(slots=True)
class Adoptable:
    tables: Tables
    live: list[LeaseHolder]            # ACTIVE / STANDBY leases whose executor runs
    dead: list[LeaseHolder]            # leases whose holder is gone (any role)
    previous_pid: int = 0
    killed: list[int] = field(default_factory=list)    # starting or fenced executors killed
    taken_back: object = None          # kvhold.sidecar.hand_back.TakenBack, once handed back


def _holder_state(tables: Tables, slot: int) -> str:
    """'live' (the mutex is held), 'dead' (its holder died), or 'free' (never taken)."""
    mutex = tables.liveness_mutex(slot)
    rc = mutex.trylock()
    if rc == errno.EBUSY:
        return "live"
    if rc == errno.EOWNERDEAD:
        mutex.release_after_death()
        return "dead"
    if rc == 0:
        mutex.release_after_death()      # consistent (a no-op) and unlock
        return "free"
    return "dead"


def _is_executor(pid: int) -> bool:
    """`pid` runs a kvhold executor of ours (a guard against a reused pid)."""
    try:
        st = os.stat(f"/proc/{pid}")
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return False
    return st.st_uid == os.getuid() and b"kvhold" in cmdline


def _kill_and_wait(pids: list[int], timeout_s: float = KILL_WAIT_S) -> list[int]:
    """SIGKILL each and wait for its exit; the pids that did not exit in time."""
    fds = {}
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        fds[pid] = fd
    deadline = time.monotonic() + timeout_s
    left = []
    for pid, fd in fds.items():
        if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            left.append(pid)
        os.close(fd)
    return left


def find(paths, geometry, *, backend: str, generation: int, fingerprint: str, token_path,
         region_sizes: dict[str, int]) -> Adoptable | None:
    """The predecessor's pool if it can be adopted, else None (its executors then killed)."""
    try:
        tables = Tables.adopt(paths.shm_name("tables"))
    except posix_ipc.ExistentialError:
        return None
    except (TableFormatError, OSError, ValueError) as exc:
        log.warning("the tables of a previous sidecar cannot be read (%s): not adopting them", exc)
        return None
    holders, live, dead, starting = [], [], [], []
    leases = LeaseTable(tables)
    for slot in range(tables.geometry.num_leases):
        role = leases.role(slot)
        if role == Role.FREE:
            continue
        h = LeaseHolder(slot, leases.pid(slot), role, leases.epoch(slot))
        holders.append(h)
        state = _holder_state(tables, slot)
        if state == "live" and role in (Role.ACTIVE, Role.STANDBY):
            live.append(h)
        elif state == "dead" or not _is_executor(h.pid):
            dead.append(h)
        else:                          # starting, fenced, or alive without its mutex
            starting.append(h)
    reason = (_refusal(tables, geometry, backend, generation, fingerprint, token_path, live)
              or (_regions_refusal(paths, region_sizes) if backend == "host" else None))
    if reason is not None:
        doomed = [h.pid for h in live + starting if _is_executor(h.pid)]
        log.warning("not adopting the pool of sidecar pid %d: %s%s", tables.sidecar_pid, reason,
                    f"; killing its executors {doomed}" if doomed else "")
        _kill_and_wait(doomed)
        tables.close()
        return None
    # a dead holder's other threads may still be finishing writes: it is waited for too
    left = _kill_and_wait([h.pid for h in starting] + [h.pid for h in dead if _is_executor(h.pid)])
    if left:
        tables.close()
        raise AdoptionError(f"executors {left} of the previous sidecar did not exit after SIGKILL "
                            f"within {KILL_WAIT_S:.0f} s: not adopting a pool they may still write")
    return Adoptable(tables=tables, live=live, dead=dead + starting, previous_pid=tables.sidecar_pid,
                     killed=[h.pid for h in starting])


def abandon(found: Adoptable, reason: str) -> None:
    """Give up a pool found adoptable (its regions were not handed back): kill its live
    executors, which map memory no one will serve, and close its tables."""
    doomed = [h.pid for h in found.live if _is_executor(h.pid)]
    log.warning("not adopting the pool of sidecar pid %d: %s%s", found.previous_pid, reason,
                f"; killing its executors {doomed}" if doomed else "")
    _kill_and_wait(doomed)
    found.tables.close()


def _regions_refusal(paths, sizes: dict[str, int]) -> str | None:
    for name, size in sizes.items():
        try:
            found = os.stat(os.path.join(SHM_DIR, paths.shm_name(name).lstrip("/"))).st_size
        except OSError as exc:
            return f"its {name} region cannot be opened ({exc.strerror})"
        if found != round_up(size, HOST_ALIGN):
            return f"its {name} region holds {found} bytes, this pool needs {round_up(size, HOST_ALIGN)}"
    return None


def _refusal(tables: Tables, geometry, backend: str, generation: int, fingerprint: str,
             token_path, live) -> str | None:
    if not live:
        return "no executor of it is alive"
    if tables.geometry != geometry:
        return "its table geometry differs from this start's"
    if tables.state != PoolState.READY:
        return f"its pool state is {tables.state.name}"
    if tables.generation != generation:
        return f"its generation {tables.generation} is not the journal's {generation}"
    if fingerprint:
        if tables.weights_state != WeightsState.SEALED:
            return f"its weights are {tables.weights_state.name}, not sealed"
        if tables.weights_fingerprint != fingerprint:
            return "its weights are another model's"
    if not os.path.isfile(token_path):
        return f"the executor token {token_path} is gone"
    return None
