"""The idle workload: hold a lease, map memory, heartbeat, do nothing else.

Used with sidecars that run no model (detection benchmarks, supervision tests):
the executor is real and its death is real, but it needs no torch.
"""
from __future__ import annotations

from kvhold.executor.workload import WorkloadBase
from kvhold.protocol.recovery_report import RecoveryReport


class IdleWorkload(WorkloadBase):
    def promote(self, msg) -> RecoveryReport:
        return RecoveryReport(fenced_epoch=msg.fenced_epoch)  # nothing to recover; tells the sidecar we are done

    def has_work(self) -> bool:
        return False

    def step(self) -> list[int]:
        return []
