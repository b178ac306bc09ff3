"""One sidecar per instance, and cleanup after a predecessor that was killed.

The sidecar holds an exclusive flock on <runtime dir>/lock for its whole life.
The kernel drops the lock when the process dies however it dies, so a new
sidecar that gets the lock knows every shm object and socket of this instance is
stale: it removes them (and says so in the log) instead of failing on them. A
sidecar that does not get the lock refuses to start and names the holder, and
removes nothing: only the holder of the lock cleans up (stale objects at its start,
its own objects at its stop).

A stopping holder unlinks the lock file while it still holds it. A sidecar that
opened the file just before that unlink could then lock an inode no longer at the
path, while a third one creates and locks a fresh file: two holders, and the
second would remove the first's sockets and shm as "stale". So the lock counts
only when the locked inode is still the one at the path; otherwise it is taken
again on the file now there.

A spare sidecar (`kvhold sidecar --spare`, `wait_for_holder_death`) waits in flock for the
lock of a running sidecar, having loaded everything it can beforehand. The kernel hands it
the lock the moment the holder dies, so its takeover starts without a new process's start.
Which end it was tells the lock file: a holder that died left the file at the path (the
spare takes over); one that stopped unlinked it first (the spare waits for the next holder).
A spare takes over only from a holder it saw: never an instance nobody serves. It saw the
holder when it found it holding the lock; that holder's death counts whether the spare was
blocked in flock at the time or between two looks (a pool restart's new image, same pid,
that dies before the spare waits on its new lock file). The spare writes its pid into the
lock file the moment it has the lock, before it stops saying whom it waits on, so that
`spare_takes_over` can tell, once the holder has exited, whether the spare takes over.
"""
from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path
from typing import Callable

import posix_ipc

from kvhold.protocol.memory import SHM_DIR as _SHM_DIR
from kvhold.protocol.naming import InstancePaths, ensure_private_dir
from kvhold.protocol.procfs import pid_alive

log = logging.getLogger(__name__)
SHM_DIR = Path(_SHM_DIR)


LOCK_ATTEMPTS = 16


class InstanceBusy(RuntimeError):
    pass


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


SPARE_POLL_S = 0.05          # a spare's look for a holder while no sidecar runs


def _first_line(data: str) -> str:
    """The holder a lock file names: its first line. A rewrite (`_write_holder`) can leave the
    tail of a longer previous pid after it for a moment."""
    return data.split("\n", 1)[0].strip()


def _holder(fd: int) -> str:
    return _first_line(os.pread(fd, 32, 0).decode(errors="replace")) or "?"


def _holder_pid(fd: int) -> int:
    holder = _holder(fd)
    return int(holder) if holder.isdigit() else 0


def _write_holder(fd: int) -> None:
    """Name this process in the lock file, never leaving it empty: the new line is written over
    the old one, then the file cut to it (`kvhold serve`, reading it as a spare takes over, saw
    an empty file between a truncate and a write, took the takeover for a failure and started a
    second sidecar)."""
    data = f"{os.getpid()}\n".encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def wait_for_holder_death(paths: InstancePaths, on_waiting: Callable[[int], None] | None = None,
                          poll_s: float = SPARE_POLL_S) -> tuple[int, int]:
    """Block until a sidecar of this instance that holds the lock dies, and return
    (locked fd, the dead holder's pid); the lock file names this process from then on.
    `on_waiting(pid)` is called each time the wait starts on a holder. A holder that stops
    cleanly (it unlinks the lock file) is not a death: the wait goes on for the next one."""
    ensure_private_dir(paths.runtime_dir.parent)
    ensure_private_dir(paths.runtime_dir)
    seen = 0                # the holder this spare waited on last
    while True:
        try:
            fd = os.open(paths.lock_file, os.O_RDWR)      # never creates it: only a sidecar does
        except FileNotFoundError:
            time.sleep(poll_s)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            seen = _holder_pid(fd)
            if on_waiting is not None:
                on_waiting(seen)
            fcntl.flock(fd, fcntl.LOCK_EX)             # until the holder's end, however it ends
            if _same_file(fd, paths.lock_file):           # it died: the file is still in place
                _write_holder(fd)
                return fd, seen
        else:   # free, still in place and naming the holder seen last: it died between two looks
            if seen and _holder_pid(fd) == seen and _same_file(fd, paths.lock_file):
                _write_holder(fd)
                return fd, seen
        os.close(fd)             # no holder (none seen: not ours to take), or a clean stop
        time.sleep(poll_s)


