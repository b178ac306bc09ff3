"""A request belongs to its client's authenticated identity, not to its routing id.

Over TCP the identity is the client's CurveZMQ key, over ipc the peer's uid. A socket
that presents the owner's routing id with another key (or uid) while the owner is away
can neither cancel the request, nor resume it, nor read a token of it; the owner,
reconnecting with its key through the SDK's own reconnect, resumes the stream with no
gap and gets the output of an uninterrupted run. Real sidecar, real sockets: the owner
reaches the sidecar through a relay that the test cuts and restores, the intruder is a
separate process (over ipc running as another user)."""
import json
import os
import shutil
import signal
import socket
import threading
import time

import pytest
import zmq
import zmq.auth

from kvhold.client.client import Client
from kvhold.protocol.curve import write_keypair
from kvhold.protocol import messages as m, wire
from kvhold.protocol.errors import ErrorCode
from tests.process.helpers import wait_stopped

pytestmark = pytest.mark.slow     # real restarts and timeouts: `pytest -m slow` (CI runs it)

PROMPT, MAX_TOKENS = "Mine alone", 48
INTRUDER_LISTEN_S = 4.0
NOBODY = 65534
NOT_FOUND = int(ErrorCode.NOT_FOUND)


class Relay:
    """A byte relay in front of a sidecar socket (TCP or unix) that can be cut and restored."""

    def __init__(self, listen, target, family):
        self.listen, self.target, self.family = listen, target, family
        self.conns: list[socket.socket] = []
        self.server = None
        self.lock = threading.Lock()
        self.restore()

    def restore(self) -> None:
        self.server = socket.socket(self.family, socket.SOCK_STREAM)
        if self.family == socket.AF_INET:
            self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        elif os.path.exists(self.listen):
            os.unlink(self.listen)
        self.server.bind(self.listen)
        if self.family == socket.AF_INET:
            self.listen = self.server.getsockname()
        self.server.listen(8)
        threading.Thread(target=self._accept, args=(self.server,), daemon=True).start()

    def _accept(self, server) -> None:
        while True:
            try:
                a, _ = server.accept()
            except OSError:
                return
            if server is not self.server:   # cut meanwhile
                a.close()
                return
            b = socket.socket(self.family, socket.SOCK_STREAM)
            b.connect(self.target)
            with self.lock:
                self.conns += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src, dst) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        """Close every relayed connection and stop accepting: the owner is away."""
        server, self.server = self.server, None
        server.shutdown(socket.SHUT_RDWR)    # wakes the accept(): a close alone would not
        server.close()
        with self.lock:
            for s in self.conns:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            self.conns.clear()


def _intruder(out, endpoint, routing_id, rid, keys, uid):
    """In a forked child (as `uid`, if given): present `routing_id`, try to cancel and resume
    request `rid`, then listen; one JSON line each to `out`."""
    if uid is not None:
        os.setgid(uid)
        os.setuid(uid)
    ctx = zmq.Context()

    def connect():
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.routing_id = routing_id
        if keys:
            s.curve_publickey, s.curve_secretkey, s.curve_serverkey = keys
        s.connect(endpoint)
        return s

    sock = connect()

    def ask(msg):
        nonlocal sock
        for _ in range(10):     # the owner's connection may hold the routing id for a moment yet
            sock.send(wire.encode(msg))
            if sock.poll(1500):
                return wire.decode(sock.recv())
            sock.close(0)
            sock = connect()
        return None

    def describe(msg):
        return None if msg is None else {"type": msg.TYPE, "code": int(getattr(msg, "code", 0) or 0),
                                          "request_id": getattr(msg, "request_id", None),
                                          "ids": list(getattr(msg, "ids", None) or [])}

    cancel = describe(ask(m.Cancel(tag=7, request_id=rid)))
    resume = [describe(ask(m.Resume(request_ids=[rid], next_indices=[0])))]
    while sock.poll(300):
        resume.append(describe(wire.decode(sock.recv())))
    out.write(json.dumps({"cancel": cancel, "resume": resume}) + "\n")
    out.flush()
    heard, end = [], time.monotonic() + INTRUDER_LISTEN_S
    while (left := end - time.monotonic()) > 0:
        if sock.poll(int(left * 1000) + 1):
            heard.append(describe(wire.decode(sock.recv())))
    out.write(json.dumps(heard) + "\n")
    out.flush()
    sock.close(0)
    ctx.term()


