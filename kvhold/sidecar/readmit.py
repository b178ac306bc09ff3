"""Pool restart, the memory owner's half: the durable journal's requests re-admitted into a fresh
shm journal before any executor exists.

Every record of the durable journal (kvhold.sidecar.durable_journal) is re-admitted with its
committed tokens as a prefix (kvhold.protocol.journal.restore_progress). The first active
executor's takeover finds these requests taken with no KV pages and recomputes their KV by
prefill over prompt + committed tokens; the next token is then sampled at the same position with
the same seed, and draws depend only on (seed, position) (kvhold.executor.sampler), so the
continuation equals an uninterrupted run. Their streams are the frontend's
(kvhold.frontend.restore): in its process, or in the sidecar's with the frontend in process.

A record that cannot be re-admitted (damaged, a field of the wrong type or out of range, model
changed, no longer fits, or any error while re-admitting it) is reported failed: in `failed`
(the status's `pool_restart.failed`, with the reason), in the log, and kept under failed/ on
disk. Nothing is dropped silently, and no record can stop a start: the others are re-admitted
and the sidecar comes up.
"""
from __future__ import annotations

import logging
from typing import Callable

from kvhold.protocol.journal import Journal
from kvhold.protocol.leases import now_ns
from kvhold.sidecar.durable_journal import FailedRecord, record_sampling
from kvhold.sidecar.pool_restart import check_drain_record

log = logging.getLogger(__name__)


class Readmission:
    """`journal`: the new pool's shm journal; `durable`: the durable journal; `fingerprint`,
    `vocab_size`, `generation`: the new pool's weights fingerprint, vocabulary and generation;
    `started_ns`: when the sidecar started."""

    def __init__(self, journal: Journal, durable, *, fingerprint: str, vocab_size: int, generation: int,
                 started_ns: int):
        self.journal = journal
        self.durable = durable
        self.fingerprint = fingerprint
        self.vocab_size = vocab_size
        self.generation = generation
        self.started_ns = started_ns
        self.failed: dict[int, FailedRecord] = {}
        self.report: dict = {}
        self._admitted: set[int] = set()

    def load(self) -> list[dict]:
        """The durable journal's records; those it could not read are counted failed."""
        records, failed = self.durable.load()
        self.failed.update((f.request_id, f) for f in failed)
        return records

    def readmit(self, records: list[dict], *, adopting: bool = False, readmit: bool = True,
                admitted: Callable[[dict, int], None] | None = None, adopted: int = 0,
                known: Callable[[int], bool] = lambda rid: False) -> int:
        """Re-admit `records` (what `load` gave, less those adopted with their pool: `adopted`
        of them); how many were. `admitted(body, slot)`: each one's stream (the frontend's); if it
        raises, its slot is released and the record failed. `known(request id)`: a request that
        is in the pool already. `adopting`: the shm journal is a dead sidecar's, adopted with its
        executors. `readmit` False (a frontend process starting over a running pool): none is
        re-admitted, since executors already run; each is reported failed with the reason."""
        t0 = now_ns()
        restored = 0
        for body in records:
            try:
                reason = self._admit(body, adopting, known, admitted) if readmit else (
                    "it was not in the pool's journal when the frontend started (its admission was "
                    "never acknowledged, or it had ended)")
            except Exception as exc:  # noqa: BLE001 - one request must never stop a start
                log.exception("restoring journaled request %#x failed", body["request_id"])
                reason = f"restoring it failed: {type(exc).__name__}: {exc}"
            if reason is None:
                restored += 1
            else:
                path = self.durable.path_for(body["request_id"])
                self.failed[body["request_id"]] = self.durable.fail(path, body["request_id"], reason)
        self.durable.restored()
        if not records and not self.failed and not adopted:
            return 0
        self.report = {"sidecar_started_ns": self.started_ns, "start_ns": t0, "restored_ns": now_ns(),
                       "requests_restored": restored, "requests_adopted": adopted,
                       "requests_failed": len(self.failed), "first_token_ns": 0,
                       "previous_drain": self.durable.read_json("last-drain.json", check_drain_record)}
        log.warning("pool generation %d: restored %d journaled requests (%d failed) from %s",
                    self.generation, restored, len(self.failed), self.durable.dir)
        return restored

    def restore(self) -> None:
        """The owner's restore into a fresh pool whose streams a frontend process adopts."""
        self.readmit(self.load())

    def _admit(self, body: dict, adopting: bool, known, admitted) -> str | None:
        """Re-admit one record; the reason it cannot be, or None."""
        journal, geometry = self.journal, self.journal.tables.geometry
        fingerprint = self.fingerprint
        if body.get("fingerprint", "") != fingerprint:
            return (f"the model changed across the restart (weights fingerprint "
                    f"{str(body.get('fingerprint'))[:12]} -> {fingerprint[:12]})")
        prompt, generated = body["prompt_ids"], body["generated"]
        sampling = record_sampling(body)
        vocab = self.vocab_size
        if any(t >= vocab for t in prompt + generated + list(sampling.stop_token_ids)):
            return f"a token id is outside the vocabulary (size {vocab})"
        need = len(prompt) + max(sampling.max_tokens, len(generated))
        if need > geometry.max_seq_len:
            return f"needs {need} tokens, the context is now {geometry.max_seq_len}"
        rid = int(body["request_id"])
        # ids of this pool's generation are new requests' ids, but for an adopted pool's own
        if rid >> 40 > self.generation or (rid >> 40 == self.generation and not adopting):
            return (f"its request id is of pool generation {rid >> 40}, not of one before this "
                    f"pool's generation {self.generation}")
        if known(rid) or rid in self._admitted:
            return f"request {rid:#x} is already restored"
        slot = journal.free_slot()
        if slot is None:
            return f"no free request slot (--max-requests {geometry.num_slots})"
        journal.admit(slot, rid, prompt, sampling)
        try:
            journal.restore_progress(slot, rid, generated)
            if body.get("cancelled"):
                journal.cancel(slot)
            if admitted is not None:
                admitted(body, slot)
        except Exception:                 # not restored: its slot goes
            journal.release(slot)
            raise
        self._admitted.add(rid)
        return None
