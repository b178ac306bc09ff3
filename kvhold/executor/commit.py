"""CommitProtocol: the one owner of the order in which a step's results become visible.

The rule. After a step's device work (its results read back to the host), the step's
results become visible in this order, each stage published before the next begins:
  0. log-probs of known tokens the step computed (prompt tokens, when asked for) stored and
     their `lp_done` published, after a lease check: before the pages they come from, so a
     successor that keeps those pages finds them (it recomputes any others);
  1. pages: every KV page written this step gets its new (count, checksum) published
     under the page-table seqlock, after a lease check; the checksum grows by the hash
     of the newly written token slots only;
  2. the lease checked again, then the journal: each sampled token stored with its log-probs
     (when asked for), then its request's generated count bumped (Journal.commit_tokens);
  3. finished: finished requests marked finished, then their pages freed.
A token reaches a client only through the journal, i.e. after stage 2. The second lease
check keeps an executor fenced between pages and journal (a successor may own its slots
now) from writing stale tokens. Fault points (kvhold.executor.faults: commit_begin,
commit_pages, commit_journal, commit_finish) mark the stage boundaries for crash tests.

The pages stage is pluggable (PagesStage): NativePages publishes kvhold's own pool in the
page table; the foreign-pool engine plugs in its KV mirror (kvhold.executor.foreign_pool).
NoCommit, for benchmarks, advances the engine as the protocol does and publishes nothing.

Pipelining. A decode step's commit is host work on shared memory: the pages' new (count,
checksum) under the seqlock, the sampled tokens and generated counts in the journal, then
the finished requests. Done between two steps it leaves the GPU idle for that long (2-4%
of a Llama-3-8B step at batch 64). So a decode step's commit is split:

* at once, after the read-back: the engine's own state advances (counts and checksums it
  keeps per page, each sequence's tokens; commit returns the finished sequences, which the
  engine takes out of its scheduler) and what is to be published is computed, into a
  PendingCommit;
* the next step schedules and queues its forward, then publishes the PendingCommit in
  the original order (pages, journal, finished), while the device computes.

Nothing a client or a successor can see changes order: a token still reaches the
journal only after the KV slots it follows are published, and the next step's writes
go to slots beyond the published counts (or to new pages). If the executor dies with a
commit pending, the successor finds the step's KV slots unpublished and its token not
in the journal, and recomputes both, exactly as for a death just before a commit.
Pages of a sequence with a commit pending are never freed before it is published:
finished sequences are freed by the publication itself, which comes before the next
schedule when any finished (their pages are free for it, as without the pipeline); the
scheduler publishes before it would preempt (Scheduler.on_preempt), and so do
cancellations, steps that are not decode-only (they take the immediate path) and a step
with nothing to run. The lease is checked before the pages and again before the journal,
as in the immediate commit. Only a pages stage that can defer (NativePages, when the
runner hashed every decode row's slot) pipelines; any other step commits at once.

The engine calls the protocol at named points of its step, in this order: before_cancel,
before_schedule, before_preempt (the scheduler's hook), before_run, after_forward (the
runner's hook), after_run, commit; flush on a graceful stop. The protocol never calls the
engine: it is handed what it publishes to and frees (lease, journal, pages stage, the engine's
page bookkeeping and sequences), and `commit` returns the sequences the step finished.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvhold.executor import faults
from kvhold.executor.sequence import Sequence
from kvhold.protocol.checksum import to_u64
from kvhold.protocol.layout import FinishReason

_M64 = (1 << 64) - 1
PageUpdate = tuple[np.ndarray, np.ndarray, np.ndarray]     # pages int64, counts uint32, checksums uint64


@dataclass(slots=True)
class PendingCommit:
    """Also the second half of an immediate commit, whose pages went out first (pages None)."""
    pages: np.ndarray | None        # int64: pages whose committed range grows by one slot
    counts: np.ndarray | None       # uint32: their new token counts
    checksums: np.ndarray | None    # uint64: their new checksums
    slots: np.ndarray               # int64: journal slots that sampled a token
    positions: np.ndarray           # int64: where each token goes in its slot's token row
    tokens: np.ndarray              # int32
    generated: np.ndarray           # uint32: each slot's generated count, this token included
    finished: list[tuple[Sequence, FinishReason]]
    logprobs: tuple | None = None   # the sampled tokens' log-probs (Journal.write_logprobs' arguments)


class PagesStage:
    """Stage 1: publishes the KV pages a step wrote. `plan` is the step as it ran (before the
    engine advances); `slot_hashes` is what the runner returned ({page: hash of the one slot
    each decode row wrote there}, empty for other steps)."""

    def after_forward(self, plan) -> None:
        """The step's forward is queued, its results not yet read back."""

    def publish(self, plan, slot_hashes: dict[int, int]) -> None:
        """Publish every page the step wrote, the lease checked first."""
        raise NotImplementedError

    def defer(self, plan, slot_hashes: dict[int, int]) -> PageUpdate | None:
        """A decode step's pages, to be published later by publish_deferred (the engine's own
        copy already advanced); None if this step's pages must be published at once."""
        return None

    def publish_deferred(self, update: PageUpdate) -> None:
        """Publish what `defer` returned, the lease checked first."""
        raise NotImplementedError


