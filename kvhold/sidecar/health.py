"""GPU health: turn NVML signals into actions, and a thread that watches for them.

`EscalationPolicy.decide(signal)` maps one `HealthSignal` to a `HealthEvent` with an
`Action`: restart the executor (application state is bad, device memory is fine),
restart the pool (device memory may be bad: free it, reset the GPU), or drain the
node (the GPU cannot be trusted or reached: move requests to another sidecar).
Repeated executor restarts escalate to a pool restart. `HealthMonitor` polls a
source on a daemon thread and calls `on_event` there for every event whose action
is not NONE; the sidecar hops to its own loop thread. A source that fails stops the
monitor (reported in `status()["error"]`), never the sidecar.
"""
from __future__ import annotations

import collections
import enum
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Mapping

from kvhold.sidecar.health_sources import (SIGNAL_KINDS, HealthSignal, HealthSourceError, NvmlSource,
                                    RecordedSource, load_recording)

__all__ = ["Action", "HealthEvent", "EscalationPolicy", "HealthMonitor", "make_source",
           "XID_ACTIONS", "KIND_RULES", "SIGNAL_KINDS", "HealthSignal", "HealthSourceError",
           "NvmlSource", "RecordedSource", "load_recording"]
log = logging.getLogger(__name__)
MAX_STATUS_EVENTS = 32


class Action(enum.IntEnum):
    """What the sidecar should do, ordered by severity so max() picks the stronger."""
    NONE = 0
    RESTART_EXECUTOR = 1
    RESTART_POOL = 2
    DRAIN = 3

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(slots=True, frozen=True)
class HealthEvent:
    signal: HealthSignal
    action: Action
    reason: str             # for humans, e.g. "Xid 79 (GPU has fallen off the bus): drain"

    def to_dict(self) -> dict:
        return {**self.signal.to_dict(), "action": self.action.label, "reason": self.reason}


_E, _P, _D = Action.RESTART_EXECUTOR, Action.RESTART_POOL, Action.DRAIN
# Xid -> (action, meaning). Meanings follow NVIDIA's Xid catalog
# (docs.nvidia.com/deploy/xid-errors); the action follows its "immediate action".
XID_ACTIONS: dict[int, tuple[Action, str]] = {
    # RESTART_APP in the catalog: the fault is confined to the context that caused it
    # (a kernel bug, a bad pointer); the GPU and its memory are fine.
    13: (_E, "graphics engine exception"),
    31: (_E, "GPU memory page fault (MMU fault, illegal address)"),
    43: (_E, "GPU stopped processing (the faulting channel was stopped)"),
    45: (_E, "preemptive cleanup after a previous error"),
    109: (_E, "context switch timeout"),
    # Contained ECC error: only the contexts that touched the poisoned memory are hit.
    # The row is queued for remapping too, which arrives as Xid 63 / remap_pending and
    # restarts the pool; touching the poison again repeats this and the storm rule escalates.
    94: (_E, "contained ECC error"),
    # RESET_GPU in the catalog: device memory or firmware state cannot be trusted, so
    # the pool built on it must be freed and the GPU reset before memory is handed out.
    48: (_P, "double-bit ECC error"),
    62: (_P, "internal micro-controller halt"),
    63: (_P, "ECC page retirement / row remapping recorded, pending a GPU reset"),
    92: (_P, "high single-bit ECC error rate"),
    95: (_P, "uncontained ECC error"),
    119: (_P, "GSP RPC timeout"),
    120: (_P, "GSP error"),
    # Nothing this node can do in place: the GPU is gone or its memory cannot be repaired.
    64: (_D, "row remapping / page retirement failure"),
    79: (_D, "GPU has fallen off the bus"),
    # NVLink faults are in the link or the NVSwitch fabric, not in our memory: a pool
    # restart does not fix them, and a reset must cover every GPU of the NVLink domain
    # (with Fabric Manager), beyond one sidecar's reach. Tensor-parallel peers would hang
    # or compute on corrupt data meanwhile, so requests move elsewhere.
    74: (_D, "NVLink error"),
    # The driver says the GPU needs a recovery action (reset, reboot or drain) that it
    # does not spell out in the Xid number alone: the operator must look.
    154: (_D, "GPU recovery action changed"),
}

# Signal kind -> (action, describe(detail)). Xids go through XID_ACTIONS instead.
KIND_RULES: dict[str, tuple[Action, Callable[[dict], str]]] = {
    "ecc_dbe": (_P, lambda d: f"double-bit ECC errors rose to {d.get('count')} "
                              f"(baseline {d.get('baseline')})"),
    "remap_pending": (_P, lambda d: "row remapping pending (uncorrectable error recorded)"),
    "remap_failure": (_D, lambda d: "row remapping failed (no spare rows)"),
    "pcie_degraded": (_D, lambda d: f"PCIe link degraded to x{d.get('width')} gen{d.get('gen')} "
                                    f"(baseline x{d.get('baseline_width')} "
                                    f"gen{d.get('baseline_gen')})"),
    "gpu_lost": (_D, lambda d: "GPU is lost (NVML)"),
    # A query that fails without saying why tells nothing about the device: log only.
    "nvml_error": (Action.NONE, lambda d: f"NVML {d.get('query')} failed: {d.get('error')}"),
}


