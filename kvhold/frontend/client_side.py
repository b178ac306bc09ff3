"""The client sockets and their decoding, shared by the two processes that serve clients: the
sidecar with its frontend in process, and the frontend process (kvhold.frontend.process).

A host class mixes `ClientSide` in; it must have `config` (a SidecarConfig: the client TCP
section and --max-prompt-bytes), `tables`, `loop` (kvhold.sidecar.event_loop.EventLoop),
`zctx` and `frontend`. `_open_client_sockets` binds the ipc client socket (and TCP with
--client-tcp) and registers them; `_on_client_events` handles a poll's events; `send_client`
and `client_connection` are the FrontendHost's (kvhold.frontend.frontend).
"""
from __future__ import annotations

import contextlib
import logging

import zmq

from kvhold.protocol import messages as m, wire
from kvhold.protocol.errors import ErrorCode
from kvhold.protocol.router_socket import bind_router, decode, drain, reply
from kvhold.frontend.client_peers import CURVE, NOBODY, PEERCRED, ClientPeers, split_client_key
from kvhold.frontend.tcp_endpoint import TcpClientEndpoint

log = logging.getLogger(__name__)
FRAME_SLACK = 64 << 10        # a Generate's fields besides its prompt text


class ClientSide:
    tcp: TcpClientEndpoint | None = None

    def _open_client_sockets(self, stack: contextlib.ExitStack) -> None:
        self.client = bind_router(self.zctx, self.paths.client_endpoint, self.paths.client_socket, stack)
        if self.config.client_tcp.address:
            self.tcp = TcpClientEndpoint(self.config.client_tcp)
            stack.callback(self.tcp.close)
        # A client is known to the frontend by transport + authenticated principal + routing id
        # (kvhold.frontend.client_peers): presenting another's routing id makes nobody its owner.
        self._client_sockets = {b"u": self.client}
        self.peers = ClientPeers()
        stack.callback(self.peers.close)
        self.peers.add(b"u", self.client, PEERCRED)
        if self.tcp is not None:
            self._client_sockets[b"t"] = self.tcp.socket
            self.peers.add(b"t", self.tcp.socket, CURVE if self.tcp.curve else NOBODY)
        self.loop.register(self.client)
        if self.tcp is not None:
            self.tcp.register(self.loop.poller)

    def _on_client_events(self, events) -> None:
        if self.client in events:   # frames, not bytes: the client's credentials are properties
            drain(self.client, self._on_client, copy=False)
        if self.tcp is not None:
            self.tcp.on_events(events)
            if self.tcp.socket in events:
                drain(self.tcp.socket, lambda ident, frame: self._on_client(ident, frame, b"t"), copy=False)

    def _on_client(self, identity: bytes, frame: zmq.Frame, via: bytes = b"u") -> None:
        sock = self._client_sockets[via]
        key = self.peers.seen(via, identity, frame)
        geometry = self.tables.geometry    # a prompt's text, or its ids and a moved request's tokens
        limit = max(self.config.pool.max_prompt_bytes, 18 * geometry.max_seq_len) + FRAME_SLACK
        if len(frame) > limit:       # refused undecoded: the loop does not wait on a client's bytes
            reply(sock, identity, m.Error(
                code=ErrorCode.PROMPT_TOO_LARGE, tag=wire.peek_tag(frame.buffer),
                message=f"a message of {len(frame)} bytes exceeds "
                f"this sidecar's limit of {limit} bytes (see --max-prompt-bytes)"))
            return
        # no list a client sends is longer than the context (prompt, tokens) or the request slots
        msg = decode(sock, identity, frame.bytes, m.CLIENT_IN, "client",
                     max_array_len=max(geometry.max_seq_len, geometry.num_slots, 1024))
        if msg is None:
            return
        try:
            answer = self.frontend.handle(key, msg)
        except Exception as exc:  # a bug on one request must not stop the service
            log.exception("internal error handling %s", msg.TYPE)
            answer = m.Error(code=ErrorCode.INTERNAL, message=f"internal error: {type(exc).__name__}",
                             tag=getattr(msg, "tag", 0))
        if answer is not None:
            reply(sock, identity, answer)

    def client_connection(self, client_key: bytes) -> int:
        """The number of the connection a client key speaks on now (0: none; client_peers)."""
        via, principal, identity = split_client_key(client_key)
        return self.peers.connection(via, identity, principal)

    def send_client(self, client_key: bytes, msg, connection: int = 0) -> bool:
        """Send to a client as the frontend knows it (transport, principal, routing id); False,
        sending nothing, while the connection under that routing id is not that principal's
        (or, with `connection`, not that one: client_peers)."""
        via, principal, identity = split_client_key(client_key)
        if not self.peers.may_send(via, identity, principal, connection):
            return False
        reply(self._client_sockets[via], identity, msg)
        return True
