"""What /proc says about another process: whether it runs, its state and its exit status.

Every process of kvhold asks these about peers it did not start (a sidecar about executors
the zygote forked or a dead sidecar left behind, an executor about a restarted sidecar), so
it cannot wait() for them; a zombie is dead for all of them."""
from __future__ import annotations

import os


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first, exit code last), or None."""
    try:
        return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a running process (not gone, not a zombie)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = stat_fields(pid)
    return bool(fields) and fields[0] != "Z"


def exit_code(raw: int) -> int:
    """A wait status as a shell's exit code (128 + N: signal N)."""
    code = os.waitstatus_to_exitcode(raw)
    return code if code >= 0 else 128 - code
