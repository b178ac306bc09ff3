"""Executor deaths counted per request: a request that kills every executor that runs it (a
"query of death") is failed at its third death instead of being retried for ever.

Before each step the active executor names the step's requests in the journal (their
`step_epoch` and `step_seq`, and the KV positions the step computes, `step_start` to
`step_end`) and then opens the step in its lease (`open_step`; kvhold.executor.engine). When
the supervisor fences an active executor that died or hung, `executor_died` reads which
requests were in the open step. The counts live here, in the sidecar, which outlives every
executor.

One death cannot tell the culprit from the requests batched with it, so every request in the
dead step becomes a suspect with its KV end: the next active executor is promoted with
`isolate()` and runs each suspect's step that reaches that position again with no other
request in it. At a later death with a suspect in the step:
* the step reached its recorded position from before it: it was that isolated re-run, so the
  request died again alone at the same place: one more death; at MAX_DEATHS it is failed;
* the step started at or past that position: the request had already run it alone and
  survived, so the earlier death was not its doing: it is a suspect anew, one death;
* the step ended before it (recomputation of KV that had been committed, batched with
  others): it proves nothing, and the count stays.
Why three and not two: a kill from outside (an operator, an orchestrator, the OOM killer
reclaiming memory elsewhere, a supervisor killing a successor mid-takeover) lands on the
isolated re-run whenever it comes soon after the first death, since that re-run is the first
step the successor takes; with two deaths such a pair fails a healthy request (a soak of
SIGKILLs that kills successors during their takeover failed 8 of 60 requests so). A request
that really crashes the engine dies in every isolated re-run at the same position, so the
third death costs it one more executor restart, and a second re-run that also dies alone
at the same place is no longer a coincidence of timing.
A failed request's stream gets an error naming the cause, its journal entry is cancelled so
that the next executor finishes it without running it, and the others continue unchanged.
What this costs: after a death, one step alone for each request that was in the dead step.
The TensorRT-LLM bridge names no steps, so its deaths count against no request.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import AdmitState
from kvhold.protocol.leases import LeaseTable
from kvhold.protocol.tables import Tables

log = logging.getLogger(__name__)
MAX_DEATHS = 3       # executor deaths with the same request in the step, at the same position


@dataclass(slots=True)
class Suspect:
    slot: int            # its journal slot
    deaths: int
    end: int             # the KV position the step it last died in computed up to (exclusive)


class RequestDeaths:
    def __init__(self, tables: Tables, fail: Callable[[int, int, str], None]):
        """`fail(request_id, journal slot, message)` ends a request with an error to its client."""
        self.journal = Journal(tables)
        self.leases = LeaseTable(tables)
        self.fail = fail
        self.suspects: dict[int, Suspect] = {}      # by request id
        self.num_failed = 0

    def executor_died(self, slot: int, epoch: int) -> list[int]:
        """The active executor of lease `slot` under `epoch` died (or hung): count a death for
        each request in the step it had open. Returns the request ids it failed."""
        step = self.leases.open_step(slot)
        if not step:
            return []           # it died between steps: no request was running
        failed = []
        for jslot, rid, start, end in self.journal.in_step(epoch, step):
            s = self.suspects.get(rid)
            if s is not None and end < s.end:
                continue                         # a batched step before its isolated one
            if s is None or start >= s.end:      # new, or it had run past its last death alone
                s = self.suspects[rid] = Suspect(slot=jslot, deaths=0, end=end)
            s.deaths += 1
            s.end = end
            log.warning("request %#x was in the step of a dead executor (epoch %d, step %d, KV up to "
                        "%d): death %d of %d", rid, epoch, step, end, s.deaths, MAX_DEATHS)
            if s.deaths >= MAX_DEATHS:
                del self.suspects[rid]
                self.num_failed += 1
                failed.append(rid)
                self.fail(rid, jslot, f"request {rid:#x} failed: the executor died {s.deaths} times while "
                          f"running it, the last {s.deaths - 1} times with no other request in its step (at KV position "
                          f"{end}); it crashes the engine and is not retried (check its prompt and "
                          f"parameters, or the model's tokenizer and vocabulary)")
        return failed

    def isolate(self) -> list[list[int]]:
        """[request id, KV end] of every live suspect, for the next promotion."""
        self._forget_released()
        return [[rid, s.end] for rid, s in self.suspects.items()]

    def _forget_released(self) -> None:
        """Suspects whose journal slot no longer holds them have finished: forget them."""
        for rid in [r for r, s in self.suspects.items() if not self._live(r, s.slot)]:
            del self.suspects[rid]

    def _live(self, request_id: int, slot: int) -> bool:
        e = self.journal.entry(slot)
        return e.request_id == request_id and e.admit_state != AdmitState.FREE and e.taken

    def status(self) -> dict:
        self._forget_released()
        return {"suspects": len(self.suspects), "failed_total": self.num_failed}
