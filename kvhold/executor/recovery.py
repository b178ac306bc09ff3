"""Native mode's takeover steps: the engine computes in kvhold's shared pages.

The strategy kvhold.executor.takeover runs for an `Engine` (the sequence and the repair
rules are stated there). Here:
* validate: interrupted records (odd version) are repaired first, the writer being
  fenced; then one batched device pass checksums every page a live request's journal
  lists, and its record must name that request and logical index. A request's valid
  tokens are those of its pages up to the first bad one, or up to a partially filled
  page. A prompt whose last chunk was published but whose first token was not is
  realigned to recompute that whole chunk (`_realign_unsampled_prompt`).
* clear: every page no request keeps is released, or quarantined while its writer's
  epoch is pending; the engine's free list is rebuilt from what is left.
* tails: a partially filled last page is claimed in place if its writer is gone, else
  copied to a fresh page (the old one quarantined), or dropped and recomputed when no
  page is free; the placed tails are checksummed in one pass and published under the
  new epoch.
* attach: the sequence adopts its full kept pages and its tail.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvhold.executor.page_allocator import NULL_PAGE, PageAllocator
from kvhold.executor.takeover import PageFigures, RequestPlan
from kvhold.protocol.checksum import to_u64
from kvhold.protocol.layout import PageFlag
from kvhold.protocol.validation import trusted

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Tail:
    """Where a request's partially filled last page continues."""
    page: int
    tokens: int
    copied: bool                 # copied away from a writer not yet reaped
    checksum: int = 0            # of the continued page, once published


class NativeTakeover:
    """TakeoverStrategy over kvhold's shared pages (module docstring)."""
    kv_mode = None

    def __init__(self, engine):
        self.engine = engine
        self.records = None
        self.checked = self.bad = self.interrupted = 0
        self.realigned = self.dropped = 0
        self.tails: dict[int, Tail] = {}         # journal slot -> its tail

    def validate(self, plans: list[RequestPlan], pending: set[int]) -> None:
        engine = self.engine
        self.records = engine.page_table.records()
        odd = ((self.records["version"] & 1) == 1).nonzero()[0]
        engine.page_table.repair_versions(odd)       # the writer is fenced: versions are stable now
        self.interrupted = len(odd)
        self.checked, self.bad = _validate(engine, self.records, plans, engine.page_tokens)
        self.realigned = sum(_realign_unsampled_prompt(engine, plan) for plan in plans)

    def clear(self, plans: list[RequestPlan], pending: set[int]) -> None:
        engine, records = self.engine, self.records
        kept: set[int] = set()
        for plan in plans:
            full, rest = divmod(plan.kv_valid, engine.page_tokens)
            kept.update(plan.pages[:full + (1 if rest else 0)])
        quarantined = _clear_unkept(engine, records, kept, pending)
        engine.quarantined.update(quarantined)
        engine.blocks.allocator = PageAllocator(
            p for p in range(NULL_PAGE + 1, len(records)) if p not in kept and p not in quarantined)

    def place_tails(self, plans: list[RequestPlan], pending: set[int]) -> None:
        placed = []
        for plan in plans:
            tail = self._place_tail(plan, pending)
            if tail is not None:
                placed.append((plan, tail))
                self.tails[plan.entry.slot] = tail
        _publish_tails(self.engine, placed)

    def _place_tail(self, plan: RequestPlan, pending: set[int]) -> Tail | None:
        """Where a partially filled last page continues, or None.

        If its writer may still be running, the committed rows go to a fresh page and the
        old one is quarantined; otherwise it is claimed in place. With no free page left for
        the copy (a full pool: every other page is kept or quarantined), the tail is given
        up instead: the old page is quarantined all the same and its rows are recomputed from
        the journal (`tails_dropped`), like the rest of a damaged request. Failing the takeover
        instead would cost the standby and leave half-repaired tables to the next executor."""
        engine, records = self.engine, self.records
        full, rest = divmod(plan.kv_valid, engine.page_tokens)
        if not rest:
            return None
        src = plan.pages[full]
        if int(records["epoch"][src]) not in pending:
            return Tail(src, rest, copied=False)
        if not engine.blocks.allocator.can_allocate(1):
            engine.page_table.quarantine([src])
            engine.quarantined[src] = int(records["epoch"][src])
            plan.valid_tokens = full * engine.page_tokens
            self.dropped += 1
            return None
        dst = engine.blocks.allocator.allocate(1)[0]
        engine.kv.copy_tokens(src, dst, rest)
        engine.page_table.quarantine([src])
        engine.quarantined[src] = int(records["epoch"][src])
        return Tail(dst, rest, copied=True)

    def attach(self, plan: RequestPlan) -> list[int]:
        """The sequence adopts its full kept pages and its tail; they are the pages to list."""
        page_tokens = self.engine.page_tokens
        full = plan.kv_valid // page_tokens
        pages = plan.pages[:full]
        counts = [page_tokens] * full
        checksums = [int(self.records["checksum"][p]) for p in pages]
        tail = self.tails.get(plan.entry.slot)
        if tail is not None:
            pages.append(tail.page)
            counts.append(tail.tokens)
            checksums.append(tail.checksum)
        self.engine.blocks.adopt(plan.seq, pages, counts, checksums)
        return pages

    def figures(self) -> PageFigures:
        return PageFigures(checked=self.checked, bad=self.bad, quarantined=len(self.engine.quarantined),
                           interrupted=self.interrupted,
                           copied=sum(1 for t in self.tails.values() if t.copied),
                           tails_dropped=self.dropped, prompts_realigned=self.realigned)


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


