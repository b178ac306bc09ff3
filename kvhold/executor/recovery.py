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

import itertools
import logging
from dataclasses import dataclass

import numpy as np
import numpy.ma  # noqa: F401  np.unique imports it on its first call: 10+ ms inside a takeover
import torch

from kvhold.executor.page_allocator import NULL_PAGE, PageAllocator
from kvhold.executor.takeover import PageFigures, RequestPlan, TakeoverContext
from kvhold.protocol.checksum import to_u64
from kvhold.protocol.journal import segment_positions
from kvhold.protocol.layout import AdmitState, ExecState, PageFlag
from kvhold.protocol.leases import now_ns
from kvhold.protocol.validation import torn_prefixes, trusted

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Tail:
    """Where a request's partially filled last page continues."""
    page: int
    tokens: int
    copied: bool                 # copied away from a writer not yet reaped
    checksum: int = 0            # of the continued page, once published


class NativeTakeover:
    """TakeoverStrategy over kvhold's shared pages (module docstring), on the promoted engine's
    TakeoverContext."""
    kv_mode = None

    def __init__(self, ctx: TakeoverContext):
        self.ctx = ctx
        self.records = self.checksums = None
        self.flat = self.lens = None             # every plan's page list (`listing`)
        self.prefetched = None                   # (pages, counts, checksums on the device, and the
                                                 # listing's index into them where pages repeat)
        self.checked = self.bad = self.interrupted = 0
        self.realigned = self.dropped = 0
        self.tails: dict[int, Tail] = {}         # journal slot -> its tail
        self.unverified = np.zeros(0, dtype=np.int64)   # idle cached pages kept, not yet checked
        self.kept = None                         # mask over the pages: kept by the takeover (`clear`)
        self.marks: list[tuple[str, int]] = [("start", now_ns())]   # host timing (`trace`)

    def mark(self, label: str) -> None:
        self.marks.append((label, now_ns()))

    def trace(self) -> str:
        """Where the takeover's host time went up to its validation: each mark in ms from its start."""
        t0 = self.marks[0][1]
        return ", ".join(f"{label} {(t - t0) / 1e6:.2f}" for label, t in self.marks[1:])

    def prefetch(self) -> None:
        """Start validation's checksum pass before the plans are built, so that the device hashes
        while the host rebuilds the requests: the pages every taken, unfinished request lists,
        read from the journal's arrays. `_validate` takes its result only if it asks for exactly
        these pages and counts, in this order, and computes its own otherwise (a garbage page
        number, a count that changed)."""
        ctx = self.ctx
        journal, r = ctx.journal, ctx.journal.req
        live = ((r["admit_state"] != AdmitState.FREE) & (r["request_id"] != 0)
                & (r["exec_request_id"] == r["request_id"]) & (r["exec_state"] != ExecState.FINISHED))
        slots = live.nonzero()[0]
        lens = r["num_pages"][slots].astype(np.int64)
        lens = np.minimum(lens, journal.page_lists.shape[1])
        flat = journal.page_lists[np.repeat(slots, lens), segment_positions(lens)].astype(np.int64)
        if not len(flat) or flat.min() < 0 or flat.max() >= len(ctx.page_table.pages):
            return
        counts = np.minimum(ctx.page_table.pages["num_tokens"][flat], ctx.page_tokens).astype(np.int64)
        pages, rows, inverse = flat, counts, None
        if ctx.blocks.prefix is not None:    # a cached page many requests list is hashed once
            uniq, first, inv = np.unique(flat, return_index=True, return_inverse=True)
            if len(uniq) < len(flat):
                pages, rows, inverse = uniq, counts[first], inv
        dev = ctx.device
        sums = ctx.checksum.pages(torch.from_numpy(pages).to(dev), torch.from_numpy(rows).to(dev))
        self.prefetched = (flat, counts, sums, inverse)

    def validate(self, plans: list[RequestPlan], pending: set[int]) -> None:
        ctx = self.ctx
        self.records = ctx.page_table.records()
        self.checksums = self.records["checksum"]
        odd = ((self.records["version"] & 1) == 1).nonzero()[0]
        ctx.page_table.repair_versions(odd)       # the writer is fenced: versions are stable now
        self.interrupted = len(odd)
        self.flat, self.lens = listing(plans)
        self.mark("records")
        self.checked, self.bad = _validate(ctx, self.records, plans, ctx.page_tokens, self.flat, self.lens,
                                           self.prefetched, self.mark)
        self.prefetched = None
        self.realigned = sum(_realign_unsampled_prompt(ctx, plan) for plan in plans)
        self.mark("verdicts")

    def clear(self, plans: list[RequestPlan], pending: set[int]) -> None:
        ctx, records = self.ctx, self.records
        ends = np.fromiter((-(-plan.kv_valid // ctx.page_tokens) for plan in plans), dtype=np.int64,
                           count=len(plans))
        # the journal lists only the pages kept before any page is released or quarantined: an
        # executor that dies in its takeover leaves lists whose pages still hold their KV
        ctx.journal.truncate_page_lists(_slots(plans), ends)
        kept = kept_mask(len(records), self.flat, self.lens, ends)
        self.unverified = np.zeros(0, dtype=np.int64)
        if ctx.blocks.prefix is not None:
            self.unverified = _idle_cache(ctx, records, kept)
            kept[self.unverified] = True
        self.kept = kept
        hold, epochs = _clear_unkept(ctx, records, kept, pending)
        ctx.quarantined.update(zip(hold.tolist(), epochs.tolist()))
        ctx.blocks.allocator = PageAllocator.from_sorted(free_pages(kept, hold))

    def place_tails(self, plans: list[RequestPlan], pending: set[int]) -> None:
        """Where each partially filled last page continues (`_place_tail`). The copies are made
        and published first, then the journal lists each copy in place of its source (or, for a
        tail given up, no longer lists it), and only then are the sources quarantined in one
        call: at every instant the journal lists pages whose records hold their KV, should this
        executor die too."""
        ctx, placed, hold, dropped = self.ctx, [], [], []
        for plan in plans:
            held = len(hold)
            tail = self._place_tail(plan, pending, hold)
            if tail is None and len(hold) > held:
                dropped.append(plan)            # given up: its source is quarantined below
            if tail is not None:
                placed.append((plan, tail))
                self.tails[plan.entry.slot] = tail
        _publish_tails(ctx, placed)
        copied = [(plan, tail) for plan, tail in placed if tail.copied]
        if copied:
            ctx.journal.replace_pages(_slots(plan for plan, _ in copied),
                                      np.fromiter((plan.kv_valid // ctx.page_tokens for plan, _ in copied),
                                                  dtype=np.int64, count=len(copied)),
                                      np.fromiter((tail.page for _, tail in copied), dtype=np.int64,
                                                  count=len(copied)))
        if dropped:
            ctx.journal.truncate_page_lists(
                _slots(dropped), np.fromiter((-(-plan.kv_valid // ctx.page_tokens) for plan in dropped),
                                             dtype=np.int64, count=len(dropped)))
        if hold:
            ctx.page_table.quarantine(hold)

    def _give_up_an_idle_cached_page(self) -> bool:
        """A full pool: an idle cached page (no live request lists it, its checksum not checked
        yet) is released for a tail's copy. The cache loses one page; the request keeps its rows,
        where it would otherwise recompute them (a pool full of idle cached pages is the normal
        state of a busy cache). False if there is none."""
        if not len(self.unverified):
            return False
        page, self.unverified = int(self.unverified[-1]), self.unverified[:-1]
        self.kept[page] = False
        self.ctx.page_table.release(np.array([page], dtype=np.int64))
        self.ctx.blocks.allocator.free([page])
        return True

    def _place_tail(self, plan: RequestPlan, pending: set[int], hold: list[int]) -> Tail | None:
        """Where a partially filled last page continues, or None.

        If its writer may still be running, the committed rows go to a fresh page and the
        old one is quarantined; otherwise it is claimed in place. With no free page left for
        the copy (a full pool: every other page is kept or quarantined, and no idle cached page is
        left to give up), the tail is given up instead: the old page is quarantined all the same and its rows are recomputed from
        the journal (`tails_dropped`), like the rest of a damaged request. Failing the takeover
        instead would cost the standby and leave half-repaired tables to the next executor.
        A page to quarantine is appended to `hold` (place_tails quarantines them, once the journal
        no longer lists them)."""
        ctx, records = self.ctx, self.records
        full, rest = divmod(plan.kv_valid, ctx.page_tokens)
        if not rest:
            return None
        src = plan.pages[full]
        writer = int(records["epoch"][src])
        if writer not in pending:
            return Tail(src, rest, copied=False)
        hold.append(src)
        ctx.quarantined[src] = writer
        if not ctx.blocks.allocator.can_allocate(1) and not self._give_up_an_idle_cached_page():
            plan.valid_tokens = full * ctx.page_tokens
            self.dropped += 1
            return None
        dst = ctx.blocks.allocator.allocate(1)[0]
        ctx.kv.copy_tokens(src, dst, rest)
        return Tail(dst, rest, copied=True)

    def attach(self, plans: list[RequestPlan]) -> list[list[int]]:
        """Each sequence adopts its full kept pages and its tail; they are the pages to list."""
        page_tokens, blocks = self.ctx.page_tokens, self.ctx.blocks
        full = np.fromiter((plan.kv_valid // page_tokens for plan in plans), dtype=np.int64, count=len(plans))
        kept = self.flat[segment_positions(self.lens) < np.repeat(full, self.lens)]
        pages = kept.tolist()
        blocks.record_array(kept, np.full(len(kept), page_tokens, dtype=np.int64), self.checksums[kept])
        out, tails, start = [], [], 0
        for plan, n in zip(plans, full.tolist()):
            own = pages[start:start + n]
            start += n
            tail = self.tails.get(plan.entry.slot)
            if tail is not None:
                own.append(tail.page)
                tails.append(tail.page)
                blocks.record((tail.page,), (tail.tokens,), (tail.checksum,))
            plan.seq.pages = own
            out.append(own)
        if blocks.prefix is not None:     # every page the lists hold: the full kept ones, the tails
            self._rebuild_cache(np.concatenate((kept, np.asarray(tails, dtype=np.int64))))
            for plan in plans:
                _adopt_cached_prefix(plan.seq, blocks.prefix)
        return out

    def _rebuild_cache(self, listed: np.ndarray) -> None:
        """The prefix cache as the tables hold it: every kept page with the CACHED flag under its
        key, referenced by the sequences that list it (`listed`: every entry of their page lists,
        repeats included, in any order); a second page under a key that no sequence lists is
        released."""
        ctx, records, blocks = self.ctx, self.records, self.ctx.blocks
        flags = records["flags"]
        kept = self.kept.copy()
        kept[self.unverified] = False            # indexed once their checksums are checked
        cached = np.flatnonzero(kept & ((flags & PageFlag.CACHED) != 0) & ((flags & PageFlag.BAD) == 0))
        left = np.asarray(blocks.prefix.rebuild(cached, records["owner"][cached], listed), dtype=np.int64)
        is_listed = np.zeros(len(records), dtype=bool)       # masks, not np.setdiff1d: its sorts of
        is_listed[listed] = True                             # thousands of pages cost a millisecond
        idle = cached[~is_listed[cached]]                    # ascending, as cached is
        blocks.record(idle.tolist(), [ctx.page_tokens] * len(idle), records["checksum"][idle].tolist())
        unverified = self.unverified
        blocks.prefix.hold_unverified(unverified, records["owner"][unverified], records["checksum"][unverified])
        unlisted = left[~is_listed[left]]                    # ascending: rebuild keeps cached's order
        if len(unlisted):
            ctx.page_table.release(unlisted)
            blocks.allocator.free(unlisted.tolist())

    def figures(self) -> PageFigures:
        return PageFigures(checked=self.checked, bad=self.bad, quarantined=len(self.ctx.quarantined),
                           interrupted=self.interrupted,
                           copied=sum(1 for t in self.tails.values() if t.copied),
                           tails_dropped=self.dropped, prompts_realigned=self.realigned)


def _adopt_cached_prefix(seq, prefix) -> None:
    """A resumed sequence's leading pages that the rebuilt index holds are its cached prefix:
    their keys come from the index, so its first step hashes only the pages after them (64
    sequences of 2,048 tokens re-hashed 5,800 pages, about 18 ms, inside the first step). The
    keys are looked up by `map`, not a loop of Python statements per page."""
    keys = list(map(prefix.key_of.get, seq.pages))
    if None in keys:
        del keys[keys.index(None):]
    seq.page_keys = keys
    seq.cached_upto = len(keys)


def _slots(plans) -> np.ndarray:
    return np.fromiter((plan.entry.slot for plan in plans), dtype=np.int64)


def listing(plans: list[RequestPlan]) -> tuple[np.ndarray, np.ndarray]:
    """Every plan's page list, one after the other: (the pages, each list's length)."""
    lens = np.fromiter((len(plan.pages) for plan in plans), dtype=np.int64, count=len(plans))
    flat = np.fromiter(itertools.chain.from_iterable(plan.pages for plan in plans), dtype=np.int64,
                       count=int(lens.sum()))
    return flat, lens


def _validate(ctx: TakeoverContext, records, plans: list[RequestPlan], page_tokens: int, flat: np.ndarray,
              lens: np.ndarray, prefetched=None, mark=lambda label: None) -> tuple[int, int]:
    """One batched checksum pass over every listed page (`flat`, `lens`: their `listing`); fills
    valid/recorded tokens and first_bad. Array operations over all listed pages at once, no numpy
    call per request."""
    if not len(flat):
        return 0, 0
    # a garbage page number: nothing usable from it on
    garbage = first_per_segment(lens, (flat < 0) | (flat >= len(records)))
    keep = segment_positions(lens) < np.repeat(garbage, lens)
    for k in np.flatnonzero(garbage < lens).tolist():
        plans[k].first_bad = int(garbage[k])
    lens = np.minimum(lens, garbage)
    idx = flat[keep]
    if not len(idx):
        return 0, 0
    counts = np.minimum(records["num_tokens"][idx], page_tokens).astype(np.int64)
    if prefetched is not None and np.array_equal(prefetched[0], idx) and np.array_equal(prefetched[1], counts):
        mark("sums_prefetched")
        sums = to_u64(prefetched[2])
        if prefetched[3] is not None:      # hashed once per page: one sum per listing
            sums = sums[prefetched[3]]
    else:
        mark("sums_own")
        sums = _checksums_once(ctx, idx, counts)
    mark("sums")
    sub = records[idx]
    owners = np.repeat(np.fromiter((plan.entry.request_id for plan in plans), dtype=np.uint64,
                                   count=len(plans)), lens)
    logical = segment_positions(lens).astype(np.uint32)
    # a cached page (kvhold.executor.prefix_cache) is owned by its key, shared, and always full
    cached = (sub["flags"] & PageFlag.CACHED) != 0
    fields_ok = (np.where(cached, sub["num_tokens"] == page_tokens, sub["owner"] == owners)
                 & (sub["logical"] == logical)
                 & ((sub["flags"] & PageFlag.BAD) == 0) & (sub["num_tokens"] <= page_tokens))
    sum_ok = sums == sub["checksum"]
    # `mark_cached` interrupted between the key replacing the owner and the CACHED flag: the
    # page's rows are whole (its count and checksum untouched); it stays its request's page
    caching = np.flatnonzero(((sub["version"] & 1) == 1) & ~cached & ~fields_ok & sum_ok
                             & (sub["num_tokens"] == page_tokens) & (sub["logical"] == logical)
                             & ((sub["flags"] & PageFlag.BAD) == 0) & (sub["owner"] != 0)
                             & ~np.isin(sub["owner"], owners))          # a key, no live request's id
    if len(caching):
        ctx.page_table.restore_owners(idx[caching], owners[caching])
        records["owner"][idx[caching]] = owners[caching]
        fields_ok[caching] = True
    torn = np.flatnonzero(((sub["version"] & 1) == 1) & ~sum_ok & fields_ok & (counts > 0))
    if len(torn):
        counts, sum_ok = torn_prefixes(idx, sub["checksum"], counts, sum_ok, torn,
                                       lambda pages, rows: _checksums(ctx, pages, rows))
        cut = torn[sum_ok[torn]]
        if len(cut):        # the record says what is kept (its version was repaired: a successor
            ctx.page_table.set_counts(idx[cut], counts[cut])       # would read it as corrupt)
            records["num_tokens"][idx[cut]] = counts[cut]
    ok = trusted(sub, page_tokens, sum_ok) & fields_ok
    valid, recorded, first_bad = valid_prefixes(lens, ok, fields_ok, counts, page_tokens)
    for plan, v, rec, f in zip(plans, valid.tolist(), recorded.tolist(), first_bad.tolist()):
        plan.valid_tokens += v
        plan.recorded_tokens += rec
        if f >= 0:
            plan.first_bad = f
    bad = int((~ok).sum())
    checked = len(idx)
    if ctx.blocks.prefix is not None:            # a cached page listed by many requests counts once
        checked, bad = _distinct(idx, len(records)), _distinct(idx[~ok], len(records))
    if bad:
        ctx.page_table.mark_bad(idx[~ok])
        # the copy too, so that the clear releases (or quarantines) a bad page no request keeps
        # even where its record has no owner
        records["flags"][idx[~ok]] |= records.dtype["flags"].type(PageFlag.BAD)
    return checked, bad


def _distinct(pages: np.ndarray, num_pages: int) -> int:
    """How many distinct pages (by a mask: np.unique sorts)."""
    seen = np.zeros(num_pages, dtype=bool)
    seen[pages] = True
    return int(np.count_nonzero(seen))


def _checksums_once(ctx: TakeoverContext, pages: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """`_checksums`, each page hashed once however many requests list it (a cached page)."""
    if ctx.blocks.prefix is None:
        return _checksums(ctx, pages, counts)
    uniq, first, inverse = np.unique(pages, return_index=True, return_inverse=True)
    if len(uniq) == len(pages):
        return _checksums(ctx, pages, counts)
    return _checksums(ctx, uniq, counts[first])[inverse]


def _checksums(ctx: TakeoverContext, pages: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Checksums (uint64) of the first `counts` rows of `pages`: one pass on the engine's device."""
    dev = ctx.device
    return to_u64(ctx.checksum.pages(torch.from_numpy(pages).to(dev), torch.from_numpy(counts).to(dev)))


def first_per_segment(lens: np.ndarray, hit: np.ndarray) -> np.ndarray:
    """Per segment of `lens` flags: the index of its first True one, its length if none."""
    lens = np.asarray(lens, dtype=np.int64)
    out = lens.copy()
    present = lens > 0
    if present.any():
        heads = (np.cumsum(lens) - lens)[present]
        pos = np.where(hit, segment_positions(lens), np.repeat(lens, lens))
        out[present] = np.minimum.reduceat(pos, heads)
    return out


def valid_prefixes(lens: np.ndarray, ok: np.ndarray, belongs: np.ndarray, counts: np.ndarray,
                   page_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per request, from its pages' verdicts listed request after request (`lens` pages each):
    (KV tokens of its valid prefix, tokens its pages record as committed, first bad page or -1).

    In page order, the valid prefix runs up to the first page that is not `ok` (the first bad
    page) or up to and including the first partially filled one, whichever comes first: pages
    after a partial one are never read as KV, so a bad one there is not the first bad page.
    The recorded tokens are those of every page that belongs to the request (`belongs`)."""
    lens = np.asarray(lens, dtype=np.int64)
    n = len(lens)
    valid = np.zeros(n, dtype=np.int64)
    recorded = np.zeros(n, dtype=np.int64)
    first_bad = np.full(n, -1, dtype=np.int64)
    present = lens > 0
    if not present.any():
        return valid, recorded, first_bad
    heads = (np.cumsum(lens) - lens)[present]
    recorded[present] = np.add.reduceat(np.where(belongs, counts, 0), heads)
    f = first_per_segment(lens, ~ok)
    q = first_per_segment(lens, counts < page_tokens)
    bad_first = f <= q
    tail_count = counts[np.minimum(np.cumsum(lens) - lens + q, len(counts) - 1)]
    valid = np.where(bad_first, f * page_tokens, q * page_tokens + np.where(present, tail_count, 0))
    first_bad = np.where(bad_first & (f < lens), f, -1)
    return valid.astype(np.int64), recorded, first_bad


def _realign_unsampled_prompt(ctx: TakeoverContext, plan: RequestPlan) -> bool:
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
    chunk = ctx.prefill_chunk
    plan.valid_tokens = (e.num_tokens - 1) // chunk * chunk
    return True


def kept_mask(num_pages: int, flat: np.ndarray, lens: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """A mask over the pages: the first `ends[k]` pages of each listed request k (`flat`, `lens`:
    their `listing`; ends[k] at most the pages before its first garbage page number)."""
    kept = np.zeros(num_pages, dtype=bool)
    kept[flat[segment_positions(lens) < np.repeat(ends, lens)]] = True
    return kept


def free_pages(kept: np.ndarray, quarantined) -> np.ndarray:
    """The free list after a takeover, ascending: every page but the null page, the kept ones
    and the quarantined ones."""
    free = ~kept
    free[:NULL_PAGE + 1] = False
    free[np.asarray(quarantined, dtype=np.int64)] = False
    return np.flatnonzero(free)


def _idle_cache(ctx: TakeoverContext, records, kept: np.ndarray) -> np.ndarray:
    """Cached pages no live request lists (the prefix cache's idle pages) that look whole: full,
    not being written, not flagged. The takeover keeps them out of the free list and out of the
    index; the engine checks their checksums after the first resumed step (`Engine.verify_cache`),
    off the recovery's path, and indexes those that match. Any other is released with the unkept
    pages."""
    flags = records["flags"]
    cand = np.flatnonzero(((flags & PageFlag.CACHED) != 0)
                          & ((flags & (PageFlag.BAD | PageFlag.QUARANTINED)) == 0)
                          & ((records["version"] & 1) == 0) & (records["owner"] != 0)
                          & (records["num_tokens"] == ctx.page_tokens) & ~kept)
    return cand[cand > NULL_PAGE]


def _clear_unkept(ctx: TakeoverContext, records, kept: np.ndarray, pending: set[int]) -> tuple[np.ndarray, np.ndarray]:
    """Release or quarantine every page no live request keeps (`kept`: a mask over the pages).
    Returns (the quarantined pages, ascending, their writers' epochs)."""
    used = ((records["owner"] != 0) | ((records["flags"] & (PageFlag.QUARANTINED | PageFlag.BAD)) != 0))
    candidates = np.flatnonzero(used & ~kept)
    epochs = records["epoch"][candidates]
    held = np.isin(epochs, np.fromiter(pending, dtype=epochs.dtype, count=len(pending)))
    hold, free = candidates[held], candidates[~held]
    if len(hold):
        ctx.page_table.quarantine(hold)
    if len(free):
        ctx.page_table.release(free)
        records["owner"][free] = 0
    return hold, epochs[held]


def _publish_tails(ctx: TakeoverContext, placed: list[tuple[RequestPlan, Tail]]) -> None:
    """Checksum every tail in one device pass, then publish them under the new epoch."""
    if not placed:
        return
    pages = np.array([t.page for _, t in placed], dtype=np.int64)
    counts = np.array([t.tokens for _, t in placed], dtype=np.int64)
    sums = _checksums(ctx, pages, counts)
    epoch = ctx.lease.epoch
    owners = np.array([plan.entry.request_id for plan, _ in placed], dtype=np.uint64)
    logical = np.array([plan.kv_valid // ctx.page_tokens for plan, _ in placed], dtype=np.uint32)
    ctx.page_table.assign(pages, owners, logical, epoch)
    ctx.page_table.publish(pages, counts.astype(np.uint32), sums, epoch)
    for (_, tail), checksum in zip(placed, sums.tolist()):
        tail.checksum = int(checksum)
