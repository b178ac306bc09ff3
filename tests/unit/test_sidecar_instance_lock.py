"""The instance lock with real flock(2) locks: one holder, however starts and stops interleave."""
import fcntl
import os
import time

import pytest

from kvhold.protocol.naming import InstancePaths
from kvhold.sidecar import instance_lock
from kvhold.sidecar.instance_lock import InstanceBusy, InstanceLock


@pytest.fixture
def paths(tmp_path):
    return InstancePaths.for_instance("lockme", tmp_path)


def test_a_second_lock_is_refused_and_names_the_holder(paths):
    first = InstanceLock(paths)
    try:
        with pytest.raises(InstanceBusy, match="already served by sidecar pid"):
            InstanceLock(paths)
    finally:
        first.release()
    InstanceLock(paths).release()        # free again once released


def test_a_lock_taken_on_a_file_its_holder_just_unlinked_is_taken_again(paths, monkeypatch):
    """A starts while B stops: A opens the lock file, B unlinks it and drops its lock, A locks
    the unlinked inode. A third sidecar C must still find the instance busy: A has to hold the
    lock on the file at the path, or C would lock a new file and remove A's sockets as stale."""
    stopping = InstanceLock(paths)
    real_flock = fcntl.flock
    calls = []

    def flock_after_the_holder_stopped(fd, op):
        calls.append(fd)
        if len(calls) == 1:
            stopping.release()           # between A's open and A's flock
        return real_flock(fd, op)

    monkeypatch.setattr(instance_lock.fcntl, "flock", flock_after_the_holder_stopped)
    starting = InstanceLock(paths)
    monkeypatch.setattr(instance_lock.fcntl, "flock", real_flock)
    try:
        with pytest.raises(InstanceBusy):
            InstanceLock(paths)
    finally:
        starting.release()


def test_stale_cleanup_never_touches_an_instance_whose_name_extends_ours(tmp_path):
    """Instance "a" removing its stale shm must leave the live objects of instance "a-b" alone:
    both names start with "kvhold-<uid>-a-"."""
    import posix_ipc

    mine = InstancePaths.for_instance("lk-a", tmp_path)
    other = InstancePaths.for_instance("lk-a-b", tmp_path)
    created = {}
    for paths, what in ((mine, "tables"), (mine, "oldpart"), (other, "tables"), (other, "kv")):
        name = paths.shm_name(what)
        created[name] = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600, size=4096)
    lock = InstanceLock(mine)
    try:
        removed = lock.remove_stale(("tables", "kv", "weights"))
        assert sorted(removed) == sorted([mine.shm_name("tables"), mine.shm_name("oldpart")])
        for what in ("tables", "kv"):
            posix_ipc.SharedMemory(other.shm_name(what)).close_fd()     # still there
    finally:
        lock.release()
        for name, shm in created.items():
            shm.close_fd()
            try:
                posix_ipc.unlink_shared_memory(name)
            except posix_ipc.ExistentialError:
                pass


def test_whether_a_spare_takes_over_is_read_from_the_lock_and_its_marker(paths):
    """`kvhold serve`'s question once its sidecar (pid 100) has exited, its spare (pid 200)
    waiting: the spare takes over only from a sidecar that died holding the lock and that it
    saw; a lock file removed by a stop or a failed start leaves it waiting."""
    paths.runtime_dir.mkdir(parents=True)
    takes_over = instance_lock.spare_takes_over
    assert not takes_over(paths, 200, 100)                 # no lock file: nobody died holding it
    paths.spare_file(200).write_text("100\n")
    assert not takes_over(paths, 200, 100)
    paths.lock_file.write_text("100\n")
    assert takes_over(paths, 200, 100)                     # died holding it, and the spare saw it
    paths.spare_file(200).unlink()
    assert not takes_over(paths, 200, 100)                 # a spare that never saw it (still loading)
    paths.lock_file.write_text("200\n")
    assert takes_over(paths, 200, 100)                     # it took the lock already
    paths.spare_file(200).write_text("300\n")
    paths.lock_file.write_text("300\n")
    assert not takes_over(paths, 200, 100)                 # the lock names another sidecar


def test_the_lock_file_never_reads_empty_while_a_new_holder_names_itself(paths, monkeypatch):
    """A spare taking the lock over rewrites the holder's line in place, then cuts the file:
    whenever `kvhold serve` reads it meanwhile it names the dead holder or the spare (the first
    line), never nothing, so a takeover is never taken for a failed one."""
    paths.runtime_dir.mkdir(parents=True)
    paths.spare_file(200).write_text("1000001\n")
    paths.lock_file.write_text("1000001\n")               # the dead holder: a longer pid
    seen = []
    real_pwrite, real_ftruncate = os.pwrite, os.ftruncate

    def pwrite(fd, data, offset):
        seen.append(paths.lock_file.read_text())
        return real_pwrite(fd, data, offset)

    def ftruncate(fd, length):
        seen.append(paths.lock_file.read_text())
        assert instance_lock.spare_takes_over(paths, os.getpid(), 1000001)
        return real_ftruncate(fd, length)
    monkeypatch.setattr(instance_lock.os, "pwrite", pwrite)
    monkeypatch.setattr(instance_lock.os, "ftruncate", ftruncate)
    fd = os.open(paths.lock_file, os.O_RDWR)
    try:
        instance_lock._write_holder(fd)
        assert instance_lock._holder_pid(fd) == os.getpid()
    finally:
        os.close(fd)
    assert seen == ["1000001\n", f"{os.getpid()}\n" + "1000001\n"[len(f"{os.getpid()}\n"):]]
    assert all(instance_lock._first_line(text) for text in seen)
    assert paths.lock_file.read_text() == f"{os.getpid()}\n"


def test_a_holder_that_dies_between_two_looks_of_the_spare_is_taken_over(paths, monkeypatch):
    """A pool restart's new image (the same pid) locks a new file and dies before the spare,
    woken by the old image's clean stop, looks again: the file at the path, free and naming the
    holder the spare saw, is a death the spare takes over from."""
    import threading

    first = InstanceLock(paths)
    looks = []
    real_sleep = time.sleep
    waiting = threading.Event()

    def sleep(seconds):                 # between two looks: the old image stops, the new one dies
        if threading.current_thread() is not waiter:     # time.sleep is the process's: others sleep
            return real_sleep(seconds)
        looks.append(seconds)
        if len(looks) == 1:
            fd = os.open(paths.lock_file, os.O_RDWR | os.O_CREAT, 0o600)
            os.write(fd, f"{os.getpid()}\n".encode())   # it locked the file, wrote its pid, died
            os.close(fd)

    monkeypatch.setattr(instance_lock.time, "sleep", sleep)
    seen = []

    def on_waiting(pid):
        seen.append(pid)
        waiting.set()

    waiter = threading.Thread(target=lambda: seen.append(instance_lock.wait_for_holder_death(paths, on_waiting)),
                              daemon=True)     # a failure must not hold the test process open
    waiter.start()
    assert waiting.wait(60)
    first.release()                     # a clean stop: the spare wakes and looks again
    waiter.join(60)
    assert not waiter.is_alive()
    fd, dead = seen[-1]
    try:
        assert dead == os.getpid() and seen[0] == os.getpid()
        assert paths.lock_file.read_text().strip() == str(os.getpid())    # it names the spare now
    finally:
        os.close(fd)
