"""The SDK over TCP with CurveZMQ: authorized keys are served, everyone else gets nothing;
plaintext TCP only when asked for; key files owner-only; no client reaches another's request."""
import os
import shutil
import signal
import stat
import subprocess
import sys

import pytest
import zmq

from tests.process.helpers import sidecar_log, wait_stopped
from kvhold.protocol import messages as m, wire
from kvhold.client.client import Client
from kvhold.protocol.curve import load_public_key, write_keypair
from kvhold.protocol.errors import ErrorCode, NotFound, SidecarUnavailable

REFUSED_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    out = {name: write_keypair(root / "own", name) for name in ("server", "alice", "mallory")}
    authorized = root / "authorized"
    authorized.mkdir()
    shutil.copy(out["alice"][0], authorized / "alice.key")
    return {**out, "authorized": authorized}


def _flags(tiny_model, keys):
    return ["--model", str(tiny_model), "--max-seq-len", "256", "--standbys", "0",
            "--lease-ms", "5000", "--client-tcp", "127.0.0.1:0",
            "--curve-secret-key", str(keys["server"][1]),
            "--curve-authorized-keys", str(keys["authorized"])]


@pytest.fixture(scope="module")
def sidecar_flags(tiny_model, keys):
    return _flags(tiny_model, keys)


def _tcp_client(sc, keys, who="alice", timeout=20.0, **kwargs):
    endpoint = sc.status()["client_tcp"]["endpoint"]
    if who is None:
        return Client(endpoint, timeout=timeout, **kwargs)
    return Client(endpoint, timeout=timeout, curve_server_key=keys["server"][0],
                  curve_secret_key_file=keys[who][1], **kwargs)


