"""Taking a dead sidecar's regions back from its executors (kvhold.protocol.hand_back).

A sidecar that adopts a predecessor's pool (kvhold.sidecar.adoption) needs its memory
regions before it can serve: it opens the descriptor socket, writes its pid into the table
header (the executors' sign to attach again) and waits, up to `--sidecar-wait-ms`, for a
live executor to hand back the descriptors it kept. It accepts the first complete set
that passes every check, and refuses each other request with its reason:

* who: the executor token (compared in constant time), the pid the request names is the
  connection's SO_PEERCRED pid and uid, and it is a live holder of an adopted lease, with
  that lease's slot and epoch;
* what: one descriptor per region of this pool, each region's RegionInfo (name, backend,
  size, device, address hint) the one this start computes from the tables' geometry and
  the model;
* the descriptor itself: on the host, the same object as the region's shm name (st_dev,
  st_ino), which the sidecar then opens by name; on CUDA, an import of the handle in this
  process (no CUDA context: kvhold.protocol.cuda_vmm.adopt_handle) that is memory of the
  pool's device and maps the region's size. The sidecar keeps the descriptor and the
  imported handle: new executors get dups of the descriptor, and the handle keeps the
  memory alive as the creator's did.

If no executor hands back a valid set in time (or every live one was refused or died),
the pool is not adopted: its executors are killed and the start goes on as after any crash
(a fresh pool; the requests come back from the durable journal). Executors that hand back
after the set is complete are told it is not needed (`late_reply`) and attach as usual.
"""
from __future__ import annotations

import hmac
import logging
import os
import select
import socket
import time
from dataclasses import dataclass, field

from kvhold.protocol import fdpass
from kvhold.protocol.hand_back import HandBack, HandBackFormatError
from kvhold.protocol.leases import LeaseTable
from kvhold.protocol.memory import SHM_DIR, RegionInfo
from kvhold.protocol.procfs import pid_alive

log = logging.getLogger(__name__)
RECV_TIMEOUT_S = 0.5


@dataclass(slots=True)
class TakenBack:
    regions: dict[str, tuple[int, object]]      # CUDA: name -> (descriptor, imported handle)
    record: dict = field(default_factory=dict)   # for the status's adoption record


class _Refused(Exception):
    pass


