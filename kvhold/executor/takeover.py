"""Takeover after an executor died: validate, classify, repair, resume, report.

Runs in the promoted executor before its first step; the dead one is already fenced.
`take_over` owns the sequence; a `TakeoverStrategy` does the steps that depend on where
the engine computes its KV: in kvhold's shared pages (native mode,
kvhold.executor.recovery.NativeTakeover) or in a private pool that kvhold's pages mirror
(foreign-pool mode, kvhold.executor.foreign_pool.ForeignTakeover).
0. Gather every live request the journal shows taken by an executor, rebuilt as a
   sequence from the journal's tokens (those a hot standby read ahead while it idled,
   kvhold.executor.journal_tokens, and those committed since). Queued requests that no
   executor had taken yet are left to normal admission; finished ones are only counted.
   A strategy may start its validation's device work first (`prefetch`), so that the
   device works while the host gathers.
1. Validate (strategy): every page a live request's KV is kept from must name that
   request and position, and the checksum of its committed bytes must match (an
   interrupted record, odd version, is kept only if it does). Each request gets the KV
   tokens of its valid prefix, the tokens the dead executor had committed, and its
   first bad page.
2. Classify each request: resumable (every page valid), damaged (first bad page k: KV
   is kept up to page k and recomputed from there), lost (nothing usable: re-prefill
   from the journal's tokens).
3. Repair (strategy) without racing the dead writer. A fenced executor may still have
   writes in flight (its other threads, its GPU queue) until its exit is confirmed.
   Such a writer only ever writes the tail page of a sequence and pages it allocated,
   so: full pages are kept in place (verified, never written again); a partially
   filled tail page is copied into a fresh page, which the new executor continues,
   while the old one is quarantined; orphans are quarantined too. Quarantined pages go
   back to the free list when the sidecar reports the writer's exit (`reaped`). When
   the writer is known to be gone, tails are simply claimed in place. The journal never
   lists a page the takeover released or quarantined (lists are cut to the kept pages
   first; a copied tail is listed before its source is quarantined): a takeover that dies
   half way leaves the next one lists whose pages still hold their KV.
4. Resume: each request gets its kept KV (strategy), the journal lists the kvhold pages
   that hold it, and it continues from its last valid KV position; the journal holds
   every token, so recomputation needs no sampling and the output is unchanged. A
   request whose last committed token already ended it, or that was cancelled, is
   finished instead.
5. Report: a RecoveryReport (kvhold.protocol.recovery_report) with a timing mark after
   each step and a row for each of the first MAX_REPORTED_REQUESTS requests.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvhold.executor import faults
from kvhold.executor.sequence import Sequence
from kvhold.protocol.journal import JournalEntry
from kvhold.protocol.layout import ExecState, FinishReason
from kvhold.protocol.leases import now_ns
from kvhold.protocol.recovery_report import REQUEST_CLASSES, RecoveryReport, RequestRecovery

if TYPE_CHECKING:
    import torch

    from kvhold.executor.block_manager import BlockManager
    from kvhold.executor.kv_cache import KvCache
    from kvhold.protocol.journal import Journal
    from kvhold.protocol.leases import Lease
    from kvhold.protocol.page_table import PageTable

MAX_REPORTED_REQUESTS = 64


@dataclass(frozen=True, slots=True)
class TakeoverContext:
    """What a takeover strategy works on: the promoted engine's tables, pool and page
    bookkeeping (Engine.takeover_context), none of its steps."""
    journal: Journal
    page_table: PageTable
    lease: Lease                 # the promoted executor's: its epoch publishes the repaired pages
    kv: KvCache                  # the pool the engine computes in (foreign mode: its private one)
    checksum: object             # the engine's page checksum (TorchChecksum, TritonChecksum)
    device: torch.device
    page_tokens: int
    prefill_chunk: int
    blocks: BlockManager         # the engine's page bookkeeping; the takeover rebuilds its allocator
    quarantined: dict[int, int]  # the engine's: page -> epoch of a writer not yet reaped


@dataclass(slots=True)
class RequestPlan:
    """One live request through the takeover; the strategy's validation fills the counts."""
    entry: JournalEntry
    seq: Sequence                # rebuilt from the journal's tokens
    pages: list[int]             # the journal's page list (kvhold pages)
    valid_tokens: int = 0        # KV tokens covered by the valid prefix of pages
    recorded_tokens: int = 0     # KV tokens the dead executor had committed
    first_bad: int | None = None  # logical index of the first invalid page

    @property
    def kv_valid(self) -> int:
        # the last journal token is the next step's input: its KV is recomputed anyway
        return min(self.valid_tokens, max(0, self.entry.num_tokens - 1))

    @property
    def tokens_recomputed(self) -> int:
        return max(0, min(self.recorded_tokens, self.entry.num_tokens - 1) - self.kv_valid)

    @property
    def klass(self) -> str:
        if self.first_bad is None:
            return "resumable"
        return "damaged" if self.kv_valid > 0 else "lost"


@dataclass(frozen=True, slots=True)
class PageFigures:
    """What a strategy counted about pages; None: a step its mode does not have."""
    checked: int
    bad: int
    quarantined: int
    interrupted: int | None = None
    copied: int | None = None
    tails_dropped: int | None = None
    prompts_realigned: int | None = None


