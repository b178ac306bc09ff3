"""ZAP handler for the TCP client socket, served from the sidecar's own poll loop.

libzmq asks the handler bound at inproc://zeromq.zap.01 of the socket's context
about every CURVE handshake (RFC 27). The gate admits a client whose public key
is one of the `*.key` certificates in the authorized-keys directory (re-read when
files are added or removed there), or any CURVE client when there is no such
directory. Everything else, including a NULL (plaintext) peer, is denied and never
gets a single message to the frontend. Being one non-blocking REP socket in the
sidecar's poller, it needs no thread and no event loop.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

log = logging.getLogger(__name__)
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_VERSION = b"1.0"
DENIAL_LOG_INTERVAL_S = 5.0


class ZapGate:
    def __init__(self, ctx: zmq.Context, authorized_keys: Path | None):
        self.authorized_keys = authorized_keys
        self.socket = ctx.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)
        self._keys: frozenset[bytes] = frozenset()
        self._keys_mtime: int | None = None
        self.num_allowed = 0
        self.num_denied = 0
        self._last_denial_log = 0.0
        self._denials_unlogged = 0

    def on_readable(self, budget: int = 64) -> None:
        for _ in range(budget):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.socket.send_multipart(self._answer(frames))

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) < 6 or frames[0] != ZAP_VERSION:
            return self._deny(frames[1] if len(frames) > 1 else b"", b"bad ZAP request", "?")
        request_id, address, mechanism, credentials = frames[1], frames[3], frames[5], frames[6:]
        peer = address.decode("ascii", "replace")
        if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            return self._deny(request_id, b"CURVE required", peer)
        key = z85.encode(credentials[0])
        allowed = self._authorized()
        if allowed is not None and key not in allowed:
            return self._deny(request_id, b"unknown key", f"{peer} key {key.decode()}")
        self.num_allowed += 1
        log.info("CURVE client %s from %s admitted", key.decode(), peer)
        return [ZAP_VERSION, request_id, b"200", b"OK", key, b""]

    def _authorized(self) -> frozenset[bytes] | None:
        """The allowed public keys (z85), or None for any CURVE client."""
        if self.authorized_keys is None:
            return None
        try:
            mtime = os.stat(self.authorized_keys).st_mtime_ns
        except OSError:
            return frozenset()  # the directory vanished: nobody is authorized
        if mtime != self._keys_mtime:
            try:
                self._keys = frozenset(zmq.auth.load_certificates(self.authorized_keys))
            except (OSError, ValueError) as exc:
                log.error("cannot read authorized keys in %s: %s", self.authorized_keys, exc)
                self._keys = frozenset()
            self._keys_mtime = mtime
            log.info("%d authorized CURVE client keys in %s", len(self._keys), self.authorized_keys)
        return self._keys

    def _deny(self, request_id: bytes, reason: bytes, who: str) -> list[bytes]:
        # Denials are an attacker's to multiply: log them at a bounded rate.
        self.num_denied += 1
        self._denials_unlogged += 1
        now = time.monotonic()
        if now - self._last_denial_log >= DENIAL_LOG_INTERVAL_S:
            log.warning("refused a TCP client (%s): %s (%d refusals since the last report)",
                        who, reason.decode(), self._denials_unlogged)
            self._last_denial_log = now
            self._denials_unlogged = 0
        return [ZAP_VERSION, request_id, b"400", reason, b"", b""]

    def close(self) -> None:
        self.socket.close(0)
