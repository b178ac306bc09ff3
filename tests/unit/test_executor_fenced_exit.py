"""A fenced executor exits as fenced (75) whichever way it learns it: its own lease check, the
sidecar's refusal of a message it sent under the old epoch, or an error met once its lease was
taken. The executor's loop runs in process on real tables, its channel's socket played by the
test as the sidecar answers (kvhold.sidecar.daemon._on_control)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from kvhold.executor import runtime
from kvhold.executor.channel import Channel
from kvhold.executor.idle import IdleWorkload
from kvhold.executor.runtime import EXIT_FENCED, ExecutorConfig, ExecutorContext, ExecutorRuntime
from kvhold.protocol import messages as m, wire
from kvhold.protocol.errors import ErrorCode
from kvhold.protocol.layout import Role
from kvhold.protocol.leases import Lease, LeaseTable
from kvhold.protocol.settings import ExecutorSettings

SLOT = 0


class SidecarSocket:
    """The executor's end of the control socket, the sidecar's side played in process: what it
    queued is received; a message under an epoch that is no longer the slot's is refused with
    FENCED, as the sidecar refuses it. `on_send(msg)` runs when the executor sends `msg`."""

    def __init__(self, leases: LeaseTable, on_send=None):
        self.leases = leases
        self.on_send = on_send or (lambda msg: None)
        self.inbox: list[bytes] = []
        self.sent: list[object] = []

    def queue(self, msg) -> None:
        self.inbox.append(wire.encode(msg))

    def send(self, frame: bytes) -> None:
        msg = wire.decode(frame)
        self.sent.append(msg)
        self.on_send(msg)
        if msg.epoch != self.leases.epoch(msg.slot):
            self.queue(m.Error(code=ErrorCode.FENCED, message="stale or unknown lease"))

    def poll(self, timeout_ms, flags=0) -> bool:
        return bool(self.inbox)

    def recv(self) -> bytes:
        return self.inbox.pop(0)

    def close(self, linger=None) -> None:
        pass


def _channel(sock: SidecarSocket) -> Channel:
    channel = Channel.__new__(Channel)        # the real receive path over the played socket
    channel.paths, channel.sock, channel._poller = None, sock, None
    channel.ctx = SimpleNamespace(closed=True)
    return channel


def _run(tmp_path, monkeypatch, tables, workload_cls, sock: SidecarSocket, epoch: int) -> int:
    """ExecutorRuntime.run over the played socket, attached to lease SLOT under `epoch`."""
    channel = _channel(sock)
    monkeypatch.setattr(runtime, "Channel", lambda paths: channel)
    # Triton's hooks are this process's: a promotion here sets none (other tests import Triton)
    monkeypatch.setattr(runtime, "CompileWatch", lambda lease: SimpleNamespace(install=lambda: False))
    token = tmp_path / "token"
    token.write_text("t")

    def attached_run(self, channel, token):   # what _run does once attached and mapped
        self.lease = Lease(tables, SLOT, epoch)
        attached = SimpleNamespace(slot=SLOT, epoch=epoch,
                                   settings=ExecutorSettings(workload="idle", heartbeat_ms=5))
        ctx = ExecutorContext(attached, tables, {}, channel, self.lease)
        return self._loop(ctx, workload_cls(ctx))

    monkeypatch.setattr(ExecutorRuntime, "_run", attached_run)
    return ExecutorRuntime(ExecutorConfig(instance="fenced", runtime_root=tmp_path,
                                          token_file=token)).run()


def _leased(tables, role: Role) -> tuple[LeaseTable, int]:
    leases = LeaseTable(tables)
    epoch = leases.grant(SLOT, os.getpid())
    leases.set_role(SLOT, Role.STANDBY)
    if role == Role.ACTIVE:
        leases.set_role(SLOT, Role.ACTIVE)
    return leases, epoch


def test_refused_message_of_a_fenced_epoch_exits_fenced(tables, tmp_path, monkeypatch):
    """Stopped after its promotion's last lease check and before it sends Recovered, the
    executor is fenced as hung; on waking it sends Recovered under the old epoch, and the
    sidecar's refusal can be read before its next beat: that refusal says fenced too."""
    leases, epoch = _leased(tables, Role.ACTIVE)

    def stopped_then_fenced(msg):
        if isinstance(msg, m.Recovered):
            leases.fence(SLOT)

    sock = SidecarSocket(leases, stopped_then_fenced)
    sock.queue(m.Promote(epoch=epoch, pending_epochs=[]))
    assert _run(tmp_path, monkeypatch, tables, IdleWorkload, sock, epoch) == EXIT_FENCED
    assert [type(msg) for msg in sock.sent] == [m.Recovered]
    assert not sock.inbox                     # it exited on the refusal, before any beat


class FailsOnce(IdleWorkload):
    """A standby whose idle turn fails: the sidecar took its lease, or not, just before."""
    fence_first = True

    def idle(self) -> None:
        if self.fence_first:
            LeaseTable(self.ctx.tables).fence(SLOT)
        raise OSError("No such file or directory: what the sidecar removed")


@pytest.mark.parametrize("fenced", [True, False])
def test_error_after_the_lease_was_taken_exits_fenced(tables, tmp_path, monkeypatch, fenced):
    leases, epoch = _leased(tables, Role.STANDBY)
    workload = type("Workload", (FailsOnce,), {"fence_first": fenced})
    if fenced:
        assert _run(tmp_path, monkeypatch, tables, workload, SidecarSocket(leases), epoch) == EXIT_FENCED
    else:       # an executor that still holds its lease fails as before: no error is hidden
        with pytest.raises(OSError, match="what the sidecar removed"):
            _run(tmp_path, monkeypatch, tables, workload, SidecarSocket(leases), epoch)
