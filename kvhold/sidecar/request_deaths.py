"""Executor deaths counted per request: a request that kills every executor that runs it (a
"query of death") is failed at its second death instead of being retried for ever.

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
Only deaths the executor could have caused count. A hang (the lease ran out) and a CUDA
fault count at once. A death (the liveness mutex or the process's exit) is settled once its
exit status is known (`exit_known`): usually as it is detected, before the successor is
promoted (the kernel sets the exit status before it releases the dying process's robust
futexes, and /proc shows it), else from the supervisor's reap or, for an executor forked by
the zygote, from /proc while it is a zombie: a crash (a signal such as SIGSEGV or SIGABRT,
a non-zero exit) counts; a kill from outside (SIGKILL, SIGTERM: an operator, an orchestrator,
a supervisor killing a successor mid-takeover) does not, unless the kernel's OOM killer sent
it (the cgroup's memory.events `oom_kill` count rose), and the death is taken back. An
unknown status counts. Without this, an outside kill timed onto the successor's first step,
which is the isolated re-run, fails a healthy request: a soak of 1,000 SIGKILLs, some of them
of successors during their takeover, failed 8 of the first 60 requests so.
Forgiving outside kills has one blind spot: where the cgroup's OOM count cannot be read (cgroup
v1, or no memory.events: `oom_kills()` is None) a request that makes the kernel OOM-kill every
executor that runs it looks like a series of outside kills, and was retried for ever, the
requests batched with it stalled in the same dead step. So deaths of any kind are counted too:
a request in the step of MAX_KILLS deaths in a row with no progress between them (each step
started before the KV end of the one before: it never got past the place it died) has its
death at the MAX_KILLS-th kept whatever its exit status and the cgroup say, so it is isolated,
and its death alone at that place again fails it. A step that starts at or past that end (it
ran past it) starts a new count. Random outside kills do not add up so: a supervisor killing a
successor mid-takeover lands on the same place twice at most, and after that the requests move
on. These counts are kept in memory only.
A failed request's stream gets an error naming the cause, its journal entry is cancelled so
that the next executor finishes it without running it, and the others continue unchanged.
What this costs: after a crash, one step alone for each request that was in the dead step
(about 6 ms each for Llama-3-8B on an H200); an outside kill known as it is detected costs
none.
The TensorRT-LLM bridge names no steps, so its deaths count against no request.
The counts outlive the sidecar: with `store` (a file beside the durable journal) every change is
written there (a temporary file renamed over it; no fsync: a process kill loses nothing, a machine
crash may), and a starting sidecar reads it back, each suspect found again by its request id in
the journal (an adopted pool, or one restored from the durable journal) at the next promotion.
A damaged store (`DeathCounts` checks every field) is set aside as `request_deaths.json.bad`
(kvhold.protocol.state_files) and the counts start from zero.
Without it a sidecar restarted between a death and the isolated re-run forgot the suspect: the
request ran batched again and killed one more executor, with others in its step.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvhold.protocol.journal import Journal
from kvhold.protocol.leases import LeaseTable
from kvhold.protocol.state_files import StateFileError, integer, set_aside
from kvhold.protocol.tables import Tables

log = logging.getLogger(__name__)
MAX_DEATHS = 2       # executor deaths with the same request in the step, at the same position
MAX_KILLS = 4        # deaths of any kind in a row, without progress, before an outside kill counts
OUTSIDE_KILLS = (128 + 9, 128 + 15)   # exit codes of SIGKILL and SIGTERM (128 + signal)
LOGGED_IDS = 8       # request ids a death's log line names


@dataclass(frozen=True, slots=True)
class DeathCounts:
    """The counts as kept in the store (`request_deaths.json`), each field checked when read back
    (kvhold.protocol.state_files): {"suspects": [[request id, deaths, KV end], ...],
    "failed_total": n, "forgiven_total": n}."""
    suspects: tuple[tuple[int, int, int], ...] = ()
    failed_total: int = 0
    forgiven_total: int = 0

    def to_doc(self) -> dict:
        return {"suspects": [list(s) for s in self.suspects], "failed_total": self.failed_total,
                "forgiven_total": self.forgiven_total}

    @classmethod
    def from_json(cls, data: bytes | str) -> "DeathCounts":
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError) as exc:      # JSONDecodeError, UnicodeDecodeError
            raise StateFileError(f"not JSON ({type(exc).__name__})") from None
        if not isinstance(doc, dict):
            raise StateFileError(f"not a map of counts ({type(doc).__name__})")
        unknown = set(doc) - {"suspects", "failed_total", "forgiven_total"}
        if unknown:
            raise StateFileError(f"unknown field {sorted(map(str, unknown))[0][:40]!r}")
        rows = doc.get("suspects", [])
        if not isinstance(rows, list):
            raise StateFileError("suspects is not a list")
        suspects = []
        for row in rows:
            if not isinstance(row, list) or len(row) != 3:
                raise StateFileError("a suspect is not [request id, deaths, KV end]")
            suspects.append((integer(row[0], "request id", 1, (1 << 64) - 1),
                             integer(row[1], "deaths", 1, (1 << 31) - 1),
                             integer(row[2], "KV end", 0, (1 << 31) - 1)))
        if len({rid for rid, _, _ in suspects}) != len(suspects):
            raise StateFileError("a request is listed twice")
        return cls(tuple(suspects), integer(doc.get("failed_total", 0), "failed_total", 0, (1 << 63) - 1),
                   integer(doc.get("forgiven_total", 0), "forgiven_total", 0, (1 << 63) - 1))


@dataclass(slots=True)
class Suspect:
    slot: int            # its journal slot (-1: read back from the store, not yet found in the journal)
    deaths: int
    end: int             # the KV position the step it last died in computed up to (exclusive)
    read_back: bool = False   # counted by a previous sidecar (the store)


@dataclass(slots=True)
class Streak:
    """Deaths of any kind (outside kills included) with a request in the step, in a row, each
    step starting before the KV end of the one before (no progress between them)."""
    slot: int
    deaths: int
    end: int             # the furthest KV end of those steps (exclusive)

    def count(self, start: int, end: int) -> None:
        if start >= self.end:                # it ran past the place it died: a new count
            self.deaths = 0
        self.deaths += 1
        self.end = max(self.end, end)


class RequestDeaths:
    def __init__(self, tables: Tables, fail: Callable[[int, int, str], None], store: Path | None = None):
        """`fail(request_id, journal slot, message)` ends a request with an error to its client;
        `store`: the file the counts are kept in across restarts (None: memory only)."""
        self.journal = Journal(tables)
        self.leases = LeaseTable(tables)
        self.fail = fail
        self.suspects: dict[int, Suspect] = {}      # by request id
        self.streaks: dict[int, Streak] = {}        # by request id: deaths of any kind in a row
        self.num_failed = 0
        self.num_forgiven = 0                       # deaths taken back: the executor was killed from outside
        self._unsettled: dict[int, list[tuple[int, int, int]]] = {}   # epoch -> counted deaths
        self._oom_kills = oom_kills()
        self.store = Path(store) if store is not None else None
        self._saved: dict | None = None
        self._held = 0                              # saves_after() blocks open
        self._load()

    def _load(self) -> None:
        if self.store is None:
            return
        try:
            counts = DeathCounts.from_json(self.store.read_bytes())
        except FileNotFoundError:
            return
        except (OSError, StateFileError) as exc:
            set_aside(self.store, str(exc), "the request death counts file")
            log.error("request death counts not read back: counting from zero")
            return
        for rid, deaths, end in counts.suspects:
            self.suspects[rid] = Suspect(slot=-1, deaths=deaths, end=end, read_back=True)
        self.num_failed, self.num_forgiven = counts.failed_total, counts.forgiven_total
        if self.suspects:
            log.warning("read back the death counts of %d requests that were in the step of a dead "
                        "executor", len(self.suspects))

    @contextlib.contextmanager
    def saves_after(self):
        """Write the store once, when the block ends: the supervisor counts a death and promotes the
        successor inside one, so the file's write does not delay the promotion."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            if not self._held:
                self._save()

    def _save(self) -> None:
        if self.store is None or self._held:
            return
        doc = DeathCounts(suspects=tuple((rid, s.deaths, s.end) for rid, s in self.suspects.items()),
                          failed_total=self.num_failed, forgiven_total=self.num_forgiven).to_doc()
        if doc == self._saved:
            return
        tmp = self.store.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self.store)
            self._saved = doc
        except OSError as exc:
            log.error("could not keep the request death counts in %s: %s", self.store, exc)

    def executor_died(self, slot: int, epoch: int, cause_known: bool = False) -> list[int]:
        """The active executor of lease `slot` under `epoch` died (or hung): count a death for
        each request in the step it had open. `cause_known` (a hang, a CUDA fault): the death
        is the step's doing, settled now; otherwise `exit_known` settles it. Returns the
        request ids it failed."""
        step = self.leases.open_step(slot)
        if not step:
            return []           # it died between steps: no request was running
        counted = []
        in_step = self.journal.in_step(epoch, step)
        self._forget_streaks({rid for _, rid, _, _ in in_step})
        for jslot, rid, start, end in in_step:
            k = self.streaks.get(rid)
            if k is None:
                k = self.streaks[rid] = Streak(slot=jslot, deaths=0, end=end)
            k.slot = jslot
            k.count(start, end)
            s = self.suspects.get(rid)
            if s is not None and end < s.end:
                continue                         # a batched step before its isolated one
            if s is None or start >= s.end:      # new, or it had run past its last death alone
                s = self.suspects[rid] = Suspect(slot=jslot, deaths=0, end=end)
            s.slot = jslot
            s.deaths += 1
            s.end = end
            if s.deaths >= MAX_DEATHS:
                log.warning("request %#x was in the step of a dead executor (epoch %d, step %d, KV up "
                            "to %d): death %d of %d", rid, epoch, step, end, s.deaths, MAX_DEATHS)
            counted.append((rid, jslot, end))
        if counted:    # one line: this runs between the fence and the promotion
            shown = ", ".join(f"{rid:#x}" for rid, _, _ in counted[:LOGGED_IDS])
            more = f" and {len(counted) - LOGGED_IDS} more" if len(counted) > LOGGED_IDS else ""
            log.warning("%d requests were in the step of a dead executor (epoch %d, step %d): %s%s",
                        len(counted), epoch, step, shown, more)
        if cause_known:
            return self._settle(counted)
        self._unsettled[epoch] = counted
        if len(self._unsettled) > 64:              # an exit never seen (a process not ours): settled as a crash
            self._settle(self._unsettled.pop(next(iter(self._unsettled))), -1)
        self._save()
        return []

    def exit_known(self, epoch: int, exit_code: int) -> list[int]:
        """The executor of `epoch` exited with `exit_code` (128 + N: signal N; -1: unknown).
        Its deaths counted by `executor_died` stand, or are taken back if it was killed from
        outside and not by the OOM killer. Returns the request ids it failed."""
        counted = self._unsettled.pop(epoch, None)
        if not counted:
            return []
        oom = oom_kills()
        killed_by_oom = oom is not None and self._oom_kills is not None and oom > self._oom_kills
        self._oom_kills = oom
        if exit_code in OUTSIDE_KILLS and not killed_by_oom:
            kept = [c for c in counted if self._streak(c[0]) >= MAX_KILLS]
            for rid, _, _ in counted:
                s = self.suspects.get(rid)
                if s is not None and self._streak(rid) < MAX_KILLS:
                    s.deaths -= 1
                    if s.deaths <= 0:
                        del self.suspects[rid]      # nothing to isolate: the kill was not its doing
            if len(kept) < len(counted):
                self.num_forgiven += 1
                log.info("executor of epoch %d was killed from outside (exit code %d): its death counts "
                         "against %d of the %d requests in its step", epoch, exit_code, len(kept),
                         len(counted))
            if kept:
                log.warning("executor of epoch %d was killed (exit code %d) with %d requests in its step "
                            "that were in the step of %d or more deaths in a row without progress: "
                            "counted", epoch, exit_code, len(kept), MAX_KILLS)
                return self._settle(kept, exit_code)
            self._save()
            return []
        return self._settle(counted, exit_code)

    def _streak(self, request_id: int) -> int:
        k = self.streaks.get(request_id)
        return k.deaths if k is not None else 0

    def _forget_streaks(self, keep: set[int]) -> None:
        """Streaks of requests that no longer hold their journal slot have ended with them."""
        rids = [rid for rid in self.streaks if rid not in keep]
        if not rids:
            return
        held = self.journal.holds([self.streaks[rid].slot for rid in rids], rids)
        for rid, still in zip(rids, held.tolist()):
            if not still:
                del self.streaks[rid]

    def _settle(self, counted, exit_code: int | None = None) -> list[int]:
        failed = []
        for rid, jslot, end in counted:
            s = self.suspects.get(rid)
            if s is None or s.deaths < MAX_DEATHS:
                continue
            reason = self._reason(rid, s, end, exit_code)
            del self.suspects[rid]
            self.streaks.pop(rid, None)
            self.num_failed += 1
            failed.append(rid)
            self.fail(rid, jslot, reason)
        self._save()
        return failed

    def _reason(self, rid: int, s: Suspect, end: int, exit_code: int | None) -> str:
        streak = self._streak(rid)
        if exit_code in OUTSIDE_KILLS:
            name = "SIGKILL" if exit_code == 128 + 9 else "SIGTERM"
            return (f"request {rid:#x} failed: the executor died {max(streak, s.deaths)} times in a row "
                    f"while running it, with no progress between, the last time with no other request "
                    f"in its step (at KV position {end}), killed by {name}: an OOM kill where the "
                    f"cgroup's OOM count cannot be read looks the same; it is not retried (check the "
                    f"memory it needs: its prompt and parameters, the executor's memory limit)")
        return (f"request {rid:#x} failed: the executor died {s.deaths} times while running "
                f"it, the last time with no other request in its step (at KV position "
                f"{end}); it crashes the engine and is not retried (check its prompt and "
                f"parameters, or the model's tokenizer and vocabulary)")

    def isolate(self) -> list[list[int]]:
        """[request id, KV end] of every live suspect, for the next promotion."""
        self._forget_released()
        return [[rid, s.end] for rid, s in self.suspects.items()]

    def _forget_released(self) -> None:
        """Suspects whose journal slot no longer holds them have finished: forget them."""
        if not self.suspects:
            return
        if any(s.slot < 0 for s in self.suspects.values()):   # read back: found again by request id
            by_rid = self.journal.live_request_ids()
            for rid, s in self.suspects.items():
                if s.slot < 0:
                    s.slot = by_rid.get(rid, -1)
        rids = list(self.suspects)
        suspects = [self.suspects[rid] for rid in rids]
        # taken by an executor, but for one restored from the durable journal: not taken yet
        held = self.journal.holds([max(s.slot, 0) for s in suspects], rids,
                                  taken=[not s.read_back for s in suspects]).tolist()
        gone = [rid for rid, s, h in zip(rids, suspects, held) if s.slot < 0 or not h]
        for rid in gone:
            del self.suspects[rid]
        if gone:
            self._save()

    def status(self) -> dict:
        self._forget_released()
        return {"suspects": len(self.suspects), "failed_total": self.num_failed,
                "forgiven_total": self.num_forgiven}


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed in this cgroup (v2), None if unknown."""
    try:
        for line in open("/proc/self/cgroup"):
            if line.startswith("0::"):
                path = "/sys/fs/cgroup" + line[3:].strip().rstrip("/")
                for entry in open(path + "/memory.events"):
                    key, _, value = entry.partition(" ")
                    if key == "oom_kill":
                        return int(value)
    except (OSError, ValueError):
        return None
    return None