def _realign_unsampled_prompt(engine, plan: RequestPlan) -> bool:
    """A death after the KV pages of a prompt's last chunk were published but before its first
    token was: the pages cover the whole prompt, and `kv_valid` (never the last journal token)
    would leave the prompt's last position alone to recompute, as a one-token row. A runner
    computes such a row the decode way (on CUDA: the paged decode kernel and the decode
    graph's GEMM shapes), not as the prefill chunk it was part of, so its KV and the first
    token's logits could differ in the last bits from an uninterrupted run's, and with them
    every sampled token after. Recompute the whole last chunk instead (at most one prefill
    chunk): the same chunk, cut at the same position, through the same path. True if realigned."""
    e = plan.entry
    if plan.first_bad is not None or e.num_generated != e.num_prefix or e.num_tokens < 2:
        return False                            # a token was sampled: the last one is a decode row
    if plan.valid_tokens < e.num_tokens:
        return False                            # the last chunk is not all there: recomputed anyway
    chunk = engine.scheduler.prefill_chunk
    plan.valid_tokens = (e.num_tokens - 1) // chunk * chunk
    return True


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


def _publish_tails(engine, placed: list[tuple[RequestPlan, Tail]]) -> None:
    """Checksum every tail in one device pass, then publish them under the new epoch."""
    if not placed:
        return
    pages = np.array([t.page for _, t in placed], dtype=np.int64)
    counts = np.array([t.tokens for _, t in placed], dtype=np.int64)
    dev = engine.device
    sums = to_u64(engine.checksum.pages(torch.from_numpy(pages).to(dev), torch.from_numpy(counts).to(dev)))
    epoch = engine.lease.epoch
    owners = np.array([plan.entry.request_id for plan, _ in placed], dtype=np.uint64)
    logical = np.array([plan.kv_valid // engine.page_tokens for plan, _ in placed], dtype=np.uint32)
    engine.page_table.assign(pages, owners, logical, epoch)
    engine.page_table.publish(pages, counts.astype(np.uint32), sums, epoch)
    for (_, tail), checksum in zip(placed, sums.tolist()):
        tail.checksum = int(checksum)
