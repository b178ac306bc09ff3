"""Restored and held streams: what a frontend gives back to clients that come back.

A pool restart re-admits the durable journal's requests (the owner's half,
kvhold.sidecar.readmit); a restarted frontend, or a sidecar that re-adopted a dead one's pool,
adopts the requests of the shm journal. Either way the new process cannot know how far each
client got, and a ROUTER drops what it sends to a client that has not reconnected yet. So a
restored stream sends nothing until its owner speaks: the SDK, as soon as its socket has
connected to the new sidecar (or after a silence), sends `Resume(request_ids, next_indices)`,
and the frontend re-sends from each index (tokens it has, then the rest as they are
committed). The client skips nothing and receives nothing twice.
Only the client key recorded at admission (transport, authenticated principal and
routing id: kvhold.frontend.client_peers) may resume. A live stream whose owner is not
connected as itself when a message is due is held the same way until its owner resumes.
* A stream held for its owner (restored, or live with its owner not connected as itself)
  for longer than `unclaimed_cancel_s` (`--unclaimed-cancel-s`, default
  UNCLAIMED_CANCEL_S; 0: never) is cancelled: its journal entry is cancelled (the executor
  frees its KV), its durable record removed, the cancellation logged and counted in the
  status (`pool_restart.unclaimed_cancelled_total`), and an owner that resumes it later
  gets a `NotFound` naming why. Requests nobody claims are not run for nobody.
* A restored or held request that ends before its owner comes back (within that time)
  has its result kept for pickup by a later `Resume` for UNCLAIMED_KEEP_S (at most UNCLAIMED_MAX
  results, the oldest dropped first), counted and listed (the newest UNCLAIMED_LISTED) in
  the status (`pool_restart.unclaimed`, `unclaimed_total`) and logged, then dropped with a
  log line.
* A record that could not be restored (kvhold.sidecar.readmit) is named, with the reason, as a
  `NotFound` error to a client that resumes it.
`Restore` gets the frontend (whose journal and streams it fills), the durable
journal, the new pool's weights fingerprint, vocabulary size and generation, when
the sidecar started, and a `send_client` callable.
"""
from __future__ import annotations

import logging
from itertools import islice
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvhold.protocol import messages as m
from kvhold.protocol.errors import ErrorCode
from kvhold.protocol.leases import now_ns
from kvhold.frontend import logprob_stream
from kvhold.frontend.detokenizer import IncrementalDetokenizer
from kvhold.frontend.kept_results import KeptResults
from kvhold.sidecar.readmit import Readmission

log = logging.getLogger(__name__)
UNCLAIMED_CANCEL_S = 30.0   # a stream held this long for an owner who is not connected is cancelled
UNCLAIMED_CHECK_NS = 100_000_000   # how often held streams are looked at
UNCLAIMED_KEEP_S = 600.0
UNCLAIMED_MAX = 4096        # results kept at most: past it the oldest is dropped (and logged)
UNCLAIMED_LISTED = 64       # the newest so many are listed in the status, all are counted


@dataclass(slots=True)
class Unclaimed:
    identity: bytes
    ids: list[int]
    texts: list[str]
    done: m.Done
    finished_ns: int
    logprobs: dict          # their log-probs, if asked for (kvhold.frontend.logprob_stream)


