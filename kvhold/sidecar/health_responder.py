"""What the sidecar does about a health event (see kvhold.sidecar.health for the policy).

* restart_executor: fence the active executor and SIGKILL it; the standby takes
  over exactly as after a crash (device memory is trusted, so no request is lost).
* restart_pool: device memory may be bad. New admissions close with a clear reason
  (clients retry elsewhere); requests in flight finish; the operator runs
  `kvhold pool-restart` (or the unit restarts), which brings a new pool generation.
* drain: the GPU cannot be trusted or reached. Admissions close, /health turns 503
  and the registry entry says so, so routers move new work away.
Admissions a health action closed stay closed until the operator, having checked the
GPU, runs `kvhold admissions --reopen` (an `Admissions` message on the local socket):
the closure lifts and the policy starts afresh, so the next fault closes them again.
A pool restart re-executes the sidecar, which starts with admissions open.
An executor whose CUDA context faults (an illegal address: Xid 13, 31, 43 or 45 follows)
says so on its way out (`Failing`) and is fenced and replaced at once; the driver's Xid
for that fault, arriving within `CONTEXT_XID_WINDOW_NS`, is attributed to it and does
not restart its successor.
The monitor thread only posts; every action runs on the sidecar's loop thread.
The responder gets the health config section, the device, the loop's `post`, and
the actions it takes: restart the active executor, close admissions (and reopen them
on the operator's word).
"""
from __future__ import annotations

import logging
from typing import Callable

from kvhold.protocol import messages as m
from kvhold.protocol.errors import ErrorCode
from kvhold.sidecar.config import HealthConfig
from kvhold.sidecar.health import Action, EscalationPolicy, HealthEvent, HealthMonitor, make_source

log = logging.getLogger(__name__)

CONTEXT_XIDS = frozenset((13, 31, 43, 45))   # faults confined to the context that caused them
CONTEXT_XID_WINDOW_NS = 10_000_000_000       # an Xid this soon after a context fault is that fault's


def resolve_spec(spec: str, device: str) -> str:
    """'auto' means NVML on a CUDA device and nothing on CPU."""
    if spec != "auto":
        return spec
    if device.startswith("cuda"):
        return "nvml:" + (device.partition(":")[2] or "0")
    return "off"


class HealthResponder:
    def __init__(self, config: HealthConfig, device: str, post: Callable[[Callable[[], None]], None],
                 restart_executor: Callable[[str], int | None],
                 close_admissions: Callable[[str, str], None], open_admissions: Callable[[str], None],
                 admissions_closed: Callable[[], dict[str, str]],
                 recent_context_fault: Callable[[int], int | None] = lambda window_ns: None):
        self.post = post
        self.recent_context_fault = recent_context_fault   # Supervisor.recent_context_fault
        self.restart_executor = restart_executor      # Supervisor.restart_active
        self.close_admissions = close_admissions      # Frontend.close_admissions
        self.open_admissions = open_admissions        # Frontend.open_admissions
        self.admissions_closed = admissions_closed    # who closed admissions, and why
        spec = resolve_spec(config.source, device)
        self.monitor = HealthMonitor(make_source(spec), EscalationPolicy(), self._from_thread,
                                     interval_s=config.interval_s)
        self.actions_taken: list[dict] = []

    def start(self) -> "HealthResponder":
        self.monitor.start()
        return self

    def stop(self) -> None:
        self.monitor.stop()

    def _from_thread(self, event: HealthEvent) -> None:
        self.post(lambda: self.respond(event))

    def respond(self, event: HealthEvent) -> None:
        taken = {"action": event.action.label, "reason": event.reason, "kind": event.signal.kind}
        faulted = (self.recent_context_fault(CONTEXT_XID_WINDOW_NS)
                   if event.signal.kind == "xid" and event.signal.detail.get("xid") in CONTEXT_XIDS else None)
        if event.action == Action.RESTART_EXECUTOR and faulted is not None:
            # The driver reports the fault of a context whose executor already said so and
            # was replaced: restarting its successor would only interrupt the requests again.
            taken.update(action="none", attributed_to_pid=faulted)
        elif event.action == Action.RESTART_EXECUTOR:
            taken["executor_pid"] = self.restart_executor(f"health: {event.reason}")
        elif event.action == Action.RESTART_POOL:
            self.close_admissions("health", f"pool restart required ({event.reason}); "
                                            "run `kvhold pool-restart`")
        elif event.action == Action.DRAIN:
            self.close_admissions("health", f"node drained ({event.reason})")
        self._record(taken)

    def on_admissions(self, identity: bytes, msg: m.Admissions):
        """The operator's view of admissions; `reopen` lifts a health action's closure."""
        if identity[:1] != b"u":
            return m.Error(code=ErrorCode.UNAUTHORIZED, tag=msg.tag,
                           message="admissions are managed only on the local ipc socket")
        if msg.reopen and "health" in self.admissions_closed():
            self.monitor.policy.clear()
            self.open_admissions("health")
            self._record({"action": "reopen_admissions", "reason": "operator", "kind": "operator"})
        closed = self.admissions_closed()
        return m.AdmissionsReply(tag=msg.tag, open=not closed, closed_by=dict(closed))

    def _record(self, taken: dict) -> None:
        self.actions_taken.append(taken)
        del self.actions_taken[:-32]

    def status(self) -> dict:
        return {**self.monitor.status(), "actions_taken": list(self.actions_taken)}
