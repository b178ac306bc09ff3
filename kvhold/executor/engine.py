"""Engine: one step of continuous batching over kvhold's pages.

step(): take newly admitted requests from the journal, schedule, run the model, sample,
then commit. The commit's stage order (pages, journal, finished; immediate or pipelined
under the next step's forward) lives in kvhold.executor.commit: the engine asks its
CommitProtocol (`self.commits`) at named points of the step and knows nothing of the
order. The engine owns its own state: sequences, the scheduler, the counts and checksums
it keeps per page (BlockManager); the protocol's commit advances the step's sequences and
returns those that finished, which the engine takes out of its scheduler.
The device work of a step is complete before its commit (tensors are read back to the
host to compute the checksums). A token reaches a client only through the journal.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from kvhold.executor import faults, takeover
from kvhold.executor.block_manager import BlockManager
from kvhold.executor.grammar import Grammars, GrammarState
from kvhold.executor.commit import CommitProtocol, NativePages, finish_reason
from kvhold.executor.journal_tokens import JournalTokens
from kvhold.executor.kv_cache import KvCache
from kvhold.executor.llama import LlamaModel
from kvhold.executor.page_allocator import PageAllocator
from kvhold.executor.prefix_cache import PrefixCache
from kvhold.executor.recovery import NativeTakeover
from kvhold.executor.sampler import sample, token_logprobs
from kvhold.executor.step_runner import CpuRunner
from kvhold.executor.scheduler import Scheduled, Scheduler
from kvhold.executor.sequence import Sequence
from kvhold.protocol.checksum import TorchChecksum, to_u64
from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import AdmitState, FinishReason
from kvhold.protocol.leases import Lease, now_ns
from kvhold.protocol.page_table import PageTable
from kvhold.protocol.recovery_report import RecoveryReport
from kvhold.protocol.sampling import SamplingParams
from kvhold.protocol.tables import Tables

log = logging.getLogger(__name__)

# steps' token counts kept for the next StepDone (the rest of a long run of steps without one is
# not counted)
STEP_TOKENS_KEPT = 4096
# idle cached pages a takeover kept are checked this many at a time, between steps
VERIFY_BATCH_CPU = 64
VERIFY_BATCH_CUDA = 2048


class Engine:
    def __init__(self, model: LlamaModel, kv: KvCache, tables: Tables, lease: Lease,
                 max_batch: int, max_batch_tokens: int, runner=None, checksum=None,
                 prefill_chunk: int | None = None, protocol: type[CommitProtocol] = CommitProtocol,
                 prefix_salt: bytes | None = None):
        """`protocol`: the commit protocol's class (kvhold.executor.commit.NoCommit in benchmarks);
        `prefix_salt`: with a prefix cache (kvhold.executor.prefix_cache), what besides the tokens
        makes a page's KV (the weights' fingerprint, the KV dtype); None: no prefix cache."""
        self.model = model
        self.kv = kv
        self.runner = runner or CpuRunner(model, kv)
        self.tables = tables
        self.lease = lease
        self.device = model.device
        self.journal = Journal(tables)
        self.tokens_ahead: JournalTokens | None = JournalTokens(self.journal)   # a standby's, for a takeover
        self.page_table = PageTable(tables)
        self.checksum = checksum or TorchChecksum(kv.pool)
        self.page_tokens = kv.page_tokens
        self.max_seq_len = tables.geometry.max_seq_len
        self.eos = frozenset(model.spec.eos_token_ids)
        self.blocks = BlockManager(PageAllocator([]), self.page_table, self.journal,
                                   self.page_tokens, lease.epoch)
        if prefix_salt is not None:
            self.blocks.prefix = PrefixCache(prefix_salt, self.page_tokens)
        self.scheduler = Scheduler(self.blocks, max_batch, max_batch_tokens, prefill_chunk)
        self.max_batch = max_batch
        self._lp_rows = max_batch if self.device.type == "cuda" else 0   # token_logprobs' groups
        self.seqs: dict[int, Sequence] = {}          # by journal slot
        self.grammars: Grammars | None = None        # structured output (the workload sets it)
        self.quarantined: dict[int, int] = {}        # page -> epoch of a writer not yet reaped
        self.num_steps = 0
        self.num_steps_run = 0                       # steps started (the lease's open_step numbers)
        self.isolated: dict[int, int] = {}           # slot -> KV position its step must reach alone
        self.tokens_generated = 0
        self.step_tokens: list[int] = []             # tokens of each step since the runtime took them
        self._just_took_over = False
        self.takeover_trace = ""             # host timing marks of the last takeover (NativeTakeover.trace)
        self.first_step_marks: dict[str, int] = {}
        self.commits = protocol(lease, self.journal,
                                NativePages(self.blocks, self.page_table, self.checksum, lease, self.device),
                                self.blocks, self.seqs, self.eos, self.max_seq_len)
        self.scheduler.on_preempt = self.commits.before_preempt   # before the scheduler takes pages back

    # ------------------------------------------------------------------ admission
    def pending_admissions(self) -> np.ndarray:
        return self.journal.untaken_slots()

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
            seq.lp_done = self.journal.lp_done(slot, entry.request_id)     # as take() set it
            done = self.finish_reason(seq, tokens[-1]) if entry.num_prefix else None
            if done is not None:     # a moved request whose last token already ended it
                self.journal.finish(slot, done)
                continue
            self.add(seq)

    def _cache_published_pages(self) -> None:
        """Running sequences' full pages published since the last step enter the prefix cache."""
        pt = self.page_tokens
        todo = [s for s in self.scheduler.running if s.num_computed // pt > s.cached_upto]
        if todo:
            self.lease.check()
            for seq in todo:
                self.blocks.cache_full_pages(seq)

    def add(self, seq: Sequence) -> None:
        seq.eos = self.eos                    # what min_tokens keeps from ending it early
        if seq.sampling.structured is not None and seq.grammar is None:
            seq.grammar = (self.grammars.state(seq.sampling.structured, seq.request_id) if self.grammars
                           else GrammarState(None, None, seq.request_id, "this executor has no grammar engine"))
        self.seqs[seq.slot] = seq
        self.scheduler.add(seq)

    def cancel_requested(self) -> list[int]:
        cancelled = self._cancelled()
        if cancelled and self.commits.before_cancel():      # a pending commit may have finished some
            cancelled = self._cancelled()
        for slot in cancelled:
            self.finish(self.seqs[slot], FinishReason.CANCELLED)
        return cancelled

    def _cancelled(self) -> list[int]:
        if not self.seqs:
            return []
        slots = np.fromiter(self.seqs, dtype=np.int64, count=len(self.seqs))
        return self.journal.cancelled(slots).tolist()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.commits.pending is not None or len(self.pending_admissions()) > 0

    # ------------------------------------------------------------------ takeover
    def verify_cache(self, limit: int | None = None) -> int:
        """Check the checksums of up to `limit` idle cached pages a takeover kept unchecked (so
        that the recovery's path hashes only the pages requests list), once the first step after
        it has run or there is nothing to run: those that match enter the index, the others are
        freed. Returns how many were checked."""
        prefix = self.blocks.prefix
        if prefix is None or not prefix.unverified or (self._just_took_over and self.has_work):
            return 0
        limit = limit or (VERIFY_BATCH_CUDA if self.device.type == "cuda" else VERIFY_BATCH_CPU)
        pages, expected = prefix.to_verify(limit)
        self.lease.check()
        idx = torch.tensor(pages, dtype=torch.long, device=self.device)
        sums = to_u64(self.checksum.pages(idx, torch.full_like(idx, self.page_tokens)))
        intact = (sums == np.asarray(expected, dtype=np.uint64)).tolist()
        if not all(intact):
            log.warning("%d idle cached pages kept by the takeover failed their checksum: freed",
                        intact.count(False))
        self.blocks.release_unverified(pages, intact, sums)
        return len(pages)

    def reset_prefix_cache_if_asked(self) -> int | None:
        """Carry out the prefix-cache resets the frontend asked for in the tables' header
        (POST /reset_prefix_cache) since the last one done: every idle cached page leaves the
        index and is freed; pages that running requests list stay theirs. The number evicted,
        or None with nothing asked. A reset asked of an executor that died first is the
        successor's (the header keeps both counts)."""
        if self.blocks.prefix is None:
            return None
        header = self.tables.header
        asked = int(header["prefix_reset_asked"])
        if asked == int(header["prefix_reset_done"]):
            return None
        self.lease.check()
        evicted = self.blocks.reset_prefix_cache()
        header["prefix_reset_done"] = asked
        return evicted

    def take_over(self, pending_epochs, detect_ns: int = 0, isolate=()) -> RecoveryReport:
        """Continue every request a dead executor left (kvhold.executor.takeover). `isolate`:
        [request id, KV end] of requests that were in the step of a dead executor: the step of
        each that computes up to that position again runs with no other request in it."""
        self._just_took_over = True
        self.first_step_marks = {}
        strategy = self.takeover_strategy()
        report = takeover.take_over(self, strategy, pending_epochs, detect_ns)
        trace = getattr(strategy, "trace", None)
        self.takeover_trace = trace() if trace is not None else ""
        by_id = {seq.request_id: slot for slot, seq in self.seqs.items()}
        self.isolated = {by_id[rid]: int(end) for rid, end in isolate if rid in by_id}
        return report

    def takeover_strategy(self) -> takeover.TakeoverStrategy:
        """The takeover steps for where this engine's KV lives: kvhold's shared pages."""
        return NativeTakeover(self.takeover_context())

    def takeover_context(self) -> takeover.TakeoverContext:
        """What a takeover strategy works on (tables, pool, page bookkeeping)."""
        return takeover.TakeoverContext(
            journal=self.journal, page_table=self.page_table, lease=self.lease, kv=self.kv,
            checksum=self.checksum, device=self.device, page_tokens=self.page_tokens,
            prefill_chunk=self.scheduler.prefill_chunk, blocks=self.blocks, quarantined=self.quarantined)

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
        """Run one step; returns the journal slots whose progress changed. The commit protocol
        (self.commits) is asked at each named point; it alone knows the stage order."""
        self.admit()
        changed = self.cancel_requested()
        first = self._just_took_over
        t0 = now_ns()
        self.commits.before_schedule()
        if self.blocks.prefix is not None and not first:
            # a takeover's first step leaves it to the next one: resumed sequences' own full pages
            # after their cached prefix are hashed again there (their keys are not in the tables),
            # and none of them is needed before a decode-only step
            self._cache_published_pages()
        plan = self.scheduler.schedule(decode_only=first)
        if self.isolated:
            plan = self._isolate(plan)
        self._just_took_over = False
        decode_only = bool(plan) and all(p.n == 1 for p in plan)
        self.commits.before_run(decode_only)
        if not plan:
            return changed + self.commits.take_published()
        self._open_step(plan)
        sampling = [p.seq for p in plan if p.samples]
        lp_rows = self._logprob_rows(plan)
        extra = {"logprob_rows": lp_rows} if lp_rows else {}
        tokens, slot_hashes = self.runner.run_and_sample(plan, sampling, beat=self._beat,
                                                         after_forward=self.after_forward, **extra)
        self.commits.after_run()
        logprobs = self._logprobs(plan, sampling, tokens, lp_rows)
        t1, t2 = self.runner.queued_ns, now_ns()
        self.num_steps += 1
        if len(self.step_tokens) < STEP_TOKENS_KEPT:
            self.step_tokens.append(sum(p.n for p in plan))
        finished = self.commits.commit(plan, sampling, tokens, slot_hashes,   # a takeover's first step: at once
                                       may_defer=decode_only and not first and not lp_rows, logprobs=logprobs)
        for seq, _ in finished:
            self.scheduler.remove(seq)
        self.tokens_generated += len(sampling)
        self.lease.open_step(0)
        if first:   # where the first step after a takeover spends its time (recovery figures)
            self.first_step_marks = {"step_start_ns": t0, "forward_queued_ns": t1, "sampled_ns": t2,
                                     "committed_ns": now_ns()}
        return changed + self.commits.take_published()

    def _logprob_rows(self, plan: list[Scheduled]) -> list[tuple[int, int]]:
        """(plan index, KV position p) of each row this step computes whose logits give the
        log-probs of a known token (at p + 1: a prompt token, or after a pool restart a
        generated one) not yet final in the journal; a sampling row's are taken apart."""
        if self.tables.logprobs is None:
            return []
        rows = []
        for i, p in enumerate(plan):
            s = p.seq
            if s.sampling.logprobs is None and s.sampling.prompt_logprobs is None:
                continue
            start, end = max(s.num_computed, s.lp_done - 1), min(s.num_computed + p.n, s.num_tokens - 1)
            rows += [(i, pos) for pos in range(start, end) if s.logprobs_at(pos + 1) is not None]
        return rows

    def _logprobs(self, plan, sampling: list[Sequence], tokens: list[int], lp_rows):
        """The step's log-probs for the journal (the arguments of Journal.write_logprobs), of the
        raw model distribution (kvhold.executor.sampler.token_logprobs): (those of known tokens,
        written before the step's pages are published; those of the sampled tokens, written with
        them), each None if there are none. The engine's own lp_done advances here."""
        if self.tables.logprobs is None:
            return None
        known = None
        if lp_rows:
            seqs = [plan[i].seq for i, _ in lp_rows]
            positions = [pos + 1 for _, pos in lp_rows]
            k = max(s.logprobs_at(q) for s, q in zip(seqs, positions))
            lp, rank, ids, top = token_logprobs(self.runner.extra_logits,
                                                [s.tokens[q] for s, q in zip(seqs, positions)], k, self._lp_rows,
                                                with_rank=True)
            for s, q in zip(seqs, positions):
                s.lp_done = max(s.lp_done, q + 1)
            known = (np.array([s.slot for s in seqs], dtype=np.int64), np.array(positions, dtype=np.int64),
                     lp, ids, top, np.array([s.lp_done for s in seqs], dtype=np.uint32), rank)
        want = [i for i, s in enumerate(sampling) if s.sampling.logprobs is not None]
        sampled = None
        if want:
            seqs = [sampling[i] for i in want]
            k = max(s.sampling.logprobs for s in seqs)
            lp, rank, ids, top = token_logprobs(self.runner.sample_logits[want], [tokens[i] for i in want], k,
                                                self._lp_rows, with_rank=True)
            positions = [s.num_tokens for s in seqs]              # where each sampled token goes
            for s, q in zip(seqs, positions):
                s.lp_done = q + 1
            sampled = (np.array([s.slot for s in seqs], dtype=np.int64), np.array(positions, dtype=np.int64),
                       lp, ids, top, np.array([q + 1 for q in positions], dtype=np.uint32), rank)
        return None if known is None and sampled is None else (known, sampled)

    def _isolate(self, plan: list[Scheduled]) -> list[Scheduled]:
        """A request that was in a dead executor's step runs the step reaching that step's KV
        end again alone: if it dies again, the sidecar knows whose step it was. The other
        requests' pages stay allocated for their next step (the scheduler never gives back)."""
        for slot, end in list(self.isolated.items()):
            seq = self.seqs.get(slot)
            if seq is None or seq.num_computed >= end:
                del self.isolated[slot]          # finished, or past the position it died at
        for p in plan:
            end = self.isolated.get(p.seq.slot)
            if end is not None and p.seq.num_computed + p.n >= end:   # this step reaches it
                return [p]
        return plan

    def _open_step(self, plan: list[Scheduled]) -> None:
        """Name the step's requests in the journal, then open the step in the lease; a fault
        point that fires on a request's prompt (kvhold.executor.faults) comes after both."""
        self.num_steps_run += 1
        slots = np.fromiter((p.seq.slot for p in plan), dtype=np.int64, count=len(plan))
        starts = np.fromiter((p.seq.num_computed for p in plan), dtype=np.int64, count=len(plan))
        ends = starts + np.fromiter((p.n for p in plan), dtype=np.int64, count=len(plan))
        self.lease.check()
        self.journal.mark_step(slots, self.lease.epoch, self.num_steps_run, starts, ends)
        self.lease.open_step(self.num_steps_run)
        faults.batch_point("step", (p.seq.tokens[:p.seq.prompt_len] for p in plan))

    def after_forward(self, plan: list[Scheduled]) -> None:
        """Runner hook: the step's device work is queued, its results not yet read back."""
        self.commits.after_forward(plan)

    def flush(self) -> list[int]:
        """Publish a pending commit now (a graceful stop); returns the slots that progressed."""
        return self.commits.flush()

    def _beat(self) -> None:
        self.lease.beat(self.num_steps)

    def warm_up_sampler(self) -> None:
        """Load the sampling kernels before the first real step (a takeover must not pay it), at
        the shapes a step samples at: on a GPU, sampled rows go in groups of the runner's batch
        (kvhold.executor.cuda.runner), whose reductions may take other kernels than one row's."""
        vocab = self.model.lm_head.shape[0]
        rows = self.max_batch if self.device.type == "cuda" else 2
        logits = torch.randn(rows, vocab, device=self.device)
        probe = [Sequence(slot=-1, request_id=0, prompt_len=1, tokens=[0], sampling=SamplingParams(
                     max_tokens=1, seed=i, temperature=0.8 if i % 2 else 0.0, top_p=0.9, top_k=40,
                     ignore_eos=True)) for i in range(rows)]
        sample(logits, probe, pad_rows=rows if self.device.type == "cuda" else 0)
        sample(logits[:2], probe[:2])

    def finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        return finish_reason(seq, token, self.eos, self.max_seq_len)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.remove(seq)
        self.commits.release(seq, reason)
