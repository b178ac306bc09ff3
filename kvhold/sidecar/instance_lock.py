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
"""
from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

import posix_ipc

from kvhold.protocol.memory import SHM_DIR as _SHM_DIR
from kvhold.protocol.naming import InstancePaths, ensure_private_dir

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


class InstanceLock:
    def __init__(self, paths: InstancePaths):
        self.paths = paths
        ensure_private_dir(paths.runtime_dir.parent)
        ensure_private_dir(paths.runtime_dir)
        self._fd = -1
        for _ in range(LOCK_ATTEMPTS):
            fd = os.open(paths.lock_file, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise InstanceBusy(f"instance {paths.instance!r} is already served by sidecar pid "
                                   f"{holder} (lock {paths.lock_file})") from None
            if _same_file(fd, paths.lock_file):
                self._fd = fd
                break
            os.close(fd)        # a stopping holder unlinked it: lock the file at the path now
        else:
            raise InstanceBusy(f"instance {paths.instance!r}: the lock file {paths.lock_file} keeps "
                               f"being replaced; is another sidecar starting and stopping?")
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

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
