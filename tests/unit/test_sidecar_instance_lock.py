"""The instance lock with real flock(2) locks: one holder, however starts and stops interleave."""
import fcntl

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
