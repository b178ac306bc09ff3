"""Takeover after an executor died: validate, classify, repair, resume (DESIGN.md s5).

Runs in the promoted executor before its first step; the dead one is already fenced.
1. Validate, in one batched device pass, every page that a live request's journal
   lists: the record must name that request and position, and the checksum of its
   committed bytes must match (an interrupted record, odd version, is kept only if
   it does).
2. Classify each request: finished, resumable (every listed page valid), damaged
   (first bad page k: KV is kept up to page k and recomputed from there), lost
   (nothing usable: re-prefill from the journal's tokens). Queued requests that no
   executor had taken yet are left to normal admission.
3. Repair without racing the dead writer. A fenced executor may still have writes in
   flight (its other threads, its GPU queue) until its exit is confirmed. Such a
   writer only ever writes the tail page of a sequence and pages it allocated, so:
   full pages are kept in place (verified, never written again); a partially filled
   tail page is copied into a fresh page, which the new executor continues, while
   the old one is quarantined; orphans are quarantined too. Quarantined pages go
   back to the free list when the sidecar reports the writer's exit (`reaped`).
   When the writer is known to be gone, tails are simply claimed in place.
4. Resume: each request continues from its last valid KV position; the journal holds
   every token, so recomputation needs no sampling and the output is unchanged.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvhold.executor.page_allocator import NULL_PAGE, PageAllocator
from kvhold.executor.sequence import Sequence
from kvhold.protocol.checksum import to_u64
from kvhold.protocol.journal import JournalEntry
from kvhold.protocol.layout import AdmitState, ExecState, FinishReason, PageFlag
from kvhold.protocol.leases import now_ns
from kvhold.protocol.validation import trusted

log = logging.getLogger(__name__)
MAX_REPORTED_REQUESTS = 64


@dataclass(slots=True)
class RequestPlan:
    entry: JournalEntry
    pages: list[int]             # the journal's page list
    valid_tokens: int            # KV tokens covered by the valid prefix of pages
    recorded_tokens: int         # KV tokens the dead executor had committed
    first_bad: int | None        # logical index of the first invalid page
    tail_checksum: int = 0       # of the continued last page, once placed
    tail_dropped: bool = False   # no free page to copy the tail into: its rows are recomputed
    realigned: bool = False      # prompt done, first token not committed: last chunk recomputed

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


def take_over(engine, pending_epochs, detect_ns: int = 0) -> dict:
    t_start = now_ns()
    tables, journal, pt = engine.tables, engine.journal, engine.page_table
    page_tokens = engine.page_tokens
    records = tables.pages.copy()
    pending = set(int(e) for e in pending_epochs)

    finished, plans = [], []
    for slot in journal.live_slots():
        e = journal.entry(int(slot))
        if not e.taken:
            continue                                   # queued: normal admission takes it
        if e.exec_state == ExecState.FINISHED:
            finished.append(e)
            continue
        n = max(0, min(e.num_pages, tables.page_lists.shape[1]))
        pages = [int(p) for p in journal.pages_of(e.slot, n)]
        plans.append(RequestPlan(entry=e, pages=pages, valid_tokens=0, recorded_tokens=0, first_bad=None))

    odd = ((records["version"] & 1) == 1).nonzero()[0]
    pt.repair_versions(odd)                    # the writer is fenced: versions are stable now
    checked, bad = _validate(engine, records, plans, page_tokens)
    for plan in plans:
        _realign_unsampled_prompt(engine, plan)
    t_validated = now_ns()
    kept: set[int] = set()
    for plan in plans:
        full, rest = divmod(plan.kv_valid, page_tokens)
        kept.update(plan.pages[:full + (1 if rest else 0)])
    quarantined = _clear_unkept(engine, records, kept, pending)
    engine.quarantined.update(quarantined)
    engine.blocks.allocator = PageAllocator(
        p for p in range(NULL_PAGE + 1, len(records)) if p not in kept and p not in quarantined)
    t_cleared = now_ns()

    report_requests = []
    classes = {"resumable": 0, "damaged": 0, "lost": 0}
    tails = [_place_tail(engine, plan, records, pending) for plan in plans]
    copied = sum(1 for t in tails if t and t[2])
    _publish_tails(engine, plans, tails)
    t_tails = now_ns()
    recomputed = 0
    for plan, tail in zip(plans, tails):
        _resume(engine, plan, records, tail)
        classes[plan.klass] += 1
        recomputed += plan.tokens_recomputed
        if len(report_requests) < MAX_REPORTED_REQUESTS:
            report_requests.append({"request_id": plan.entry.request_id, "class": plan.klass,
                                    "first_bad_page": plan.first_bad, "kv_kept": plan.kv_valid,
                                    "tokens_recomputed": plan.tokens_recomputed})
    report = {
        "detect_ns": detect_ns, "promoted_ns": t_start, "validated_ns": t_validated,
        "cleared_ns": t_cleared, "tails_ns": t_tails,
        "resumed_ns": now_ns(), "pages_checked": checked, "pages_bad": bad,
        "pages_interrupted": int(len(odd)), "pages_copied": copied,
        "tails_dropped": sum(1 for p in plans if p.tail_dropped),
        "prompts_realigned": sum(1 for p in plans if p.realigned),
        "pages_quarantined": len(engine.quarantined), "requests_finished": len(finished),
        "requests_resumable": classes["resumable"], "requests_damaged": classes["damaged"],
        "requests_lost": classes["lost"], "tokens_recomputed": recomputed,
        "tokens_kept": sum(p.kv_valid for p in plans), "requests": report_requests,
    }
    return report


def _validate(engine, records, plans: list[RequestPlan], page_tokens: int) -> tuple[int, int]:
    """One batched checksum pass over every listed page; fills valid/recorded tokens."""
    where, ids = [], []
    for k, plan in enumerate(plans):
        for i, page in enumerate(plan.pages):
            if not 0 <= page < len(records):
                plan.first_bad = i             # a garbage page number: nothing usable from here
                break
            where.append((k, i))
            ids.append(page)
    if not ids:
        return 0, 0
    idx = np.array(ids, dtype=np.int64)
    counts = np.minimum(records["num_tokens"][idx], page_tokens).astype(np.int64)
    dev = engine.device
    sums = to_u64(engine.checksum.pages(torch.from_numpy(idx).to(dev), torch.from_numpy(counts).to(dev)))
    sub = records[idx]
    owners = np.array([plans[k].entry.request_id for k, _ in where], dtype=np.uint64)
    logical = np.array([i for _, i in where], dtype=np.uint32)
    fields_ok = ((sub["owner"] == owners) & (sub["logical"] == logical)
                 & ((sub["flags"] & PageFlag.BAD) == 0) & (sub["num_tokens"] <= page_tokens))
    ok = trusted(sub, page_tokens, sums == sub["checksum"]) & fields_ok
    for (k, i), good, belongs, count in zip(where, ok, fields_ok, counts.tolist()):
        plan = plans[k]
        if belongs:
            plan.recorded_tokens += count
        if plan.first_bad is not None and i >= plan.first_bad:
            continue
        if plan.valid_tokens != i * page_tokens:
            continue                           # after a partially filled tail page
        if good:
            plan.valid_tokens += count
        else:
            plan.first_bad = i
    bad = int((~ok).sum())
    if bad:
        engine.page_table.set_flags(idx[~ok], PageFlag.BAD, engine.lease.epoch)
    return len(ids), bad


def _realign_unsampled_prompt(engine, plan: RequestPlan) -> None:
    """A death after the KV pages of a prompt's last chunk were published but before its first
    token was: the pages cover the whole prompt, and `kv_valid` (never the last journal token)
    would leave the prompt's last position alone to recompute, as a one-token row. A runner
    computes such a row the decode way (on CUDA: the paged decode kernel and the decode
    graph's GEMM shapes), not as the prefill chunk it was part of, so its KV and the first
    token's logits could differ in the last bits from an uninterrupted run's, and with them
    every sampled token after. Recompute the whole last chunk instead (at most one prefill
    chunk): the same chunk, cut at the same position, through the same path."""
    e = plan.entry
    if plan.first_bad is not None or e.num_generated != e.num_prefix or e.num_tokens < 2:
        return                                  # a token was sampled: the last one is a decode row
    if plan.valid_tokens < e.num_tokens:
        return                                  # the last chunk is not all there: recomputed anyway
    chunk = engine.scheduler.prefill_chunk
    plan.valid_tokens = (e.num_tokens - 1) // chunk * chunk
    plan.realigned = True


def _clear_unkept(engine, records, kept: set[int], pending: set[int]) -> dict[int, int]:
    """Release or quarantine every page no live request keeps. Returns {page: writer epoch}."""
    used = ((records["owner"] != 0) | ((records["flags"] & (PageFlag.QUARANTINED | PageFlag.BAD)) != 0))
    candidates = [p for p in used.nonzero()[0].tolist() if p not in kept]
    hold = [p for p in candidates if int(records["epoch"][p]) in pending]
    free = [p for p in candidates if int(records["epoch"][p]) not in pending]
    if hold:
        engine.page_table.quarantine(hold)
    if free:
        engine.page_table.release(free)
        records["owner"][free] = 0
    return {p: int(records["epoch"][p]) for p in hold}


def _place_tail(engine, plan: RequestPlan, records, pending: set[int]):
    """Where a partially filled last page continues: (page, tokens, copied?) or None.

    If its writer may still be running, the committed rows go to a fresh page and the
    old one is quarantined; otherwise it is claimed in place. With no free page left for
    the copy (a full pool: every other page is kept or quarantined), the tail is given
    up instead: the old page is quarantined all the same and its rows are recomputed from
    the journal (`tail_dropped`), like the rest of a damaged request. Failing the takeover
    instead would cost the standby and leave half-repaired tables to the next executor."""
    full, rest = divmod(plan.kv_valid, engine.page_tokens)
    if not rest:
        return None
    src = plan.pages[full]
    if int(records["epoch"][src]) not in pending:
        return src, rest, False
    if not engine.blocks.allocator.can_allocate(1):
        engine.page_table.quarantine([src])
        engine.quarantined[src] = int(records["epoch"][src])
        plan.valid_tokens = full * engine.page_tokens
        plan.tail_dropped = True
        return None
    dst = engine.blocks.allocator.allocate(1)[0]
    engine.kv.copy_tokens(src, dst, rest)
    engine.page_table.quarantine([src])
    engine.quarantined[src] = int(records["epoch"][src])
    return dst, rest, True


def _publish_tails(engine, plans, tails) -> None:
    """Checksum every tail in one device pass, then publish them under the new epoch."""
    placed = [(plan, t) for plan, t in zip(plans, tails) if t is not None]
    if not placed:
        return
    pages = np.array([t[0] for _, t in placed], dtype=np.int64)
    counts = np.array([t[1] for _, t in placed], dtype=np.int64)
    dev = engine.device
    sums = to_u64(engine.checksum.pages(torch.from_numpy(pages).to(dev), torch.from_numpy(counts).to(dev)))
    epoch = engine.lease.epoch
    owners = np.array([plan.entry.request_id for plan, _ in placed], dtype=np.uint64)
    logical = np.array([plan.kv_valid // engine.page_tokens for plan, _ in placed], dtype=np.uint32)
    engine.page_table.assign(pages, owners, logical, epoch)
    engine.page_table.publish(pages, counts.astype(np.uint32), sums, epoch)
    for (plan, t), checksum in zip(placed, sums.tolist()):
        plan.tail_checksum = int(checksum)


def _resume(engine, plan: RequestPlan, records, tail) -> None:
    """Rebuild the sequence from the journal and its kept pages."""
    e, journal = plan.entry, engine.journal
    page_tokens = engine.page_tokens
    full = plan.kv_valid // page_tokens
    pages = plan.pages[:full]
    counts = [page_tokens] * full
    checksums = [int(records["checksum"][p]) for p in pages]
    if tail is not None:
        pages.append(tail[0])
        counts.append(tail[1])
        checksums.append(plan.tail_checksum)
    journal.page_lists[e.slot, :len(pages)] = pages
    journal.set_num_pages(e.slot, len(pages))
    if plan.tokens_recomputed:
        journal.add_counter(e.slot, "num_recomputed", plan.tokens_recomputed)
    tokens = journal.all_tokens(e.slot, e.num_tokens).tolist()
    seq = Sequence.from_journal(e, tokens)
    engine.blocks.adopt(seq, pages, counts, checksums)
    seq.num_computed = plan.kv_valid
    reason = _already_done(engine, seq)
    if reason is not None or journal.req["admit_state"][e.slot] == AdmitState.CANCELLED:
        journal.finish(e.slot, reason or FinishReason.CANCELLED)
        engine.blocks.free(seq)
    else:
        engine.add(seq)


def _already_done(engine, seq: Sequence) -> FinishReason | None:
    """A request whose last token was committed but not yet marked finished."""
    if seq.num_generated == 0:
        return None
    return engine.finish_reason(seq, seq.tokens[-1])
