"""The checks a restarted sidecar makes on handed-back region descriptors (kvhold.sidecar.hand_back),
over a real SOCK_SEQPACKET pair with real shm objects: a set is taken only from a live holder
of an adopted lease, with the token, for every region of this pool's geometry, each descriptor
the named object itself."""
import os
import socket

import posix_ipc
import pytest

from kvhold.protocol import fdpass
from kvhold.protocol.hand_back import HandBack, HandBackFormatError
from kvhold.protocol.layout import KvGeometry, Role, TableGeometry
from kvhold.protocol.memory import HostRegion, RegionInfo
from kvhold.sidecar.adoption import Adoptable, LeaseHolder
from kvhold.sidecar.hand_back import Receiver

SMALL = TableGeometry(kv=KvGeometry(2, 2, 8, "float32", 4), num_pages=16, num_slots=4,
                      max_seq_len=32, num_leases=4)
KV = RegionInfo("kv", 8192, "host", False)


@pytest.fixture
def tables_name(paths):
    return paths.shm_name("tables")


@pytest.fixture
def table_geometry():
    return SMALL


@pytest.fixture
def table_generation():
    return 3


@pytest.fixture
def pool(paths, tables):
    """An instance's tables (tests/unit/conftest.py) with slot 1 leased to this process, and its KV region."""
    tables.leases["pid"][1], tables.leases["epoch"][1] = os.getpid(), 5
    region = HostRegion(paths.shm_name("kv"), "kv", 8192)
    found = Adoptable(tables=tables, live=[LeaseHolder(slot=1, pid=os.getpid(), role=Role.ACTIVE, epoch=5)],
                      dead=[])
    yield paths, found, region
    region.unlink()


def _serve(receiver, message: dict, fds) -> tuple[dict, object]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        fdpass.send(ours, message, fds)
        taken = receiver._serve(theirs)          # it closes its end
        reply, _ = fdpass.recv(ours)
        return reply, taken
    finally:
        ours.close()


def _request(**changes) -> dict:
    fields = dict(token="secret", pid=os.getpid(), slot=1, epoch=5, regions=(KV,))
    fields.update(changes)
    return HandBack(**fields).to_wire()


def test_the_executors_own_descriptor_is_taken_back(pool):
    paths, found, region = pool
    receiver = Receiver(found, {"kv": KV}, "secret", paths, "host")
    fd = region.export_fd(readonly=True)           # what a read-only recipient kept: still the object
    try:
        reply, taken = _serve(receiver, _request(), [fd])
    finally:
        os.close(fd)
    assert reply == {"ok": True, "kept": True}
    assert taken.record["pid"] == os.getpid() and taken.record["slot"] == 1
    assert taken.record["regions"]["kv"] == {"size": 8192, "check": f"the same object as {paths.shm_name('kv')}"}
    assert receiver.refused == []


@pytest.mark.parametrize("changes,fd_kind,reason", [
    ({}, "foreign", "the descriptor is not"),
    ({"token": "guess"}, "own", "wrong executor token"),
    ({"pid": 1}, "own", "names pid 1, the connection is pid"),
    ({"epoch": 6}, "own", "lease 1 epoch 6 is not pid"),
    ({"slot": 2}, "own", "lease 2 epoch 5 is not pid"),
    ({"regions": (RegionInfo("kv", 12288, "host", False),)}, "own", "region kv: size 12288, this pool's is 8192"),
    ({"regions": (RegionInfo("kv", 8192, "cuda", False, 0, 1 << 40),)}, "own", "backend 'cuda'"),
    ({"regions": (RegionInfo("weights", 8192, "host", True),)}, "own", "regions ['weights'], this pool has ['kv']"),
    ({"regions": (KV, RegionInfo("weights", 8192, "host", True))}, "own", "1 descriptors for 2 regions"),
])
def test_a_mismatched_or_foreign_hand_back_is_refused_with_its_reason(pool, changes, fd_kind, reason):
    paths, found, region = pool
    receiver = Receiver(found, {"kv": KV}, "secret", paths, "host")
    foreign = posix_ipc.SharedMemory(None, flags=posix_ipc.O_CREX, mode=0o600, size=8192)
    fd = region.export_fd(readonly=False) if fd_kind == "own" else os.dup(foreign.fd)
    try:
        reply, taken = _serve(receiver, _request(**changes), [fd])
    finally:
        os.close(fd)
        foreign.close_fd()
        foreign.unlink()
    assert taken is None and not reply["ok"] and reason in reply["error"], reply
    assert len(receiver.refused) == 1 and reason in receiver.refused[0]["reason"]


def test_a_request_that_is_not_a_hand_back_is_refused():
    with pytest.raises(HandBackFormatError, match="not a hand_back"):
        HandBack.from_wire({"slot": 1})
    with pytest.raises(HandBackFormatError, match="'pid' must be int"):
        HandBack.from_wire({**_request(), "pid": "7"})
    with pytest.raises(HandBackFormatError, match="named twice"):
        HandBack.from_wire(_request(regions=(KV, KV)))
    assert HandBack.from_wire(_request()) == HandBack(token="secret", pid=os.getpid(), slot=1, epoch=5,
                                                      regions=(KV,))
