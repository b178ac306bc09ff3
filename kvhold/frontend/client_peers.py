"""Who stands behind a client routing id: request ownership bound to the authenticated peer.

A ZeroMQ ROUTER names each peer by the routing id that peer chose, so a routing id
proves nothing: any socket may present another's. The frontend therefore knows a
client by a *client key*: transport byte, principal, routing id. The principal is
what the transport authenticated:

* tcp with CurveZMQ: the client's public key, the User-Id that `ZapGate` returns;
* ipc: the peer's uid, from the kernel (SO_PEERCRED; libzmq puts it in each message's
  Peer-Address property as HOST:UID:GID:PID);
* plaintext tcp (`--insecure-tcp`): nobody is authenticated, every peer has the same
  principal and the routing id alone names the owner.

A request is owned by the whole key (cancel, resume and the durable journal's record
compare all of it), so a socket that presents the owner's routing id with another
key or uid is a stranger to it. A legitimate reconnect presents the same key or uid
and stays the owner.

Sending is the other half: the ROUTER delivers to whichever connection holds the
routing id now, and that may be a stranger who connected under it after the owner
left. So `may_send` allows a message to a client key only while the connection
holding its routing id is known to be that principal's: the last message from that
routing id carried the principal, and the connection it came from (its descriptor,
ZMQ_SRCFD) has not been seen to close since (socket monitor: DISCONNECTED or CLOSED,
or ACCEPTED of a new connection reusing the descriptor; the monitor's queue is
unbounded, so no event is lost). Otherwise the message is dropped and the caller told;
the frontend then holds the stream until its owner resumes it (the SDK sends `Resume`
as soon as its socket has connected again, and after a second of silence, from whatever
connection it has by then). A stream also goes
only to the connection its owner was on when it was admitted or last resumed (`connection`
numbers them): another connection of the same owner under the same routing id, such as a
restarted HTTP server, does not know the stream and would drop it, so the stream is held
for its `Resume` too. The monitors are
drained right before every send and before every message from a client is attributed
(their ZMQ_EVENTS read each time: ZMQ_FD is edge-triggered, and a poll(2) of it can miss
an event already queued, which then, applied after a reconnected owner's `Resume`,
would drop the new connection's claim and refuse the resend). libzmq reports a
connection's end before its routing id can pass to another, so a message reaches a
stranger only if the owner's connection ends and a stranger's takes its routing id
within the microseconds between a check and its send.
"""
from __future__ import annotations

import itertools
import logging
import struct

import zmq

log = logging.getLogger(__name__)
_ENDS = (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED, zmq.EVENT_ACCEPTED)  # a descriptor's connection is over
PEERCRED, CURVE, NOBODY = "peercred", "curve", "nobody"
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)   # plain ints: refresh runs before every send


def client_key(via: bytes, principal: bytes, routing_id: bytes) -> bytes:
    return via + bytes([len(principal)]) + principal + routing_id


def split_client_key(key: bytes) -> tuple[bytes, bytes, bytes]:
    """(transport byte, principal, routing id) of a client key."""
    n = key[1] if len(key) > 1 else 0
    return key[:1], key[2:2 + n], key[2 + n:]


def principal_of(how: str, frame: zmq.Frame) -> bytes:
    """The principal a message's transport authenticated (see the module docstring)."""
    if how == CURVE:
        return b"curve:" + _property(frame, "User-Id").encode()
    if how == PEERCRED:
        parts = _property(frame, "Peer-Address").rsplit(":", 3)   # HOST:UID:GID:PID
        if len(parts) == 4 and parts[1].isdigit():
            return b"uid:" + parts[1].encode()
        return b"ipc"          # a libzmq without SO_PEERCRED: the socket file's mode is the guard
    return b"tcp"


def _property(frame: zmq.Frame, name: str) -> str:
    try:
        return frame.get(name) or ""
    except zmq.ZMQError:
        return ""


