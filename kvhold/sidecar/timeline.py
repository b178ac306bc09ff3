"""The recovery timeline: one record per failover, the one place its marks are stitched.

A failover's marks come from three places, and each reports here:
* the promoted executor's `RecoveryReport` (`recovered`): the executor's own
  marks from the kill's detection to the resumption (detect_ns, promoted_ns,
  validated_ns, resumed_ns, ...) and its counts per recovery class; a report with
  no `fenced_epoch` is a first activation, not a failover, and makes no record;
* the sidecar's receipt of that report (`received_ns`, with the executor's pid and
  epoch);
* the first `StepDone` of that executor after a failover that left requests to
  continue (`step_done`): the step's own `*_ns` marks, `step_received_ns` and
  `first_token_ns` (when the first resumed token was committed and streamed).
  `first_token_ns` is absent from a record until then: readers (kvhold top,
  metrics, tools/bench_recovery.py) take its absence as "still waiting".
The supervisor's marks (detection and fencing in its `fence` event, the promotion,
the dead process's confirmed exit in its `exit` event) arrive through `event`, the
sink of every executor lifecycle event; their fenced epoch ties them to the
record. `records()` is what `kvhold status --json` shows as `recoveries`,
`events()` what it shows as `events`; both keep their keys as reported.
"""
from __future__ import annotations

import collections
import logging
from collections.abc import Mapping

from kvhold.protocol.leases import now_ns
from kvhold.protocol.recovery_report import RecoveryReport

log = logging.getLogger(__name__)
KEPT = 64          # records kept
SHOWN = 16         # records in the status
EVENTS_KEPT = 512
EVENTS_SHOWN = 64


class RecoveryTimeline:
    def __init__(self):
        self._records: collections.deque = collections.deque(maxlen=KEPT)
        self._awaiting_first_token: dict[int, dict] = {}    # executor epoch -> its record
        self._events: collections.deque = collections.deque(maxlen=EVENTS_KEPT)
        self._detected: dict[int, int] = {}    # fenced epoch -> detect ns, until its exit
        self.num_recovered = 0                 # takeovers reported, in all

    def event(self, ev: dict) -> None:
        """An executor lifecycle event from the supervisor (kind, ns, slot, pid, epoch, ...)."""
        self._events.append(ev)
        if ev["kind"] == "fence":
            self._detected[ev["fenced_epoch"]] = ev["detect_ns"]
            if len(self._detected) > KEPT:     # a fenced process that never exits (not ours to kill)
                self._detected.pop(next(iter(self._detected)))
        elif ev["kind"] == "exit" and ev.get("epoch") in self._detected:
            log.info("executor pid %d (epoch %d) exit confirmed %.1f ms after detection", ev["pid"],
                     ev["epoch"], (ev["ns"] - self._detected.pop(ev["epoch"])) / 1e6)

    def events(self) -> list[dict]:
        return list(self._events)[-EVENTS_SHOWN:]

    def recovered(self, pid: int, epoch: int, report: RecoveryReport) -> None:
        """The executor of `epoch` finished its takeover and sent `report`."""
        if not report.fenced_epoch:
            return  # a first activation, not a failover: nothing was recovered
        fields = report.to_dict()
        rec = dict(fields, pid=pid, epoch=epoch, received_ns=now_ns())
        self._records.append(rec)
        self.num_recovered += 1
        if report.requests_waiting:
            self._awaiting_first_token[epoch] = rec
        log.info("executor pid %d took over: %s", pid, ", ".join(
            f"{k}={v}" for k, v in fields.items() if not k.endswith("_ns") and k != "requests"))

    def step_done(self, epoch: int, marks: Mapping, received_ns: int) -> None:
        """A step of the executor of `epoch` was committed and its tokens streamed."""
        rec = self._awaiting_first_token.pop(epoch, None)
        if rec is None:
            return
        rec.update({k: v for k, v in marks.items() if k.endswith("_ns") and isinstance(v, int)})
        rec["step_received_ns"] = received_ns
        rec["first_token_ns"] = now_ns()
        log.info("recovery complete: first resumed token %.1f ms after detection",
                 (rec["first_token_ns"] - rec.get("detect_ns", rec["first_token_ns"])) / 1e6)

    def records(self) -> list[dict]:
        return list(self._records)[-SHOWN:]
