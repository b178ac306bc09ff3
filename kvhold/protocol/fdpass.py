"""File-descriptor passing over a Unix SOCK_SEQPACKET socket (SCM_RIGHTS).

Each message is one datagram: a msgpack map plus up to MAX_FDS descriptors in its
ancillary data. SEQPACKET keeps message boundaries, so descriptors always arrive
with the message they belong to. A truncated datagram or truncated control data is
a protocol error, never a partial read; received descriptors are closed on error.
The peer's credentials (pid, uid) come from SO_PEERCRED, so the sidecar can tie a
descriptor request to the process that holds the lease.
"""
from __future__ import annotations

import os
import socket
import struct

import msgpack

MAX_FDS = 16
MAX_MESSAGE = 64 * 1024


class FdPassError(RuntimeError):
    pass


def listen(path: str, backlog: int = 16) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(backlog)
    return sock


def connect(path: str, timeout: float = 5.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(timeout)
    sock.connect(path)
    return sock


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the connected peer."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def send(sock: socket.socket, message: dict, fds: list[int] | tuple[int, ...] = ()) -> None:
    data = msgpack.packb(message, use_bin_type=True)
    if len(data) > MAX_MESSAGE:
        raise FdPassError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    if len(fds) > MAX_FDS:
        raise FdPassError(f"{len(fds)} descriptors exceed {MAX_FDS}")
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def recv(sock: socket.socket) -> tuple[dict, list[int]]:
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE + 1, MAX_FDS)
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) > MAX_MESSAGE:
            raise FdPassError("truncated message or descriptors")
        if not data:
            raise FdPassError("peer closed the connection")
        try:
            message = msgpack.unpackb(data, raw=False, max_str_len=MAX_MESSAGE,
                                      max_bin_len=MAX_MESSAGE, max_array_len=4096,
                                      max_map_len=256)
        except Exception as exc:  # msgpack raises several unrelated types
            raise FdPassError(f"undecodable message: {exc}") from None
        if not isinstance(message, dict):
            raise FdPassError("message is not a map")
        return message, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