def _intrude(sc, active_pid, endpoint, routing_id, request_id, keys=None, uid=None):
    """Fork the intruder; let the request run to its end while it listens; what it got."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:    # the child touches nothing of the parent's sockets
        code = 1
        try:
            os.close(r)
            with os.fdopen(w, "w") as out:
                _intruder(out, endpoint, routing_id, request_id, keys, uid)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    try:
        with os.fdopen(r) as lines:
            asked = json.loads(lines.readline())
            os.kill(active_pid, signal.SIGCONT)            # tokens flow while the intruder listens
            sc.wait_for(lambda st: st["requests"]["in_flight"] == 0, timeout=60)
            heard = json.loads(lines.readline())
        assert os.waitpid(pid, 0)[1] == 0
        pid = None
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return asked, heard


def _reference(sc):
    with sc.new_client(timeout=60) as client:
        return client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True).result()


def _owner_away_then_back(sc, relay, owner, intruder_endpoint, keys=None, uid=None):
    active = sc.wait_steady(standbys=0)
    routing_id = owner._sock.getsockopt(zmq.ROUTING_ID)
    stream = owner.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    first = [next(stream) for _ in range(2)]
    wait_stopped(active["pid"])                         # the executor stopped itself mid-request
    refused = sc.status().get("client_peers", {}).get("refused_sends", 0)   # before the owner goes:
    relay.cut()                                         # its first held message may come at once
    asked, heard = _intrude(sc, active["pid"], intruder_endpoint, routing_id, stream.request_id,
                            keys=keys, uid=uid)
    assert asked["cancel"] == {"type": "error", "code": NOT_FOUND, "request_id": stream.request_id, "ids": []}, asked
    assert {"type": "error", "code": NOT_FOUND, "request_id": stream.request_id, "ids": []} in asked["resume"], asked
    assert not [h for h in heard if h["request_id"] == stream.request_id or h["ids"]], heard
    assert all(h["type"] == "keepalive" for h in heard), heard
    status = sc.status()
    assert status["client_peers"]["refused_sends"] > refused          # tokens were held back
    assert [u["request_id"] for u in status["pool_restart"]["unclaimed"]] == [stream.request_id]
    relay.restore()                                     # the owner's socket reconnects by itself
    result = stream.result()
    assert [e.token_id for e in first] == result.token_ids[:2]
    reference = _reference(sc)
    assert (result.finish_reason, result.token_ids) == ("length", reference.token_ids)


FLAGS = ["--max-seq-len", "256", "--standbys", "0", "--lease-ms", "60000"]
FAULT = "commit_finish:5:stop"


def test_tcp_a_socket_with_the_owners_routing_id_but_another_key_gets_nothing(
        tiny_model, start_sidecar, tmp_path):
    keys = {name: write_keypair(tmp_path / "own", name) for name in ("server", "alice", "bob")}
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    for name in ("alice", "bob"):                      # both may use the sidecar: bob is no stranger
        shutil.copy(keys[name][0], authorized / f"{name}.key")
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--client-tcp", "127.0.0.1:0",
                        "--curve-secret-key", str(keys["server"][1]),
                        "--curve-authorized-keys", str(authorized)],
                       env={"KVHOLD_FAULT": FAULT, "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")})
    endpoint = sc.status()["client_tcp"]["endpoint"]
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    relay = Relay(("127.0.0.1", 0), (host, int(port)), socket.AF_INET)
    bob_public, bob_secret = zmq.auth.load_certificate(keys["bob"][1])
    server_public, _ = zmq.auth.load_certificate(keys["server"][0])
    with Client(f"tcp://127.0.0.1:{relay.listen[1]}", timeout=60, identity=os.urandom(16),
                curve_server_key=keys["server"][0], curve_secret_key_file=keys["alice"][1]) as alice:
        _owner_away_then_back(sc, relay, alice, endpoint, keys=(bob_public, bob_secret, server_public))
    relay.cut()


def test_ipc_a_socket_with_the_owners_routing_id_but_another_uid_gets_nothing(
        tiny_model, start_sidecar, runtime_root, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to run the intruder as another user")
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS],
                       env={"KVHOLD_FAULT": FAULT, "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")})
    sock = runtime_root / sc.instance / "client.sock"
    # Let another uid reach the socket at all (the runtime directory is 0700 and the socket
    # 0600): what is left between it and the owner's request is the uid binding under test.
    for d in (runtime_root, runtime_root / sc.instance):
        d.chmod(0o711)
    sock.chmod(0o666)
    relay = Relay(str(tmp_path / "relay.sock"), str(sock), socket.AF_UNIX)
    with Client(f"ipc://{tmp_path / 'relay.sock'}", timeout=60, identity=os.urandom(16)) as owner:
        _owner_away_then_back(sc, relay, owner, f"ipc://{sock}", uid=NOBODY)
    relay.cut()