def _run(*args, timeout=30):
    return subprocess.run([sys.executable, "-m", "kvhold", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_keygen_writes_owner_only_secret(tmp_path):
    out = _run("keygen", "--out", str(tmp_path / "k"), "--name", "bob")
    assert out.returncode == 0, out.stderr
    public, secret = tmp_path / "k" / "bob.key", tmp_path / "k" / "bob.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o700
    assert load_public_key(public).decode() in out.stdout
    assert "secret-key" not in public.read_text()
    again = _run("keygen", "--out", str(tmp_path / "k"), "--name", "bob")
    assert again.returncode == 1 and "exists" in again.stderr     # never overwritten


def test_keygen_refuses_a_directory_others_can_enter(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    out = _run("keygen", "--out", str(shared), "--name", "bob")
    assert out.returncode == 1 and "chmod 700" in out.stderr and "0755" in out.stderr, out.stderr
    assert list(shared.iterdir()) == [] and stat.S_IMODE(shared.stat().st_mode) == 0o755  # untouched
    shared.chmod(0o700)                         # made private by its owner: accepted
    assert _run("keygen", "--out", str(shared), "--name", "bob").returncode == 0
    assert (shared / "bob.key_secret").exists()
    if os.geteuid() == 0:                       # private, but somebody else's
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        out = _run("keygen", "--out", str(theirs))
        assert out.returncode == 1 and "belongs to uid 65534" in out.stderr, out.stderr
    nested = tmp_path / "a" / "b"               # a new directory is made 0700 whatever the umask
    old = os.umask(0)
    try:
        assert _run("keygen", "--out", str(nested)).returncode == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(nested.stat().st_mode) == 0o700


def test_an_authorized_key_generates_over_tcp(sidecar, keys):
    info = sidecar.status()["client_tcp"]
    assert info["curve"] and info["endpoint"].startswith("tcp://127.0.0.1:")
    assert info["public_key"] == load_public_key(keys["server"][0]).decode()
    with _tcp_client(sidecar, keys) as client:
        over_tcp = client.generate("Over the network", max_tokens=16, temperature=0.0).result()
    with sidecar.new_client() as local:
        over_ipc = local.generate("Over the network", max_tokens=16, temperature=0.0).result()
    assert over_tcp.completion_tokens == 16 and over_tcp.token_ids == over_ipc.token_ids
    rundir = sidecar.runtime_root / sidecar.instance   # the local socket stays owner-only
    assert stat.S_IMODE(os.stat(rundir / "client.sock").st_mode) == 0o600


def test_the_async_client_speaks_curve_too(sidecar, keys):
    import asyncio

    from kvhold.client.aclient import AsyncClient

    async def run(**kwargs):
        async with AsyncClient(sidecar.status()["client_tcp"]["endpoint"], **kwargs) as client:
            stream = await client.generate("Over the network", max_tokens=16, temperature=0.0)
            return (await stream.result()).token_ids

    good = asyncio.run(run(timeout=20, curve_server_key=keys["server"][0],
                           curve_secret_key_file=keys["alice"][1]))
    with _tcp_client(sidecar, keys) as client:
        assert good == client.generate("Over the network", max_tokens=16, temperature=0.0).result().token_ids
    with pytest.raises(SidecarUnavailable):
        asyncio.run(run(timeout=REFUSED_TIMEOUT_S, curve_server_key=keys["server"][0],
                        curve_secret_key_file=keys["mallory"][1]))


@pytest.mark.parametrize("who,server_key", [("mallory", "server"), (None, None), ("alice", "alice")])
def test_unknown_key_plaintext_or_wrong_server_get_no_service(sidecar, keys, who, server_key):
    refused = sidecar.status()["client_tcp"]["refused"]
    endpoint = sidecar.status()["client_tcp"]["endpoint"]
    kwargs = {} if who is None else dict(curve_server_key=keys[server_key][0],
                                         curve_secret_key_file=keys[who][1])
    with Client(endpoint, timeout=REFUSED_TIMEOUT_S, **kwargs) as client:
        with pytest.raises(SidecarUnavailable):
            client.ping()
        with pytest.raises(SidecarUnavailable):
            client.generate("let me in", max_tokens=4)
    if who == "mallory":   # the handshake reached the gate and was denied there
        assert sidecar.status()["client_tcp"]["refused"] > refused
    with _tcp_client(sidecar, keys) as client:   # and the service goes on
        assert client.ping() > 0


def test_a_client_can_neither_cancel_nor_read_anothers_request(tiny_model, keys, start_sidecar,
                                                                tmp_path):
    # the executor stops itself at its 5th step: the request stays in flight while others try
    sc = start_sidecar(_flags(tiny_model, keys), env={
        "KVHOLD_FAULT": "commit_finish:5:stop", "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")})
    active = sc.wait_steady(standbys=0)
    identity = os.urandom(16)
    with Client.for_instance(sc.instance, sc.runtime_root, timeout=30, identity=identity) as owner:
        stream = owner.generate("Mine alone", max_tokens=100, temperature=0.0, ignore_eos=True)
        wait_stopped(active["pid"])
        try:
            _intruders_fail(sc, keys, stream.request_id, identity)
        finally:
            os.kill(active["pid"], signal.SIGCONT)
        result = stream.result()
    assert (result.finish_reason, result.completion_tokens) == ("length", 100), result


def _intruders_fail(sc, keys, request_id, owner_identity):
    assert sc.status()["requests"]["in_flight"] == 1
    with sc.new_client(timeout=5) as other:          # another local client
        with pytest.raises(NotFound):
            other.cancel(request_id)
    # the owner's routing id over the other transport is somebody else
    with _tcp_client(sc, keys, timeout=5, identity=owner_identity) as twin:
        with pytest.raises(NotFound):
            twin.cancel(request_id)
    # a raw socket sees nothing of the stream: only the reply to its own request
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.connect(sc.new_client().endpoint)
        sock.send(wire.encode(m.Cancel(tag=5, request_id=request_id)))
        assert sock.poll(5000)
        reply = wire.decode(sock.recv())
        assert isinstance(reply, m.Error) and reply.code == ErrorCode.NOT_FOUND and reply.tag == 5
        assert not sock.poll(300)
    finally:
        sock.close(0)
    assert sc.status()["requests"]["in_flight"] == 1


def test_plaintext_tcp_needs_insecure_tcp(runtime_root):
    out = _run("sidecar", "--instance", "plain", "--runtime-root", str(runtime_root), "--no-spawn",
               "--client-tcp", "127.0.0.1:0")
    assert out.returncode == 2 and "--insecure-tcp" in out.stderr
    assert not (runtime_root / "plain" / "client.sock").exists()


def test_insecure_tcp_serves_plaintext_with_a_warning(start_sidecar):
    sc = start_sidecar(["--no-spawn", "--client-tcp", "127.0.0.1:0", "--insecure-tcp"])
    info = sc.status()["client_tcp"]
    assert info["curve"] is False
    with Client(info["endpoint"], timeout=5) as client:
        assert client.ping() > 0
    assert "INSECURE" in sidecar_log(sc)


def test_a_secret_key_readable_by_others_is_refused(runtime_root, keys, tmp_path):
    loose = tmp_path / "loose.key_secret"
    shutil.copy(keys["server"][1], loose)
    loose.chmod(0o644)
    out = _run("sidecar", "--instance", "loose", "--runtime-root", str(runtime_root), "--no-spawn",
               "--client-tcp", "127.0.0.1:0", "--curve-secret-key", str(loose))
    assert out.returncode == 2 and "chmod 600" in out.stderr