class ClientPeers:
    """The client sockets' connections, as far as ownership needs them."""

    def __init__(self):
        self._transports: dict[bytes, str] = {}
        self._monitors: list[zmq.Socket] = []
        self._holder: dict[tuple[bytes, bytes], tuple[bytes, int]] = {}   # (via, routing id) -> (principal, fd)
        self._by_fd: dict[int, set[tuple[bytes, bytes]]] = {}
        self._serial: dict[tuple[bytes, bytes], int] = {}     # (via, routing id) -> its connection's number
        self._serials = itertools.count(1)
        self.num_refused_sends = 0

    def add(self, via: bytes, sock: zmq.Socket, how: str) -> None:
        """Watch the client ROUTER `sock`, known as transport `via`, authenticated `how`."""
        addr = f"inproc://kvhold.client-peers.{via.decode()}.{id(sock):x}"
        events = 0
        for e in _ENDS:
            events |= e
        sock.monitor(addr, events)
        mon = sock.context.socket(zmq.PAIR)
        mon.setsockopt(zmq.LINGER, 0)
        mon.setsockopt(zmq.RCVHWM, 0)     # an unbounded queue: no end of a connection goes unseen
        mon.connect(addr)
        self._transports[via] = how
        self._monitors.append(mon)
        self.refresh()

    def seen(self, via: bytes, routing_id: bytes, frame: zmq.Frame) -> bytes:
        """A message `frame` came from `routing_id`: its client key; its connection now holds the id."""
        self.refresh()                 # ends of connections before this message apply, not after
        principal = principal_of(self._transports[via], frame)
        fd = frame.get(zmq.SRCFD)
        slot = (via, routing_id)
        old = self._holder.get(slot)
        if old is not None and old[1] != fd:
            self._by_fd.get(old[1], set()).discard(slot)
        if old is None or old[1] != fd or old[0] != principal:
            self._serial[slot] = next(self._serials)          # a new connection holds the id
        self._holder[slot] = (principal, fd)
        self._by_fd.setdefault(fd, set()).add(slot)
        return client_key(via, principal, routing_id)

    def connection(self, via: bytes, routing_id: bytes, principal: bytes) -> int:
        """A number naming the connection that holds `routing_id` now, if it is `principal`'s
        (0 if none is): a stream remembers the one its owner spoke on, and is held for a
        `Resume` when another connection of the same owner holds the id (a restarted process
        with the same routing id, which does not know the stream)."""
        self.refresh()
        holder = self._holder.get((via, routing_id))
        return self._serial.get((via, routing_id), 0) if holder is not None and holder[0] == principal else 0

    def may_send(self, via: bytes, routing_id: bytes, principal: bytes, connection: int = 0) -> bool:
        """Whether the connection that holds `routing_id` now is known to be `principal`'s (and,
        when `connection` is given, is that one)."""
        self.refresh()
        holder = self._holder.get((via, routing_id))
        if holder is not None and holder[0] == principal and (
                not connection or self._serial.get((via, routing_id)) == connection):
            return True
        self.num_refused_sends += 1
        return False

    def refresh(self) -> None:
        """Apply every monitor event that has arrived (drains each monitor to empty)."""
        for mon in self._monitors:
            while mon.getsockopt(_EVENTS) & _POLLIN:
                head = mon.recv_multipart(zmq.NOBLOCK)[0]
                event, fd = struct.unpack("=HI", head[:6])
                if event in _ENDS:
                    for slot in self._by_fd.pop(fd, ()):
                        self._holder.pop(slot, None)
                        self._serial.pop(slot, None)

    def held_by(self, routing_id: bytes) -> list[str]:
        """The transports (`via`) on which a live connection holds `routing_id` now."""
        self.refresh()
        return sorted(via.decode() for via, rid in self._holder if rid == routing_id)

    def status(self) -> dict:
        return {"attached": len(self._holder), "refused_sends": self.num_refused_sends}

    def close(self) -> None:
        for mon in self._monitors:
            mon.close(0)
        self._monitors.clear()
