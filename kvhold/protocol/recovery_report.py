"""What a promoted executor reports after its takeover, and the record the sidecar keeps of it.

A `RecoveryReport` is built once per takeover (kvhold.executor.takeover; the TensorRT-LLM
bridge builds its own) and travels in the `Recovered` message as a nested wire value.
`fenced_epoch` is the epoch of the executor whose death caused the takeover: 0 on a first
activation, where nothing was recovered. Timing marks (`*_ns`) are `now_ns()` of
kvhold.protocol.leases, one clock for every process of the host, so the sidecar can set
them against its own detection and first-token times.

A figure that a takeover does not measure (a step its mode does not have) is None, and is
left out of the record: `to_dict()` is what the sidecar stores and `kvhold status --json`
shows, the keys that `kvhold top`, the metrics exporter and the benchmarks read.
"""
from __future__ import annotations

import dataclasses

from kvhold.protocol.wire import nested

REQUEST_CLASSES = ("resumable", "damaged", "lost")
# Every requests_<class> count of a record: the live classes and the requests already finished.
RECORD_CLASSES = ("finished", *REQUEST_CLASSES)
# Why the sidecar fences an executor (the `reason` of its `fence` event; details go in `detail`):
# died (its process or main thread ended), hang (its heartbeat lease expired), cuda_fault (it
# reported its CUDA context lost), exited (a stop it was asked for or announced), health (the
# NVML health monitor restarted it).
FENCE_REASONS = ("died", "hang", "cuda_fault", "exited", "health")
# The phases of a failover, each measured from detection to a mark: the fence event's
# `fenced_ns`, then the record's marks.
RECOVERY_PHASES = {"fence": "fenced_ns", "takeover": "promoted_ns", "validate": "validated_ns",
                   "resume": "resumed_ns", "first_token": "first_token_ns"}


@nested
class RequestRecovery:
    """One live request's outcome: its class, where its KV went bad and how much was kept."""
    request_id: int
    klass: str                      # one of REQUEST_CLASSES ("class" in the record)
    first_bad_page: int | None      # logical index of the first invalid page, None if all valid
    kv_kept: int                    # KV tokens kept from the dead executor
    tokens_recomputed: int          # KV tokens it had committed that are computed again

    def to_dict(self) -> dict:
        return {"request_id": self.request_id, "class": self.klass, "first_bad_page": self.first_bad_page,
                "kv_kept": self.kv_kept, "tokens_recomputed": self.tokens_recomputed}


@nested
class RecoveryReport:
    detect_ns: int = 0                      # the sidecar saw the executor die (from `Promote`)
    promoted_ns: int = 0                    # the takeover began
    validated_ns: int = 0                   # pages validated, requests classified
    cleared_ns: int | None = None           # pages no request keeps released or quarantined
    tails_ns: int | None = None             # partially filled tail pages placed
    resumed_ns: int = 0                     # every request scheduled again (or finished)
    pages_checked: int = 0
    pages_bad: int = 0
    pages_interrupted: int | None = None    # records left mid-update (odd version), repaired
    pages_copied: int | None = None         # tails copied away from a writer not yet reaped
    tails_dropped: int | None = None        # tails recomputed instead (no free page to copy into)
    prompts_realigned: int | None = None    # prompts whose last chunk is recomputed whole
    pages_quarantined: int = 0              # held until their writer's exit is confirmed
    requests_finished: int | None = None    # already finished: nothing to do
    requests_resumable: int = 0
    requests_damaged: int = 0
    requests_lost: int = 0
    tokens_recomputed: int = 0
    tokens_kept: int = 0
    requests: list[RequestRecovery] = dataclasses.field(default_factory=list)   # the first few
    kv_mode: str | None = None              # None: native (the engine computes in kvhold's pages)
    fenced_epoch: int = 0

    @property
    def requests_waiting(self) -> int:
        """Requests that continue, and so await their first resumed token."""
        return self.requests_resumable + self.requests_damaged + self.requests_lost

    def to_dict(self) -> dict:
        """The record: every measured figure, per-request rows as maps."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = [r.to_dict() for r in value] if f.name == "requests" else value
        return out
