"""The executor's link to its sidecar: attach, region descriptors, control messages.

`Channel.attach` sends the token, waits (bounded) for the lease, then fetches the
region descriptors over the SCM_RIGHTS socket with the one-time nonce of that
lease. Every receive has a deadline: an executor never hangs on a sidecar that
is gone (it also watches the sidecar's pidfd, see runtime).
"""
from __future__ import annotations

import logging
import os

import zmq

from kvhold.protocol import fdpass, messages as m, wire
from kvhold.protocol.errors import error_from_code
from kvhold.protocol.hand_back import HandBack
from kvhold.protocol.naming import InstancePaths

log = logging.getLogger(__name__)


class Channel:
    def __init__(self, paths: InstancePaths):
        self.paths = paths
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(paths.control_endpoint)
        self._poller: tuple[int, zmq.Poller] | None = None     # (wake fd, poller over it and the socket)

    def send(self, msg) -> None:
        self.sock.send(wire.encode(msg))

    def recv(self, timeout_ms: int, wake_fd: int = -1):
        """One message, or None after timeout_ms (or sooner once `wake_fd`, e.g. the sidecar's
        pidfd, turns readable). Error replies become exceptions."""
        if wake_fd >= 0 and timeout_ms:
            if self._poller is None or self._poller[0] != wake_fd:
                poller = zmq.Poller()
                poller.register(self.sock, zmq.POLLIN)
                poller.register(wake_fd, zmq.POLLIN)
                self._poller = (wake_fd, poller)
            if self.sock not in dict(self._poller[1].poll(timeout_ms)):
                return None
        elif not self.sock.poll(timeout_ms, zmq.POLLIN):
            return None
        msg = wire.decode(self.sock.recv())
        if isinstance(msg, m.Error):
            raise error_from_code(msg.code, msg.message)
        return msg

    def attach(self, token: str, timeout_ms: int = 10_000, wake_fd: int = -1) -> m.Attached:
        """The lease; `wake_fd` (the sidecar's pidfd) readable ends the wait for it early."""
        self.send(m.Attach(token=token, pid=os.getpid()))
        reply = self.recv(timeout_ms, wake_fd=wake_fd)
        if reply is None:
            raise TimeoutError(f"no answer from the sidecar at {self.paths.control_endpoint} "
                               f"within {timeout_ms} ms (or it exited)")
        if not isinstance(reply, m.Attached):
            raise RuntimeError(f"unexpected {reply.TYPE} in reply to attach")
        return reply

    def fetch_fds(self, attached: m.Attached, timeout_s: float = 5.0) -> dict[str, int]:
        sock = fdpass.connect(str(self.paths.fd_socket), timeout_s)
        try:
            fdpass.send(sock, {"slot": attached.slot, "epoch": attached.epoch, "nonce": attached.nonce})
            reply, fds = fdpass.recv(sock)
        finally:
            sock.close()
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            raise PermissionError(f"sidecar refused region descriptors: {reply.get('error')}")
        names = reply.get("regions", [])
        if len(names) != len(fds):
            for fd in fds:
                os.close(fd)
            raise RuntimeError("descriptor count does not match region names")
        return dict(zip(names, fds))

    def hand_back(self, token: str, slot: int, epoch: int, kept: dict, timeout_s: float = 5.0) -> dict:
        """Give a restarted sidecar the region descriptors this executor kept (name -> (fd,
        RegionInfo)); the fds stay open here. Returns the sidecar's reply."""
        names = list(kept)
        msg = HandBack(token=token, pid=os.getpid(), slot=slot, epoch=epoch,
                       regions=tuple(kept[n][1] for n in names))
        sock = fdpass.connect(str(self.paths.fd_socket), timeout_s)
        try:
            fdpass.send(sock, msg.to_wire(), [kept[n][0] for n in names])
            reply, stray = fdpass.recv(sock)
        finally:
            sock.close()
        for fd in stray:
            os.close(fd)
        return reply

    def close(self) -> None:
        if not self.ctx.closed:
            self.sock.close(0)
            self.ctx.term()