class Receiver:
    def __init__(self, found, expected: dict[str, RegionInfo], token: str, paths, backend: str):
        """`found`: kvhold.sidecar.adoption.Adoptable; `expected`: name -> RegionInfo of this pool."""
        self.found = found
        self.expected = expected
        self.token = token
        self.paths = paths
        self.backend = backend
        self.refused: list[dict] = []
        self._given_up: set[int] = set()     # live holders refused once (they attach, not retry)

    def wait(self, listener: socket.socket, wait_s: float) -> TakenBack | None:
        t0 = time.monotonic()
        deadline = t0 + wait_s
        live = {h.pid for h in self.found.live}
        while time.monotonic() < deadline:
            if not live - self._given_up - {p for p in live if not pid_alive(p)}:
                log.error("every live executor was refused or died: no descriptors to take back")
                return None
            ready = select.select([listener], [], [], min(0.2, max(0.0, deadline - time.monotonic())))[0]
            if not ready:
                continue
            try:
                conn, _ = listener.accept()
            except BlockingIOError:
                continue
            taken = self._serve(conn)
            if taken is not None:
                taken.record.update(ms=round((time.monotonic() - t0) * 1e3, 2), refused=self.refused)
                return taken
        log.error("no executor handed back the regions' descriptors within %.1f s", wait_s)
        return None

    def _serve(self, conn: socket.socket) -> TakenBack | None:
        fds: list[int] = []
        pid = 0
        try:
            conn.settimeout(RECV_TIMEOUT_S)
            pid, uid, _ = fdpass.peer_credentials(conn)
            req, fds = fdpass.recv(conn)
            try:
                taken = self._check(req, fds, pid, uid)
            except _Refused as exc:
                self.refused.append({"pid": pid, "reason": str(exc)})
                log.warning("refused the descriptors handed back by pid %d: %s", pid, exc)
                _send(conn, {"ok": False, "error": str(exc)})
                return None
            _send(conn, {"ok": True, "kept": True})
            log.warning("took the regions back from executor pid %d: %s", pid,
                        "; ".join(f"{n}: {r['check']}" for n, r in taken.record["regions"].items()))
            return taken
        except (OSError, fdpass.FdPassError) as exc:
            log.warning("a descriptor hand-back from pid %d failed: %s", pid, exc)
            return None
        finally:
            _close(fds)          # what _check did not keep (it empties the list of what it keeps)
            conn.close()

    def _check(self, req: dict, fds: list[int], peer_pid: int, peer_uid: int) -> TakenBack:
        try:
            hb = HandBack.from_wire(req)
        except HandBackFormatError as exc:
            raise _Refused(str(exc)) from None
        if not hmac.compare_digest(hb.token.encode(), self.token.encode()):
            raise _Refused("wrong executor token")
        if hb.pid != peer_pid or peer_uid != os.getuid():
            raise _Refused(f"the request names pid {hb.pid}, the connection is pid {peer_pid} uid {peer_uid}")
        holder = next((h for h in self.found.live if h.pid == peer_pid), None)
        if holder is None:
            raise _Refused(f"pid {peer_pid} holds no live lease of the adopted pool")
        self._given_up.add(peer_pid)          # one attempt per holder: refused, it attaches without
        leases = LeaseTable(self.found.tables)
        if ((hb.slot, hb.epoch) != (holder.slot, holder.epoch)
                or leases.epoch(hb.slot) != hb.epoch or leases.pid(hb.slot) != peer_pid):
            raise _Refused(f"lease {hb.slot} epoch {hb.epoch} is not pid {peer_pid}'s "
                           f"(lease {holder.slot} epoch {holder.epoch})")
        if len(fds) != len(hb.regions):
            raise _Refused(f"{len(fds)} descriptors for {len(hb.regions)} regions")
        names = [r.name for r in hb.regions]
        if sorted(names) != sorted(self.expected):
            raise _Refused(f"regions {sorted(names)}, this pool has {sorted(self.expected)}")
        for got in hb.regions:
            want = self.expected[got.name]
            for attr in ("backend", "size", "device", "va_hint"):
                if getattr(got, attr) != getattr(want, attr):
                    raise _Refused(f"region {got.name}: {attr} {getattr(got, attr)!r}, this pool's is "
                                   f"{getattr(want, attr)!r}")
        by_name = dict(zip(names, fds))
        record = {"pid": peer_pid, "slot": hb.slot, "epoch": hb.epoch, "backend": self.backend,
                  "regions": {}}
        if self.backend == "host":
            for name, fd in by_name.items():
                record["regions"][name] = {"size": self.expected[name].size,
                                           "check": self._same_shm_object(name, fd)}
            _close(fds)
            fds.clear()
            return TakenBack(regions={}, record=record)
        taken: dict[str, tuple[int, object]] = {}
        try:
            from kvhold.protocol import cuda_vmm

            for name, fd in by_name.items():
                want = self.expected[name]
                try:
                    handle, checked = cuda_vmm.adopt_handle(fd, want.size, want.device)
                except cuda_vmm.CudaError as exc:
                    raise _Refused(f"region {name}: {exc}") from None
                taken[name] = (fd, handle)
                record["regions"][name] = {"size": want.size, "check": checked}
        except BaseException:
            for _, handle in taken.values():
                cuda_vmm.driver().cuMemRelease(handle)
            raise
        fds.clear()                  # owned by the regions now
        return TakenBack(regions=taken, record=record)

    def _same_shm_object(self, name: str, fd: int) -> str:
        shm = self.paths.shm_name(name)
        try:
            named = os.stat(os.path.join(SHM_DIR, shm.lstrip("/")))
        except OSError as exc:
            raise _Refused(f"region {name}: {shm} cannot be opened ({exc.strerror})") from None
        got = os.fstat(fd)
        if (got.st_dev, got.st_ino) != (named.st_dev, named.st_ino):
            raise _Refused(f"region {name}: the descriptor is not {shm} (another object: "
                           f"dev {got.st_dev} inode {got.st_ino})")
        return f"the same object as {shm}"


def late_reply(req: dict, fds: list[int]) -> dict:
    """A hand-back after the regions were taken back (or in a sidecar that made its own)."""
    _close(fds)
    return {"ok": True, "kept": False, "reason": "this sidecar holds the regions already"}


def _send(conn: socket.socket, message: dict) -> None:
    try:
        fdpass.send(conn, message)
    except OSError as exc:
        log.warning("could not answer a descriptor hand-back: %s", exc)


def _close(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


