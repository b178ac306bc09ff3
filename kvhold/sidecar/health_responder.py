"""What the sidecar does about a health event (see kvhold.sidecar.health for the policy).

* restart_executor: fence the active executor and SIGKILL it; the standby takes
  over exactly as after a crash (device memory is trusted, so no request is lost).
* restart_pool: device memory may be bad. New admissions close with a clear reason
  (clients retry elsewhere); requests in flight finish; the operator runs
  `kvhold pool-restart` (or the unit restarts), which brings a new pool generation.
* drain: the GPU cannot be trusted or reached. Admissions close, /health turns 503
  and the registry entry says so, so routers move new work away.
The monitor thread only posts; every action runs on the sidecar's loop thread.
The responder gets the health config section, the device, the loop's `post`, and
the two actions it takes: restart the active executor, close admissions.
"""
from __future__ import annotations

import logging
from typing import Callable

from kvhold.sidecar.config import HealthConfig
from kvhold.sidecar.health import Action, EscalationPolicy, HealthEvent, HealthMonitor, make_source

log = logging.getLogger(__name__)


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
                 close_admissions: Callable[[str, str], None]):
        self.post = post
        self.restart_executor = restart_executor      # Supervisor.restart_active
        self.close_admissions = close_admissions      # Frontend.close_admissions
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
        if event.action == Action.RESTART_EXECUTOR:
            taken["executor_pid"] = self.restart_executor(f"health: {event.reason}")
        elif event.action == Action.RESTART_POOL:
            self.close_admissions("health", f"pool restart required ({event.reason}); "
                                            "run `kvhold pool-restart`")
        elif event.action == Action.DRAIN:
            self.close_admissions("health", f"node drained ({event.reason})")
        self.actions_taken.append(taken)
        del self.actions_taken[:-32]

    def status(self) -> dict:
        return {**self.monitor.status(), "actions_taken": list(self.actions_taken)}
