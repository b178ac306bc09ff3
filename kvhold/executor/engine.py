"""Engine: one step of continuous batching, and the commit protocol of DESIGN.md s3.

step(): take newly admitted requests from the journal, schedule, run the model,
sample, then commit in this order, each stage published before the next begins:
  1. KV pages: for every page written this step, (count, checksum) under the seqlock;
     the checksum grows by the hash of the newly written token slots only;
  2. journal: each sampled token stored, then its request's generated count bumped;
  3. finished requests marked finished, then their pages freed.
The device work of the step is complete before stage 1 (tensors are read back to
the host to compute the checksums). A token reaches a client only through the
journal, i.e. after stage 2. Fault points mark the stage boundaries for crash tests.
A decode-only step publishes its commit while the next step's forward runs
(kvhold.executor.pending_commit): same stages, same order, the GPU kept busy.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from kvhold.executor import faults, takeover
from kvhold.executor.block_manager import BlockManager
from kvhold.executor.kv_cache import KvCache
from kvhold.executor.llama import LlamaModel
from kvhold.executor.page_allocator import PageAllocator
from kvhold.executor.pending_commit import PendingCommit
from kvhold.executor.recovery import NativeTakeover
from kvhold.executor.sampler import sample
from kvhold.executor.step_runner import CpuRunner
from kvhold.executor.scheduler import Scheduled, Scheduler
from kvhold.executor.sequence import Sequence
from kvhold.protocol.checksum import TorchChecksum, to_u64
from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import AdmitState, FinishReason
from kvhold.protocol.leases import Lease, now_ns
from kvhold.protocol.page_table import PageTable
from kvhold.protocol.recovery_report import RecoveryReport
from kvhold.protocol.tables import Tables

log = logging.getLogger(__name__)
_M64 = (1 << 64) - 1


class Engine:
    defer_publish = True        # a decode step's commit is published under the next forward

    def __init__(self, model: LlamaModel, kv: KvCache, tables: Tables, lease: Lease,
                 max_batch: int, max_batch_tokens: int, runner=None, checksum=None,
                 prefill_chunk: int | None = None, commit: bool = True):
        self.model = model
        self.kv = kv
        self.runner = runner or CpuRunner(model, kv)
        self.tables = tables
        self.lease = lease
        self.device = model.device
        self.journal = Journal(tables)
        self.page_table = PageTable(tables)
        self.checksum = checksum or TorchChecksum(kv.pool)
        self.page_tokens = kv.page_tokens
        self.max_seq_len = tables.geometry.max_seq_len
        self.eos = frozenset(model.spec.eos_token_ids)
        self.blocks = BlockManager(PageAllocator([]), self.page_table, self.journal,
                                   self.page_tokens, lease.epoch)
        self.scheduler = Scheduler(self.blocks, max_batch, max_batch_tokens, prefill_chunk)
        self.seqs: dict[int, Sequence] = {}          # by journal slot
        self.quarantined: dict[int, int] = {}        # page -> epoch of a writer not yet reaped
        self.num_steps = 0
        self.tokens_generated = 0
        self.commit = commit      # False only in tools/bench_decode: measures what the protocol costs
        self._just_took_over = False
        self.first_step_marks: dict[str, int] = {}
        self._slot_hashes: dict[int, int] = {}     # page -> hash of the slot the runner saw written
        self._pending: PendingCommit | None = None
        self._published: list[int] = []            # slots a pending commit published, not yet reported
        self.scheduler.on_preempt = self.publish_pending   # before the scheduler takes pages back

    # ------------------------------------------------------------------ admission
    def pending_admissions(self) -> np.ndarray:
        r = self.tables.requests
        untaken = (r["admit_state"] != AdmitState.FREE) & (r["exec_request_id"] != r["request_id"])
        return untaken.nonzero()[0]

    def admit(self) -> None:
        for slot in self.pending_admissions():
            slot = int(slot)
            entry = self.journal.entry(slot)
            self.lease.check()
            self.journal.take(slot, entry.request_id, self.lease.epoch)
            if entry.admit_state == AdmitState.CANCELLED:
                self.journal.finish(slot, FinishReason.CANCELLED)
                continue
            tokens = self.journal.all_tokens(slot, entry.prompt_len + entry.num_prefix).tolist()
            seq = Sequence.from_journal(entry, tokens)
            done = self.finish_reason(seq, tokens[-1]) if entry.num_prefix else None
            if done is not None:     # a moved request whose last token already ended it
                self.journal.finish(slot, done)
                continue
            self.add(seq)

    def add(self, seq: Sequence) -> None:
        self.seqs[seq.slot] = seq
        self.scheduler.add(seq)

    def cancel_requested(self) -> list[int]:
        cancelled = self._cancelled()
        if cancelled and self._pending is not None:
            self.publish_pending()                  # its sequences' pages stay theirs until then
            cancelled = self._cancelled()
        for slot in cancelled:
            self.finish(self.seqs[slot], FinishReason.CANCELLED)
        return cancelled

    def _cancelled(self) -> list[int]:
        if not self.seqs:
            return []
        slots = np.fromiter(self.seqs, dtype=np.int64, count=len(self.seqs))
        return slots[self.tables.requests["admit_state"][slots] == AdmitState.CANCELLED].tolist()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._pending is not None or len(self.pending_admissions()) > 0

    # ------------------------------------------------------------------ takeover
    def take_over(self, pending_epochs, detect_ns: int = 0) -> RecoveryReport:
        """Continue every request a dead executor left (kvhold.executor.takeover)."""
        self._just_took_over = True
        self.first_step_marks = {}
        return takeover.take_over(self, self.takeover_strategy(), pending_epochs, detect_ns)

    def takeover_strategy(self) -> takeover.TakeoverStrategy:
        """The takeover steps for where this engine's KV lives: kvhold's shared pages."""
        return NativeTakeover(self)

    def release_quarantined(self, epochs) -> int:
        """The writers of these epochs have exited: their quarantined pages are free again."""
        epochs = set(epochs)
        pages = [p for p, e in self.quarantined.items() if e in epochs]
        if pages:
            self.page_table.release(pages)
            self.blocks.allocator.free(pages)
            for p in pages:
                del self.quarantined[p]
        return len(pages)

    # ------------------------------------------------------------------ step
    def step(self) -> list[int]:
        """Run one step; returns the journal slots whose progress changed."""
        self.admit()
        changed = self.cancel_requested()
        first = self._just_took_over
        t0 = now_ns()
        if self._pending is not None and self._pending.finished:
            self.publish_pending()      # finished sequences free their pages for this schedule
        plan = self.scheduler.schedule(decode_only=first)
        self._just_took_over = False
        decode_only = bool(plan) and all(p.n == 1 for p in plan)
        if not decode_only:
            self.publish_pending()      # the general commit path follows, or nothing runs
        if not plan:
            return changed + self._take_published()
        sampling = [p.seq for p in plan if p.samples]
        tokens, self._slot_hashes = self.runner.run_and_sample(plan, sampling, beat=self._beat,
                                                               after_forward=self._forward_queued)
        self.publish_pending()          # where the runner did not call the hook
        t1, t2 = self.runner.queued_ns, now_ns()
        self.num_steps += 1
        self._commit(plan, sampling, tokens, defer=self.defer_publish and decode_only and not first)
        if first:   # where the first step after a takeover spends its time (recovery figures)
            self.first_step_marks = {"step_start_ns": t0, "forward_queued_ns": t1, "sampled_ns": t2,
                                     "committed_ns": now_ns()}
        return changed + self._take_published()

    def _forward_queued(self, plan: list[Scheduled]) -> None:
        self.after_forward(plan)
        self.publish_pending()          # the previous step's commit, while this forward runs

    def flush(self) -> list[int]:
        """Publish a pending commit now (a graceful stop); returns the slots that progressed."""
        self.publish_pending()
        return self._take_published()

    def _take_published(self) -> list[int]:
        published, self._published = self._published, []
        return published

    def after_forward(self, plan: list[Scheduled]) -> None:
        """Runner hook: the step's device work is queued, its results not yet read back (the
        foreign-pool engine queues its KV mirror copy here, kvhold.executor.foreign_pool)."""

    def publish_pending(self) -> None:
        """Publish the commit left pending (kvhold.executor.pending_commit), in the commit's order;
        its pages are already published unless it carries them."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.pages is not None:
            faults.point("commit_begin")
            self.lease.check()
            self.page_table.publish(pending.pages, pending.counts, pending.checksums, self.lease.epoch)
        faults.point("commit_pages")
        if len(pending.slots):
            self.lease.check()          # fenced since the pages: a successor may own these slots now
            self.journal.commit_tokens(pending.slots, pending.positions, pending.tokens, pending.generated)
            faults.point("commit_journal")
        for seq, reason in pending.finished:
            self._release(seq, reason)
        faults.point("commit_finish")
        self._published.extend(pending.slots.tolist())

    # ------------------------------------------------------------------ commit
    def _commit(self, plan: list[Scheduled], sampling: list[Sequence], tokens: list[int],
                defer: bool = False) -> None:
        """Commit the step: the pages at once and then the rest, or (`defer`, a decode step
        whose slots the runner hashed) all of it left pending, published under the next
        step's forward (kvhold.executor.pending_commit)."""
        if not self.commit:                     # benchmark baseline: nothing published
            for seq, _ in self._advance(plan, sampling, tokens).finished:
                self.blocks.free(seq)
                del self.seqs[seq.slot]
            return
        hashes = self._slot_hashes
        update = self._slot_update(plan, hashes) if defer and len(hashes) == len(plan) else None
        if update is None:
            faults.point("commit_begin")
            self._publish_pages(plan)
        else:
            self._slot_hashes = {}
            self._keep(*update)
        self._pending = self._advance(plan, sampling, tokens, update)
        if update is None:
            self.publish_pending()

    def _advance(self, plan: list[Scheduled], sampling: list[Sequence], tokens: list[int],
                 update=None) -> PendingCommit:
        """The engine's own state after the step (counts, tokens; finished sequences leave the
        scheduler), and what the journal is to receive."""
        for p in plan:
            p.seq.num_computed += p.n
        slots = np.array([s.slot for s in sampling], dtype=np.int64)
        positions = np.array([s.num_tokens for s in sampling], dtype=np.int64)
        generated = np.array([s.num_generated + 1 for s in sampling], dtype=np.uint32)
        finished = []
        for seq, token in zip(sampling, tokens):
            seq.tokens.append(token)
            reason = self.finish_reason(seq, token)
            if reason is not None:
                self.scheduler.remove(seq)          # released (pages freed) once published
                finished.append((seq, reason))
        self.tokens_generated += len(sampling)
        pages, counts, checksums = update if update is not None else (None, None, None)
        return PendingCommit(pages, counts, checksums, slots, positions, np.array(tokens, dtype=np.int32),
                             generated, finished)

    def _publish_pages(self, plan: list[Scheduled]) -> None:
        """Extend each written page's committed range: count, and checksum += hash(new rows)."""
        hashes, self._slot_hashes = self._slot_hashes, {}
        if len(hashes) == len(plan) and self._publish_slots(plan, hashes):
            return
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
        self.lease.check()
        self.page_table.publish(pages, counts.astype(np.uint32), new_checksums, self.lease.epoch)
        self._keep(pages, counts, new_checksums)

    def _publish_slots(self, plan: list[Scheduled], hashes: dict[int, int]) -> bool:
        """The decode-step case of _publish_pages: each row wrote the next slot of one page and
        the runner hashed it. Returns False (nothing published) if a row does not fit that."""
        update = self._slot_update(plan, hashes)
        if update is None:
            return False
        self.lease.check()
        self.page_table.publish(*update, self.lease.epoch)
        self._keep(*update)
        return True

    def _slot_update(self, plan: list[Scheduled], hashes: dict[int, int]):
        """(pages, counts, checksums) a decode step's commit publishes, or None if a row did not
        write the next slot of one page, hashed by the runner."""
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

    def _keep(self, pages: np.ndarray, counts: np.ndarray, checksums: np.ndarray) -> None:
        """The engine's own copy of each page's committed (count, checksum)."""
        for page, count, checksum in zip(pages.tolist(), counts.tolist(), checksums.tolist()):
            self.blocks.checksums[page] = checksum
            self.blocks.counts[page] = count

    def _beat(self) -> None:
        self.lease.beat(self.num_steps)

    def warm_up_sampler(self) -> None:
        """Load the sampling kernels before the first real step (a takeover must not pay it)."""
        vocab = self.model.lm_head.shape[0]
        logits = torch.randn(2, vocab, device=self.device)
        probe = [Sequence(slot=-1, request_id=0, prompt_len=1, tokens=[0], max_tokens=1, seed=1,
                          temperature=t, top_p=0.9, top_k=40, stop_ids=frozenset(), ignore_eos=True)
                 for t in (0.0, 0.8)]
        sample(logits, probe)

    def finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        if token in seq.stop_ids or (token in self.eos and not seq.ignore_eos):
            return FinishReason.STOP
        if seq.num_generated >= seq.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.max_seq_len:
            return FinishReason.CONTEXT
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.remove(seq)
        self._release(seq, reason)

    def _release(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark a sequence that left the scheduler finished, then free its pages."""
        self.lease.check()
        self.journal.finish(seq.slot, reason)
        self.blocks.free(seq)
        del self.seqs[seq.slot]
