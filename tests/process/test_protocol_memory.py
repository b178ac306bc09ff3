"""Host regions: zero-copy torch views across processes, read-only enforcement, fd passing."""
import multiprocessing as mp
import os
import signal
import socket
import stat

import numpy as np
import pytest
import torch

from kvhold.protocol import fdpass
from kvhold.protocol.memory import HostRegion, Mapping


@pytest.fixture
def region():
    r = HostRegion(f"/kvhold-test-mem-{os.getpid()}", "kv", 10_000)
    yield r
    r.unlink()


def test_region_is_owner_only_and_page_aligned(region):
    assert stat.S_IMODE(os.stat("/dev/shm" + region.shm_name).st_mode) == 0o600
    assert region.size % 4096 == 0 and region.size >= 10_000


def _child_writes(fd, info, value):
    mapping = Mapping.from_fd(fd, info)
    t = mapping.tensor(torch.float32, (16,), offset=64)
    t.fill_(value)
    os._exit(0)


def test_tensor_views_share_memory_across_processes(region):
    mine = region.map_local()
    view = mine.tensor(torch.float32, (16,), offset=64)
    fd = region.export_fd(readonly=False)
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_child_writes, args=(fd, region.info(False), 3.5))
    p.start()
    p.join(10)
    os.close(fd)
    assert p.exitcode == 0
    assert torch.all(view == 3.5)          # the child's writes are visible without a copy
    assert view.data_ptr() == view.data_ptr()


def _child_writes_readonly(fd, info):
    import faulthandler
    faulthandler.disable()  # the fault is the expected outcome, not a crash to report
    mapping = Mapping.from_fd(fd, info)
    t = mapping.tensor(torch.float32, (4,))
    t.fill_(1.0)                            # must fault: the mapping is PROT_READ
    os._exit(0)


def test_readonly_mapping_faults_on_write(region):
    fd = region.export_fd(readonly=True)
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_child_writes_readonly, args=(fd, region.info(True)))
    p.start()
    p.join(10)
    os.close(fd)
    assert p.exitcode == -signal.SIGSEGV


def test_readonly_fd_cannot_be_mapped_writable(region):
    fd = region.export_fd(readonly=True)
    try:
        with pytest.raises(PermissionError):
            Mapping.from_fd(fd, region.info(False))
    finally:
        os.close(fd)


def test_bounds_are_checked(region):
    mapping = region.map_local()
    with pytest.raises(ValueError):
        mapping.tensor(torch.float32, (region.size,))
    with pytest.raises(ValueError):
        mapping.numpy(np.uint8, (10,), offset=region.size - 5)


def _fd_server(path, region_fd, ready):
    listener = fdpass.listen(path)
    ready.set()
    conn, _ = listener.accept()
    request, _ = fdpass.recv(conn)
    pid, uid, _ = fdpass.peer_credentials(conn)
    fdpass.send(conn, {"ok": True, "peer_pid": pid, "echo": request["x"]}, [region_fd])
    conn.close()
    os._exit(0)


def test_fd_passing_between_processes(region, tmp_path):
    path = str(tmp_path / "fd.sock")
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    fd = region.export_fd(readonly=False)
    p = ctx.Process(target=_fd_server, args=(path, fd, ready))
    p.start()
    assert ready.wait(10)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    sock = fdpass.connect(path)
    fdpass.send(sock, {"x": 7})
    reply, fds = fdpass.recv(sock)
    p.join(10)
    os.close(fd)
    assert reply == {"ok": True, "peer_pid": os.getpid(), "echo": 7}
    assert len(fds) == 1
    got = Mapping.from_fd(fds[0], region.info(False))
    got.numpy(np.uint8, (4,))[:] = 9
    assert list(region.map_local().numpy(np.uint8, (4,))) == [9, 9, 9, 9]
    os.close(fds[0])


def test_fdpass_rejects_garbage():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.send(b"\xc1\xc1")
    with pytest.raises(fdpass.FdPassError):
        fdpass.recv(b)
    a.send(b"\x01")  # msgpack 1: not a map
    with pytest.raises(fdpass.FdPassError):
        fdpass.recv(b)
    a.close()
    with pytest.raises(fdpass.FdPassError):
        fdpass.recv(b)
