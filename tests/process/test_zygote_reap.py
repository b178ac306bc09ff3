"""The zygote keeps an exited child a zombie for a while before reaping it, so that the sidecar
(not its parent) can read from /proc how it died."""
import os
import signal
import time

from kvhold.executor import zygote as zy


def _state(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    except FileNotFoundError:
        return None


def test_an_exited_child_stays_a_zombie_with_its_status_then_is_reaped(monkeypatch):
    monkeypatch.setattr(zy, "ZOMBIE_KEEP_S", 0.3)
    z = zy.Zygote("/nonexistent", os.getpid())
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    z.children.add(pid)
    os.kill(pid, signal.SIGKILL)
    while (_state(pid) or ["?"])[0] != "Z":
        time.sleep(0.01)
    z._reap()                                     # seen exited: kept
    fields = _state(pid)
    assert fields[0] == "Z" and os.waitstatus_to_exitcode(int(fields[-1])) == -signal.SIGKILL
    assert pid in z.children
    time.sleep(0.35)
    z._reap()                                     # kept long enough: reaped
    assert _state(pid) is None and pid not in z.children
