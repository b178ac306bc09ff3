"""The optional TCP client endpoint: a ROUTER socket protected by CurveZMQ.

The ipc:// client socket is owner-only by file mode; a TCP socket has no such
guard, so it is a CURVE server (encrypted, and each client authenticated by its
public key through `ZapGate`) unless the operator explicitly asked for
plaintext (`insecure_tcp`). The socket lives in its own ZeroMQ context, so the
ZAP handler sees only this socket and never the executor or local sockets.
Messages arriving here go through the same frontend as local ones.
"""
from __future__ import annotations

import logging

import zmq

from kvhold.protocol import wire
from kvhold.protocol.curve import load_secret_keypair
from kvhold.sidecar.config import ClientTcpConfig
from kvhold.frontend.zap_gate import ZapGate

log = logging.getLogger(__name__)
ZAP_DOMAIN = b"kvhold"


class TcpClientEndpoint:
    def __init__(self, config: ClientTcpConfig):
        self.ctx = zmq.Context()
        self.gate: ZapGate | None = None
        self.public_key: bytes | None = None
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 100_000)
        self.socket.setsockopt(zmq.RCVHWM, 100_000)
        self.socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
        try:
            if config.curve_secret_key is not None:
                self._make_curve_server(config)
            else:
                log.warning("INSECURE: client TCP endpoint %s serves anyone who can reach it, in "
                            "plaintext, without authentication (--insecure-tcp)", config.address)
            host, port = config.host_port
            if ":" in host:
                self.socket.setsockopt(zmq.IPV6, 1)
                host = f"[{host}]"
            self.socket.bind(f"tcp://{host}:{port}")
        except BaseException:
            self.close()
            raise
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("clients also served at %s (%s)", self.endpoint,
                 "CurveZMQ" if self.curve else "plaintext")

    def _make_curve_server(self, config) -> None:
        if not zmq.has("curve"):
            raise ValueError("this libzmq was built without CURVE support: --client-tcp is unavailable")
        public, secret = load_secret_keypair(config.curve_secret_key)
        self.public_key = public
        self.gate = ZapGate(self.ctx, config.curve_authorized_keys)  # bound before any handshake
        self.socket.curve_secretkey = secret
        self.socket.curve_publickey = public
        self.socket.curve_server = True
        self.socket.zap_domain = ZAP_DOMAIN
        if config.curve_authorized_keys is None:
            log.warning("no --curve-authorized-keys: traffic is encrypted, but any client that "
                        "knows this server's public key %s is served", public.decode())

    @property
    def curve(self) -> bool:
        return self.gate is not None

    def register(self, poller: zmq.Poller) -> None:
        poller.register(self.socket, zmq.POLLIN)
        if self.gate is not None:
            poller.register(self.gate.socket, zmq.POLLIN)

    def on_events(self, events: dict) -> None:
        """Answer pending handshakes; client messages are drained by the sidecar."""
        if self.gate is not None and self.gate.socket in events:
            self.gate.on_readable()

    def status(self) -> dict:
        out = {"endpoint": self.endpoint, "curve": self.curve}
        if self.gate is not None:
            out.update(public_key=self.public_key.decode(), admitted=self.gate.num_allowed,
                       refused=self.gate.num_denied)
        return out

    def close(self) -> None:
        self.socket.close(0)
        if self.gate is not None:
            self.gate.close()
        self.ctx.term()
