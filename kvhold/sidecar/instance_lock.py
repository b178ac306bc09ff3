"""One sidecar per instance, and cleanup after a predecessor that was killed.

The sidecar holds an exclusive flock on <runtime dir>/lock for its whole life.
The kernel drops the lock when the process dies however it dies, so a new
sidecar that gets the lock knows every shm object and socket of this instance is
stale: it removes them (and says so in the log) instead of failing on them. A
sidecar that does not get the lock refuses to start and names the holder.
"""
from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

import posix_ipc

from kvhold.protocol.naming import InstancePaths, ensure_private_dir

log = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")


class InstanceBusy(RuntimeError):
    pass


class InstanceLock:
    def __init__(self, paths: InstancePaths):
        self.paths = paths
        ensure_private_dir(paths.runtime_dir.parent)
        ensure_private_dir(paths.runtime_dir)
        self._fd = os.open(paths.lock_file, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            raise InstanceBusy(f"instance {paths.instance!r} is already served by sidecar pid "
                               f"{holder} (lock {paths.lock_file})") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def remove_stale(self, shm_whats: tuple[str, ...]) -> list[str]:
        """Unlink leftovers of a dead predecessor; returns what was removed."""
        removed = []
        names = {self.paths.shm_name(w) for w in shm_whats}
        if SHM_DIR.is_dir():
            names |= {"/" + p.name for p in SHM_DIR.glob(self.paths.shm_prefix + "*")}
        for name in sorted(names):
            try:
                posix_ipc.unlink_shared_memory(name)
                removed.append(name)
            except posix_ipc.ExistentialError:
                pass
        for sock in (self.paths.control_socket, self.paths.client_socket, self.paths.fd_socket):
            if sock.exists():
                sock.unlink()
                removed.append(str(sock))
        if removed:
            log.warning("removed %d stale object(s) of a previous sidecar of instance %r: %s",
                        len(removed), self.paths.instance, ", ".join(removed))
        return removed

    def release(self) -> None:
        if self._fd >= 0:
            try:
                self.paths.lock_file.unlink()
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = -1
