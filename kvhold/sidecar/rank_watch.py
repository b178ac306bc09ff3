"""The ranks of tensor-parallel groups, as the supervisor watches them.

A group (kvhold.executor.tensor_parallel.ranks) is one executor to the sidecar: its leader,
rank 0, holds the lease; ranks 1..N-1 are the leader's children. Their pidfds are watched
here, in the supervisor's event loop: the death of any rank fences and kills the whole group
(through the supervisor's `fence`). The ranks come from the leader's `Ready` (`watch`) or, for
an executor a restarted sidecar re-adopted (which sends no `Ready`), from /proc: the leader's
children running the follower program (`watch_readopted`). `kill` and `close` are the
supervisor's part of a fence and of an exit. docs/ARCHITECTURE.md, section 10.
"""
from __future__ import annotations

import logging
import os
import signal
from typing import TYPE_CHECKING, Callable

from kvhold.protocol.leases import now_ns
from kvhold.protocol.procfs import exit_code, stat_fields
from kvhold.protocol.tensor_parallel import follower_pids

if TYPE_CHECKING:
    from kvhold.sidecar.supervisor import ExecutorHandle, ExecutorLaunch, Loop

log = logging.getLogger(__name__)


class RankWatch:
    """`handles`: the supervisor's handles by lease slot (a rank's death counts only while its
    leader's handle is current and unfenced); `fence(h, reason, detect_ns, kill=, detail=,
    exit_hint=)`: the supervisor's fence; `launch`: what executors are started with (its
    settings' tensor_parallel_size is the sidecar's `-tp`)."""

    def __init__(self, loop: Loop, handles: dict[int, ExecutorHandle], fence: Callable[..., None],
                 launch: ExecutorLaunch):
        self.loop = loop
        self.handles = handles
        self.fence = fence
        self.launch = launch

    def watch(self, h: ExecutorHandle, pids) -> bool:
        """A tensor-parallel group: the executor is rank 0, `pids` its children ranks 1..N-1. The
        death of any of them fences and kills the group. False if one is not running (the group
        is fenced already)."""
        for pid in pids:
            fields = stat_fields(pid)
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                fd = -1
            if fd < 0 or not fields or int(fields[1]) != h.pid:   # gone already, or not its child
                if fd >= 0:
                    os.close(fd)
                self.fence(h, "died", now_ns(), kill=True, detail=f"rank pid {pid} is not running")
                return False
            h.rank_pidfds[pid] = fd
            self.loop.watch_fd(fd, lambda h=h, pid=pid, epoch=h.epoch: self._died(h, pid, epoch))
        h.info["ranks"] = [h.pid, *h.rank_pidfds]
        return True

    def watch_readopted(self, h: ExecutorHandle) -> None:
        """A re-adopted executor sends no `Ready`: a group's ranks 1..N-1 are found as its children
        running the follower program (/proc) and watched as `watch` does, so a rank's death
        fences and kills the group as under the sidecar that spawned it. A group short of a rank
        is fenced and killed at once (its leader is exiting, or will wait in a collective)."""
        if self.handles.get(h.slot) is not h or h.fenced:
            return
        pids = follower_pids(h.pid)
        size = self.launch.settings.tensor_parallel_size
        if not pids and size <= 1:
            return
        if not self.watch(h, pids):
            return
        if size > 1 and len(pids) != size - 1:
            self.fence(h, "died", now_ns(), kill=True,
                       detail=f"{len(pids) + 1} of its group's {size} ranks are running")
            return
        log.info("watching ranks %s of re-adopted executor pid %d's group", pids, h.pid)

    def _died(self, h: ExecutorHandle, pid: int, epoch: int) -> None:
        self.loop.unwatch_fd(h.rank_pidfds[pid])
        if self.handles.get(h.slot) is h and h.epoch == epoch and not h.fenced:
            fields = stat_fields(pid)          # its zombie's exit status (rank 0 leaves it unreaped)
            try:
                code = exit_code(int(fields[-1])) if fields and fields[0] == "Z" else None
            except ValueError:
                code = None
            self.fence(h, "died", now_ns(), kill=True, detail=f"rank pid {pid} of its group died",
                       exit_hint=code)

    def kill(self, h: ExecutorHandle) -> None:
        """SIGKILL every rank 1..N-1 of h's group."""
        for fd in h.rank_pidfds.values():
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self, h: ExecutorHandle) -> None:
        """h has exited: its ranks' watches and pidfds go."""
        for fd in h.rank_pidfds.values():
            self.loop.unwatch_fd(fd)
            os.close(fd)
        h.rank_pidfds.clear()