class Restore:
    def __init__(self, frontend, durable, *, fingerprint: str, vocab_size: int, generation: int,
                 started_ns: int, send_client: Callable[[bytes, object], bool],
                 unclaimed_cancel_s: float = UNCLAIMED_CANCEL_S):
        if not 0 <= unclaimed_cancel_s < float("inf"):
            raise ValueError(f"unclaimed_cancel_s must be >= 0 seconds (0: never), got {unclaimed_cancel_s}")
        self.frontend = frontend
        self.durable = durable
        self.generation = generation
        self.send_client = send_client
        # the owner's half, into the journal the frontend writes admissions to
        self.readmission = Readmission(getattr(frontend, "journal", None), durable, fingerprint=fingerprint,
                                       vocab_size=vocab_size, generation=generation, started_ns=started_ns)
        self.failed = self.readmission.failed          # request id -> FailedRecord
        self.unclaimed: dict[int, Unclaimed] = {}
        self.cancel_after_ns = int(unclaimed_cancel_s * 1e9)
        self._away: dict[int, int] = {}          # held stream -> since when (ns) it is held
        self.cancelled: dict[int, str] = {}      # cancelled for want of a client -> why (the newest)
        self.num_cancelled = 0
        self._next_check_ns = 0
        # failed (request_deaths) while its stream waited for its client: told when it resumes,
        # even once its slot is released and its stream gone -> (its client's identity, why)
        self.failed_requests: dict[int, tuple[bytes, str]] = {}
        directory = getattr(durable, "dir", None)      # results kept on disk: they outlive this process
        self.kept = KeptResults(Path(directory) / "results") if directory is not None else None

    # ------------------------------------------------------------------ start-up
    @property
    def report(self) -> dict:
        return self.readmission.report

    # ------------------------------------------------------------------ start-up
    def restore(self, adopting: bool = False, readmit: bool = True) -> None:
        """`adopting`: the shm journal is a dead sidecar's, adopted with its executors
        (kvhold.sidecar.adoption): the requests in it keep running and get their streams back
        (`_adopt_streams`); only records not in it (ended but not yet removed, or on disk but
        not yet admitted) are re-admitted (kvhold.sidecar.readmit). `readmit` False (a frontend
        process starting over a running pool, kvhold.frontend.process): those are not re-admitted
        either, since executors already run; each is reported failed with the reason."""
        self._load_kept()
        records = self.readmission.load()
        adopted = 0
        if adopting:
            records, adopted = self._adopt_streams(records)
        self.readmission.readmit(records, adopting=adopting, readmit=readmit, admitted=self._stream_for,
                                 adopted=adopted, known=lambda rid: rid in self.frontend.streams)

    def _stream_for(self, body: dict, slot: int) -> None:
        """A silent stream for a re-admitted request, its committed tokens' text ready."""
        fe = self.frontend
        rid, prompt, generated = int(body["request_id"]), body["prompt_ids"], body["generated"]
        try:
            detok = IncrementalDetokenizer(fe.tokenizer, prompt) if fe.tokenizer else None
            texts = [detok.push(t) for t in generated] if detok else [""] * len(generated)
            fe.restore_stream(rid, slot, bytes.fromhex(body["client"]), len(prompt), detok,
                              texts, dict(body, generated=[]), rerun=True)
        except Exception:                 # not restored: its stream goes (the readmission its slot)
            fe.streams.pop(rid, None)
            fe.records.pop(rid, None)
            raise

    def _adopt_streams(self, records: list[dict]) -> tuple[list[dict], int]:
        """Streams for the requests of the adopted shm journal, silent until their clients
        resume (like restored ones: the new sidecar cannot know how far each client got), each
        with the tokens the journal holds; the records of other requests, and how many were
        adopted. A live request with no record (one failed alone, finishing) is cancelled and
        only released once its executor ends it."""
        fe = self.frontend
        by_id = {int(b["request_id"]): b for b in records}
        adopted = 0
        for slot in fe.journal.live_slots():
            slot = int(slot)
            e = fe.journal.entry(slot)
            body = by_id.pop(e.request_id, None)
            if body is None:
                fe.fail_request(e.request_id, slot, f"request {e.request_id:#x} has no durable record "
                                                    "in the adopted pool: cancelled")
                continue
            count = e.num_generated if e.taken else e.num_prefix
            generated = fe.journal.generated(slot, 0, count)
            prompt = fe.journal.all_tokens(slot, e.prompt_len).tolist()
            detok = IncrementalDetokenizer(fe.tokenizer, prompt) if fe.tokenizer else None
            texts = [detok.push(t) for t in generated] if detok else [""] * len(generated)
            fe.restore_stream(e.request_id, slot, bytes.fromhex(body["client"]), e.prompt_len, detok,
                              texts, dict(body, generated=[]))
            adopted += 1
        if adopted:
            log.warning("adopted %d in-flight requests from the shm journal of the previous sidecar",
                        adopted)
        return [by_id[rid] for rid in sorted(by_id)], adopted

    def _load_kept(self) -> None:
        """The results a previous process kept for pickup (kvhold.frontend.kept_results)."""
        if self.kept is None:
            return
        now = now_ns()
        for r in self.kept.load(self.readmission.vocab_size):   # each checked: kept_results.KeptRecord
            finished = min(r.finished_ns, now)            # a reboot restarts the clock
            self.unclaimed[r.request_id] = Unclaimed(r.identity, r.ids, r.texts, r.done, finished, r.logprobs)
            log.warning("request %#x: its result, kept for pickup by the previous process, waits "
                        "for its client", r.request_id)

    # ------------------------------------------------------------------ streams
    def on_first_token(self) -> None:
        if self.report and not self.report["first_token_ns"]:
            self.report["first_token_ns"] = now_ns()
            drain = self.report.get("previous_drain") or {}
            if drain.get("drain_start_ns"):
                log.warning("pool restart: first token of a restored request %.0f ms after the "
                            "drain started", (self.report["first_token_ns"] - drain["drain_start_ns"]) / 1e6)

    def park(self, st, ids: list[int], done: m.Done, logprobs: dict | None = None) -> None:
        """A restored or held request ended before its client came back: keep the result for
        pickup (`logprobs`: its tokens' log-probs, kvhold.frontend.logprob_stream.fields)."""
        self._away.pop(st.request_id, None)
        if st.request_id in self.cancelled:       # cancelled for want of a client: nothing to keep
            log.info("request %#x, cancelled with no client attached, ended (%d tokens)",
                     st.request_id, len(ids))
            return
        self.unclaimed.pop(st.request_id, None)          # kept in the order they finished
        kept = self.unclaimed[st.request_id] = Unclaimed(st.identity, ids, list(st.text[:len(ids)]), done,
                                                         now_ns(), logprobs or {})
        if self.kept is not None:
            self.kept.save(st.request_id, kept)     # before its durable record goes
        if len(self.unclaimed) > UNCLAIMED_MAX:
            oldest = next(iter(self.unclaimed))
            del self.unclaimed[oldest]
            self._forget_kept(oldest)
            log.warning("dropped the unclaimed result of request %#x: more than %d results wait "
                        "for pickup", oldest, UNCLAIMED_MAX)
        log.warning("request %#x finished with no client attached "
                    "(%d tokens, %s): result kept for pickup for %.0f s", st.request_id, len(ids),
                    done.finish_reason, UNCLAIMED_KEEP_S)

    def on_resume(self, identity: bytes, msg: m.Resume):
        if len(msg.request_ids) != len(msg.next_indices):
            return m.Error(code=ErrorCode.BAD_FIELD, message="request_ids and next_indices differ in length")
        resumed = []
        for rid, index in zip(msg.request_ids, msg.next_indices):
            failed = self.failed_requests.get(rid)
            if failed is not None and failed[0] == identity:
                del self.failed_requests[rid]
                self.send_client(identity, m.Error(code=ErrorCode.REQUEST_FAILED, request_id=rid,
                                                   message=failed[1]))
                continue
            error = self._resume_one(identity, rid, index)
            if error is None:
                resumed.append(rid)
            else:
                self.send_client(identity, m.Error(code=ErrorCode.NOT_FOUND, request_id=rid,
                                                           message=error))
        # a keepalive tells the SDK a sidecar serves its streams again: the announced pause ends
        self.send_client(identity, m.Keepalive(request_ids=resumed))
        return None

    def _resume_one(self, identity: bytes, rid: int, index: int) -> str | None:
        fe = self.frontend
        st = fe.streams.get(rid)
        if rid in self.cancelled and (st is None or st.identity == identity):
            return self.cancelled[rid]
        if st is not None and st.identity == identity:
            if index < 0 or (index > st.sent and not st.rerun):
                return f"request {rid:#x}: cannot resume at token {index} (have {st.sent})"
            # a re-run request behind its client: what it generates up to `index` (the same
            # tokens: sampling is deterministic) is not sent again
            st.resume_at = index if index > st.sent else 0
            index = min(index, st.sent)
            was_waiting, st.awaiting_resume = st.awaiting_resume, False
            self._away.pop(rid, None)
            st.conn = fe.connection_of(identity)       # the connection it streams to from now on
            if index < st.sent:
                ids = fe.journal.generated(st.slot, index, st.sent)
                lp = logprob_stream.fields(fe.journal, st.slot, st.prompt_len, index, st.sent)
                if self.send_client(identity, m.Tokens(request_id=rid, start=index, ids=ids,
                                                       texts=st.text[index:st.sent], **lp)) is False:
                    st.awaiting_resume = True    # not delivered: later tokens would leave a gap
                    return None
            st.last_send_ns = now_ns()
            if was_waiting:
                log.info("client re-attached to restored request %#x at token %d", rid, index)
            fe._pump(st)
            return None
        parked = self.unclaimed.get(rid)
        if parked is not None and parked.identity == identity:
            del self.unclaimed[rid]
            self._forget_kept(rid)
            index = min(max(0, index), len(parked.ids))
            self.send_client(identity, m.Tokens(request_id=rid, start=index,
                                                        ids=parked.ids[index:], texts=parked.texts[index:],
                                                        **logprob_stream.sliced(parked.logprobs, index)))
            self.send_client(identity, parked.done)
            return None
        if rid in self.failed:
            return f"request {rid:#x} could not be restored after the pool restart: {self.failed[rid].reason}"
        return (f"request {rid:#x} is unknown to this sidecar (pool generation "
                f"{self.generation}); it is not in its durable journal")

    def tick(self, now: int) -> None:
        if now >= self._next_check_ns:
            self._next_check_ns = now + UNCLAIMED_CHECK_NS
            self._cancel_unclaimed(now)
        oldest_kept = now - int(UNCLAIMED_KEEP_S * 1e9)
        while self.unclaimed:                     # in finishing order: only the expired are visited
            rid = next(iter(self.unclaimed))
            if self.unclaimed[rid].finished_ns >= oldest_kept:
                return
            del self.unclaimed[rid]
            self._forget_kept(rid)
            log.warning("dropped the unclaimed result of request %#x after %.0f s", rid, UNCLAIMED_KEEP_S)

    def _forget_kept(self, rid: int) -> None:
        if self.kept is not None:
            self.kept.remove(rid)

    def _cancel_unclaimed(self, now: int) -> None:
        """Cancel the streams held longer than `cancel_after_ns` for an owner who is not connected."""
        fe = self.frontend
        away: dict[int, int] = {}
        for rid, st in fe.streams.items():
            if not st.awaiting_resume or st.failed or rid in self.cancelled:
                continue
            since = away[rid] = self._away.get(rid, now)
            if self.cancel_after_ns and now - since >= self.cancel_after_ns:
                del away[rid]
                self._cancel(st, (now - since) / 1e9)
        self._away = away

    def _cancel(self, st, held_s: float) -> None:
        fe = self.frontend
        rid = st.request_id
        reason = (f"request {rid:#x} was cancelled: no client claimed it for {held_s:.0f} s "
                  f"(--unclaimed-cancel-s {self.cancel_after_ns / 1e9:g})")
        self.cancelled[rid] = reason
        while len(self.cancelled) > UNCLAIMED_MAX:
            del self.cancelled[next(iter(self.cancelled))]
        self.num_cancelled += 1
        fe.journal.cancel(st.slot)        # the executor ends it and frees its KV
        fe.durable.remove(rid)            # not journaled again by a drain or a pool restart
        fe.records.pop(rid, None)
        fe._wake_executor()
        log.warning("%s; %d tokens generated", reason, st.sent - st.prefix)

    def status(self) -> dict:
        return {"restore": {k: v for k, v in self.report.items() if k != "previous_drain"},
                "previous_drain": self.report.get("previous_drain"),
                "failed": [f.to_dict() for f in self.failed.values()],
                "unclaimed": [{"request_id": rid, "tokens": len(u.ids), "finish_reason": u.done.finish_reason}
                              for rid, u in reversed(list(islice(reversed(self.unclaimed.items()), UNCLAIMED_LISTED)))],
                "unclaimed_total": len(self.unclaimed),
                "unclaimed_cancel_s": self.cancel_after_ns / 1e9,
                "unclaimed_cancelled_total": self.num_cancelled,
                "awaiting_resume": sorted(st.request_id for st in self.frontend.streams.values()
                                          if st.awaiting_resume)}