def spare_takes_over(paths: InstancePaths, spare_pid: int, dead_pid: int) -> bool:
    """Whether the waiting spare `spare_pid` takes over from the sidecar `dead_pid`, which has
    exited (`kvhold serve` asks). Yes if the lock file names the spare (it took over), or names
    the dead sidecar, which the spare says it waits on (it died holding the lock: the spare has
    it, or gets it at its next look). No if the file is gone (a stop, a start that failed, a
    pool restart's new image that died before it took the lock) or the spare never saw that
    sidecar: then it waits on for the next holder."""
    try:        # first whom it waits on: a spare that takes over names itself in the lock, then removes this
        waits_on = int(paths.spare_file(spare_pid).read_text().strip())
    except (FileNotFoundError, ValueError):
        waits_on = 0
    try:
        holder = int(_first_line(paths.lock_file.read_text()))
    except (FileNotFoundError, ValueError):
        return False
    return holder == spare_pid or (holder == dead_pid and waits_on == dead_pid)


class InstanceLock:
    def __init__(self, paths: InstancePaths, held_fd: int | None = None):
        """`held_fd`: the lock already taken (`wait_for_holder_death`), the file still at its path."""
        self.paths = paths
        ensure_private_dir(paths.runtime_dir.parent)
        ensure_private_dir(paths.runtime_dir)
        self._fd = held_fd if held_fd is not None else self._take(paths)
        _write_holder(self._fd)

    @staticmethod
    def _take(paths: InstancePaths) -> int:
        for _ in range(LOCK_ATTEMPTS):
            fd = os.open(paths.lock_file, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise InstanceBusy(f"instance {paths.instance!r} is already served by sidecar pid "
                                   f"{holder} (lock {paths.lock_file})") from None
            if _same_file(fd, paths.lock_file):
                return fd
            os.close(fd)        # a stopping holder unlinked it: lock the file at the path now
        raise InstanceBusy(f"instance {paths.instance!r}: the lock file {paths.lock_file} keeps "
                           f"being replaced; is another sidecar starting and stopping?")

    def remove_stale(self, shm_whats: tuple[str, ...], keep_shm: bool = False,
                     keep_client_socket: bool = False) -> list[str]:
        """Unlink leftovers of a dead predecessor; returns what was removed. `keep_shm`: its
        sockets only, its shm objects being adopted with the executors that map them
        (kvhold.sidecar.adoption). `keep_client_socket`: a frontend process owns it."""
        removed = []
        names = {self.paths.shm_name(w) for w in shm_whats} if not keep_shm else set()
        if SHM_DIR.is_dir() and not keep_shm:   # other parts of ours too, but never another instance's: the
            # prefix of instance "a" also starts the names of instance "a-b" ("...-a-b-tables")
            prefix = self.paths.shm_prefix
            names |= {"/" + p.name for p in SHM_DIR.glob(prefix + "*")
                      if "-" not in p.name[len(prefix):]}
        for name in sorted(names):
            try:
                posix_ipc.unlink_shared_memory(name)
                removed.append(name)
            except posix_ipc.ExistentialError:
                pass
        socks = [self.paths.control_socket, self.paths.fd_socket]
        if not keep_client_socket:
            socks.append(self.paths.client_socket)
        for sock in socks:
            if sock.exists():
                sock.unlink()
                removed.append(str(sock))
        for pid in self.paths.spare_pids():      # a spare that died waiting left its file
            if not pid_alive(pid):
                self.paths.spare_file(pid).unlink(missing_ok=True)
                removed.append(str(self.paths.spare_file(pid)))
        if removed:
            log.warning("removed %d stale object(s) of a previous sidecar of instance %r: %s",
                        len(removed), self.paths.instance, ", ".join(removed))
        return removed

    def release(self) -> None:
        """Unlink the lock file while still holding it, then drop the lock (see the module
        docstring for why a sidecar that locked the unlinked inode takes it again)."""
        if self._fd >= 0:
            try:
                self.paths.lock_file.unlink()
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = -1