def make_source(spec: str):
    """'off' -> None, 'nvml' / 'nvml:N' -> NvmlSource(N), 'replay:PATH' -> RecordedSource."""
    usage = f"health source must be 'off', 'nvml', 'nvml:N' or 'replay:PATH', got {spec!r}"
    if not isinstance(spec, str):
        raise ValueError(usage)
    kind, sep, arg = spec.strip().partition(":")
    if kind == "off" and not sep:
        return None
    if kind == "nvml":
        if not sep:
            return NvmlSource(0)
        if not arg.isdigit():
            raise ValueError(f"{usage}: the NVML device index must be an integer >= 0")
        return NvmlSource(int(arg))
    if kind == "replay" and arg:
        return RecordedSource(arg)
    raise ValueError(usage)


class EscalationPolicy:
    """Maps signals to actions and escalates executor-restart storms to a pool restart.

    `storm_count` RESTART_EXECUTOR decisions within `storm_window_s` (by signal.ns)
    make the last one RESTART_POOL; the window then starts afresh. `current` is the
    highest action decided since the last `clear()`. Thread-safe.
    """

    def __init__(self, storm_count: int = 3, storm_window_s: float = 60.0,
                 xid_actions: Mapping[int, Action] | None = None):
        if storm_count < 1 or storm_window_s <= 0:
            raise ValueError("storm_count must be >= 1 and storm_window_s > 0")
        self.storm_count = storm_count
        self.storm_window_ns = int(storm_window_s * 1e9)
        self.xid_actions = {x: (Action(a), XID_ACTIONS.get(x, (a, "configured"))[1])
                            for x, a in (xid_actions or {}).items()}
        self.current = Action.NONE
        self.reason = ""
        self._restarts: collections.deque[int] = collections.deque()
        self._lock = threading.Lock()

    def decide(self, signal: HealthSignal) -> HealthEvent:
        """The action for `signal`; raises ValueError for a kind not in SIGNAL_KINDS."""
        action, what = self._classify(signal)
        with self._lock:
            if action == Action.RESTART_EXECUTOR and self._storm(signal.ns):
                action = Action.RESTART_POOL
                what += (f"; {self.storm_count} executor restarts within "
                         f"{self.storm_window_ns / 1e9:g} s")
            event = HealthEvent(signal, action, f"{what}: {action.label.replace('_', ' ')}")
            if action > self.current:
                self.current, self.reason = action, event.reason
        return event

    def clear(self) -> None:
        """Forget standing actions and the storm window (the operator has acted)."""
        with self._lock:
            self.current, self.reason = Action.NONE, ""
            self._restarts.clear()

    def _classify(self, signal: HealthSignal) -> tuple[Action, str]:
        if signal.kind == "xid":
            xid = signal.detail.get("xid")
            action, meaning = self.xid_actions.get(xid) or XID_ACTIONS.get(xid, (None, None))
            if action is None:
                # Unknown: the cheapest action that clears application state; a repeat
                # escalates through the storm rule.
                return _E, f"Xid {xid} (not in kvhold's table, see NVIDIA's Xid catalog)"
            return action, f"Xid {xid} ({meaning})"
        if signal.kind not in KIND_RULES:
            raise ValueError(f"unknown health signal kind {signal.kind!r}")
        action, describe = KIND_RULES[signal.kind]
        return action, describe(signal.detail)

    def _storm(self, ns: int) -> bool:
        self._restarts.append(ns)
        while self._restarts and ns - self._restarts[0] >= self.storm_window_ns:
            self._restarts.popleft()
        if len(self._restarts) < self.storm_count:
            return False
        self._restarts.clear()
        return True


class HealthMonitor:
    """Polls `source` on a daemon thread; `on_event(HealthEvent)` runs on that thread.

    `source` may be None (health checks off): start() then does nothing and status()
    says so. stop() returns within about `interval_s` and closes the source.
    """

    def __init__(self, source, policy: EscalationPolicy,
                 on_event: Callable[[HealthEvent], None], interval_s: float = 1.0):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.source = source
        self.policy = policy
        self.on_event = on_event
        self.interval_s = interval_s
        self.error: str | None = None
        self.events: collections.deque[HealthEvent] = collections.deque(maxlen=MAX_STATUS_EVENTS)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "HealthMonitor":
        if self.source is not None and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvhold-health", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval_s + 1.0)
            if self._thread.is_alive():
                # Closing NVML under a thread still inside it is undefined: leave it be.
                log.warning("health monitor did not stop within %.1f s", self.interval_s + 1.0)
                return
        if self.source is not None:
            self.source.close()

    def status(self) -> dict:
        """JSON-serialisable: source, standing action and reason, recent events, error."""
        with self._lock:
            events = [e.to_dict() for e in self.events]
        return {"source": self.source.describe() if self.source is not None else "off",
                "action": self.policy.current.label, "reason": self.policy.reason,
                "events": events, "error": self.error, "running": self.running}

    def _run(self) -> None:
        try:
            self.source.start()
            while not self._stop.is_set():
                for signal in self.source.poll(self.interval_s):
                    self._handle(self.policy.decide(signal))
        except Exception as e:    # a broken source must not take the sidecar down with it
            self.error = f"{type(e).__name__}: {e}"
            log.error("health monitor stopped: %s", self.error,
                      exc_info=not isinstance(e, HealthSourceError))

    def _handle(self, event: HealthEvent) -> None:
        if event.action == Action.NONE:
            log.info("health: %s", event.reason)
            return
        with self._lock:
            self.events.append(event)
        level = logging.WARNING if event.action == Action.RESTART_EXECUTOR else logging.ERROR
        log.log(level, "health: %s", event.reason)
        try:
            self.on_event(event)
        except Exception:
            log.exception("health on_event callback failed for %s", event.reason)