class TakeoverStrategy(Protocol):
    """The steps of a takeover that depend on where the engine's KV lives; a strategy is built
    on a TakeoverContext (and, in foreign mode, the KV mirror), never on the engine."""
    kv_mode: str | None          # None: native

    def validate(self, plans: list[RequestPlan], pending: set[int]) -> None:
        """Check the pages; set each plan's valid_tokens, recorded_tokens and first_bad."""

    def clear(self, plans: list[RequestPlan], pending: set[int]) -> None:
        """Release or quarantine every page no plan keeps; build the engine's free list."""

    def place_tails(self, plans: list[RequestPlan], pending: set[int]) -> None:
        """Decide where each partially filled last page continues."""

    def attach(self, plans: list[RequestPlan]) -> list[list[int]]:
        """Give each plan's seq its kept KV; returns, per plan, the kvhold pages the journal is to list."""

    def figures(self) -> PageFigures: ...


def take_over(engine, strategy: TakeoverStrategy, pending_epochs, detect_ns: int = 0) -> RecoveryReport:
    """The takeover runs with Python's cyclic garbage collector paused: it allocates a few
    thousand objects (a sequence's token list, page lists, journal entries), enough to set off
    collections that scan the executor's whole young heap in the middle of it (milliseconds each
    in an executor holding a model); what it leaves is collected after it."""
    paused = gc.isenabled()
    gc.disable()
    try:
        return _take_over(engine, strategy, pending_epochs, detect_ns)
    finally:
        if paused:
            gc.enable()


def _take_over(engine, strategy: TakeoverStrategy, pending_epochs, detect_ns: int) -> RecoveryReport:
    t_start = now_ns()
    pending = {int(e) for e in pending_epochs}
    mark = getattr(strategy, "mark", None) or (lambda label: None)
    prefetch = getattr(strategy, "prefetch", None)
    if prefetch is not None:
        prefetch()                                     # the device hashes while the host goes on
        mark("prefetched")
    ahead = getattr(engine, "tokens_ahead", None)     # what a standby read while it idled
    plans, finished = live_requests(engine.journal, ahead)
    if ahead is not None:
        ahead.clear()                                  # active from now on: read no more
        engine.tokens_ahead = None
    mark("plans")
    strategy.validate(plans, pending)
    t_validated = now_ns()
    strategy.clear(plans, pending)
    t_cleared = now_ns()
    faults.point("takeover_cleared")     # crash tests: a death between the takeover's steps
    strategy.place_tails(plans, pending)
    t_tails = now_ns()
    faults.point("takeover_tails")
    _resume(engine, strategy, plans)
    pages = strategy.figures()
    classes = [plan.klass for plan in plans]
    return RecoveryReport(
        detect_ns=detect_ns, promoted_ns=t_start, validated_ns=t_validated, cleared_ns=t_cleared,
        tails_ns=t_tails, resumed_ns=now_ns(), pages_checked=pages.checked, pages_bad=pages.bad,
        pages_interrupted=pages.interrupted, pages_copied=pages.copied, tails_dropped=pages.tails_dropped,
        prompts_realigned=pages.prompts_realigned, pages_quarantined=pages.quarantined,
        requests_finished=finished, **{f"requests_{c}": classes.count(c) for c in REQUEST_CLASSES},
        tokens_recomputed=sum(p.tokens_recomputed for p in plans), tokens_kept=sum(p.kv_valid for p in plans),
        requests=[RequestRecovery(request_id=p.entry.request_id, klass=p.klass, first_bad_page=p.first_bad,
                                  kv_kept=p.kv_valid, tokens_recomputed=p.tokens_recomputed)
                  for p in plans[:MAX_REPORTED_REQUESTS]],
        kv_mode=strategy.kv_mode)


def live_requests(journal, ahead=None) -> tuple[list[RequestPlan], int]:
    """A plan for every taken, unfinished request, and how many taken ones had finished.
    `ahead` (kvhold.executor.journal_tokens.JournalTokens): the tokens a standby read ahead,
    of which only those committed since are read here."""
    plans, finished = [], 0
    for e in journal.entries(journal.live_slots()):
        if not e.taken:
            continue                                   # queued: normal admission takes it
        if e.exec_state == ExecState.FINISHED:
            finished += 1
            continue
        pages = journal.pages_of(e.slot, e.num_pages).tolist()
        tokens = (ahead.take(e.slot, e.request_id, e.num_tokens) if ahead is not None
                  else journal.tokens[e.slot, :e.num_tokens].tolist())
        seq = Sequence.from_journal(e, tokens)
        plans.append(RequestPlan(entry=e, seq=seq, pages=pages))
    return plans, finished


def _resume(engine, strategy: TakeoverStrategy, plans: list[RequestPlan]) -> None:
    """List the kept pages in the journal, then schedule each sequence (or finish it)."""
    if not plans:
        strategy.attach([])       # no request, but the prefix cache's idle pages are indexed again
        return
    journal = engine.journal
    slots = np.fromiter((plan.entry.slot for plan in plans), dtype=np.int64, count=len(plans))
    journal.set_page_lists(slots, strategy.attach(plans))
    cancelled = set(journal.cancelled(slots).tolist())
    for plan in plans:
        seq, slot = plan.seq, plan.entry.slot
        kv_valid = plan.kv_valid
        recomputed = plan.tokens_recomputed
        if recomputed:
            journal.add_counter(slot, "num_recomputed", recomputed)
        seq.num_computed = kv_valid
        # a request whose last token was committed but not yet marked finished
        reason = engine.finish_reason(seq, seq.tokens[-1]) if seq.num_generated else None
        engine.add(seq)
        if reason is not None or slot in cancelled:
            engine.finish(seq, reason or FinishReason.CANCELLED)      # frees its pages