class NativePages(PagesStage):
    """kvhold's own pool: each written page's (count, checksum) in the page table, and the
    BlockManager's copy of them (blocks.counts, blocks.checksums)."""

    def __init__(self, blocks, page_table, checksum, lease, device):
        self.blocks = blocks
        self.page_table = page_table
        self.checksum = checksum
        self.lease = lease
        self.device = device
        self.page_tokens = blocks.page_tokens

    def publish(self, plan, slot_hashes: dict[int, int]) -> None:
        update = self._slot_update(plan, slot_hashes) or self._range_update(plan)
        self.lease.check()
        self.page_table.publish(*update, self.lease.epoch)
        self._keep(*update)

    def defer(self, plan, slot_hashes: dict[int, int]) -> PageUpdate | None:
        update = self._slot_update(plan, slot_hashes)
        if update is not None:
            self._keep(*update)
        return update

    def publish_deferred(self, update: PageUpdate) -> None:
        """Publish what `defer` returned, the lease checked first."""
        self.lease.check()
        self.page_table.publish(*update, self.lease.epoch)

    def _slot_update(self, plan, hashes: dict[int, int]) -> PageUpdate | None:
        """The decode-step case: each row wrote the next slot of one page and the runner hashed
        it. None if a row does not fit that."""
        if len(hashes) != len(plan):
            return None
        pt, counts, sums = self.page_tokens, self.blocks.counts, self.blocks.checksums
        pages, new_counts, new_sums = [], [], []
        for p in plan:
            s = p.seq
            page = s.pages[s.num_computed // pt] if p.n == 1 else -1
            h = hashes.get(page)
            if h is None or counts[page] != s.num_computed % pt:
                return None
            pages.append(page)
            new_counts.append(counts[page] + 1)
            new_sums.append((sums[page] + h) & _M64)
        return (np.array(pages, dtype=np.int64), np.array(new_counts, dtype=np.uint32),
                np.array(new_sums, dtype=np.uint64))

    def _range_update(self, plan) -> PageUpdate:
        """The general case: each written page's committed range extended, checksum +=
        hash(new rows)."""
        pt = self.page_tokens
        ends: dict[int, int] = {}
        for p in plan:
            s = p.seq
            for i in range(s.num_computed // pt, (s.num_computed + p.n - 1) // pt + 1):
                ends[s.pages[i]] = min(pt, s.num_computed + p.n - i * pt)
        pages = np.fromiter(ends, dtype=np.int64, count=len(ends))
        counts = np.fromiter(ends.values(), dtype=np.int64, count=len(ends))
        starts = np.array([self.blocks.counts[p] for p in ends], dtype=np.int64)
        dev = self.device
        added = to_u64(self.checksum.ranges(torch.from_numpy(pages).to(dev), torch.from_numpy(starts).to(dev),
                                            torch.from_numpy(counts).to(dev)))
        old = np.array([self.blocks.checksums[p] for p in ends], dtype=np.uint64)
        with np.errstate(over="ignore"):
            new_checksums = old + added
        return pages, counts.astype(np.uint32), new_checksums

    def _keep(self, pages: np.ndarray, counts: np.ndarray, checksums: np.ndarray) -> None:
        """The engine's own copy of each page's committed (count, checksum)."""
        for page, count, checksum in zip(pages.tolist(), counts.tolist(), checksums.tolist()):
            self.blocks.checksums[page] = checksum
            self.blocks.counts[page] = count


class CommitProtocol:
    """Owns the commit's stage order, immediate and pipelined (see module docstring), and the
    commit left pending. `pages` is the pages stage; `blocks` the engine's page bookkeeping
    (BlockManager or the like: `free(seq)`) and `seqs` its sequences by journal slot, from
    which a released sequence is dropped; `eos` and `max_seq_len` end requests
    (finish_reason)."""
    pipelined = True            # a decode step's commit is published under the next forward

    def __init__(self, lease, journal, pages: PagesStage, blocks, seqs: dict[int, Sequence],
                 eos: frozenset[int], max_seq_len: int):
        self.pages = pages
        self.lease = lease
        self.journal = journal
        self.blocks = blocks
        self.seqs = seqs
        self.eos = eos
        self.max_seq_len = max_seq_len
        self.pending: PendingCommit | None = None
        self._published: list[int] = []         # slots published, not yet reported by the step

    # ------------------------------------------------------------------ named points of a step
    def before_cancel(self) -> bool:
        """Cancelled sequences are about to finish: publish first (their pages stay theirs until
        then). True if a pending commit was published (some sequences may have finished)."""
        if self.pending is None:
            return False
        self.publish_pending()
        return True

    def before_schedule(self) -> None:
        """Finished sequences free their pages for this schedule."""
        if self.pending is not None and self.pending.finished:
            self.publish_pending()

    def before_preempt(self) -> None:
        """The scheduler is about to take pages back (Scheduler.on_preempt)."""
        self.publish_pending()

    def before_run(self, decode_only: bool) -> None:
        """A step that is not decode-only takes the immediate path, or nothing runs: publish now."""
        if not decode_only:
            self.publish_pending()

    def after_forward(self, plan) -> None:
        """Runner hook: the forward is queued. The pages stage's hook, then the previous step's
        commit, published while this forward runs."""
        self.pages.after_forward(plan)
        self.publish_pending()

    def after_run(self) -> None:
        """The step's results are read back: publish where the runner did not call the hook."""
        self.publish_pending()

    def commit(self, plan, sampling: list[Sequence], tokens: list[int], slot_hashes: dict[int, int],
               may_defer: bool = False, logprobs=None) -> list[tuple[Sequence, FinishReason]]:
        """Commit a step: its pages at once and then the rest, or (`may_defer`: a decode-only step
        that need not be committed at once, whose pages the stage can defer) all of it left
        pending, published under the next step. `logprobs`: (of known tokens, of sampled tokens),
        each Journal.write_logprobs' arguments or None (Engine._logprobs); a step with log-probs
        of known tokens is not deferred. The step's sequences advance (advance); returns those
        that finished, for the engine to take out of its scheduler (they are released by the
        publication: at once, or with the pending commit)."""
        known, sampled = logprobs if logprobs is not None else (None, None)
        update = self.pages.defer(plan, slot_hashes) if may_defer and self.pipelined and known is None else None
        if known is not None:
            self.lease.check()
            self.journal.write_logprobs(*known)
        if update is None:
            faults.point("commit_begin")
            self.pages.publish(plan, slot_hashes)
        pages, counts, checksums = update if update is not None else (None, None, None)
        slots, positions, generated = _journal_rows(sampling)      # before the sequences advance
        finished = advance(plan, sampling, tokens, self.eos, self.max_seq_len)
        self.pending = PendingCommit(pages, counts, checksums, slots, positions,
                                     np.array(tokens, dtype=np.int32), generated, finished, sampled)
        if update is None:
            self.publish_pending()
        return finished

    def flush(self) -> list[int]:
        """Publish a pending commit now (a graceful stop); returns the slots that progressed."""
        self.publish_pending()
        return self.take_published()

    def take_published(self) -> list[int]:
        """Journal slots whose progress was published since the last call."""
        published, self._published = self._published, []
        return published

    # ------------------------------------------------------------------ stages
    def publish_pending(self) -> None:
        """Publish the commit left pending, in the commit's order; its pages are already
        published unless it carries them."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if pending.pages is not None:
            faults.point("commit_begin")
            self.pages.publish_deferred((pending.pages, pending.counts, pending.checksums))
        faults.point("commit_pages")
        if len(pending.slots):
            self.lease.check()          # fenced since the pages: a successor may own these slots now
            self.journal.commit_tokens(pending.slots, pending.positions, pending.tokens, pending.generated,
                                       pending.logprobs)
            faults.point("commit_journal")
        for seq, reason in pending.finished:
            self.release(seq, reason)
        faults.point("commit_finish")
        self._published.extend(pending.slots.tolist())

    def release(self, seq: Sequence, reason: FinishReason) -> None:
        """Stage 3 for a sequence that left the scheduler: marked finished, then its pages freed."""
        self.lease.check()
        self.journal.finish(seq.slot, reason)
        self.forget(seq)

    def forget(self, seq: Sequence) -> None:
        """A released sequence: its pages freed, the engine done with it."""
        self.blocks.free(seq)
        del self.seqs[seq.slot]


class NoCommit(CommitProtocol):
    """Benchmark baseline (what the protocol costs): the engine advances as under the protocol
    and finished sequences free their pages, but no step publishes pages or journal tokens."""

    def commit(self, plan, sampling: list[Sequence], tokens: list[int], slot_hashes: dict[int, int],
               may_defer: bool = False, logprobs=None) -> list[tuple[Sequence, FinishReason]]:
        finished = advance(plan, sampling, tokens, self.eos, self.max_seq_len)
        for seq, _ in finished:
            self.forget(seq)
        return finished


def advance(plan, sampling: list[Sequence], tokens: list[int], eos,
            max_seq_len: int) -> list[tuple[Sequence, FinishReason]]:
    """The step's sequences after it (computed counts, sampled tokens); returns those the step
    finished (finish_reason), with why."""
    for p in plan:
        p.seq.num_computed += p.n
    finished = []
    for seq, token in zip(sampling, tokens):
        seq.tokens.append(token)
        reason = finish_reason(seq, token, eos, max_seq_len)
        if reason is not None:
            finished.append((seq, reason))
    return finished


def finish_reason(req, token: int, eos, max_seq_len: int) -> FinishReason | None:
    """kvhold's rule for ending a request after its latest token `token` (`req`: a Sequence or
    a journal entry, counted with that token): a stop id, EOS unless ignore_eos, max_tokens,
    then the context length; a request whose grammar matcher failed ends with ERROR. Every engine
    kvhold drives ends requests by it. A request's min_tokens needs no rule here: its sampler
    never picks a stop id or EOS before then."""
    p = req.sampling
    grammar = getattr(req, "grammar", None)
    if grammar is not None and grammar.error:      # its matcher failed (kvhold.executor.grammar)
        return FinishReason.ERROR
    if token in p.stop_token_ids or (token in eos and not p.ignore_eos):
        return FinishReason.STOP
    if req.num_generated >= p.max_tokens:
        return FinishReason.LENGTH
    if req.num_tokens >= max_seq_len:
        return FinishReason.CONTEXT
    return None


def _journal_rows(sampling: list[Sequence]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(slots, positions, generated counts) the journal receives for the sampled tokens."""
    slots = np.array([s.slot for s in sampling], dtype=np.int64)
    positions = np.array([s.num_tokens for s in sampling], dtype=np.int64)
    generated = np.array([s.num_generated + 1 for s in sampling], dtype=np.uint32)
    return slots, positions, generated
