"""Scheduler: continuous batching with chunked prefill and recompute preemption.

Each step has a token budget (max_batch_tokens) and a sequence limit (max_batch).
Running sequences go first, oldest first: a decoding sequence takes one token, a
sequence still prefilling takes its next chunk, cut at fixed positions (multiples
of prefill_chunk) so that a prompt is split the same way in every run. Since
prefill_chunk + max_batch <= max_batch_tokens, the first prefill chunk of a step
always fits after the decodes: no prompt waits forever behind decoding sequences. Waiting
sequences join as budget and free pages allow, so requests enter and leave
between any two steps. When a running sequence needs a page and none is free, the
newest running sequence is preempted: its pages are freed and it goes back to the
front of the queue with all its tokens (prompt and generated) to be recomputed
later. No request is ever dropped for lack of memory.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

from kvhold.executor.block_manager import BlockManager
from kvhold.executor.sequence import Sequence, SeqStatus


@dataclass(slots=True)
class Scheduled:
    seq: Sequence
    n: int                 # tokens computed this step

    @property
    def samples(self) -> bool:
        """The step reaches the sequence's last token: its logits give the next token."""
        return self.seq.num_computed + self.n == self.seq.num_tokens


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch: int, max_batch_tokens: int,
                 prefill_chunk: int | None = None):
        self.blocks = blocks
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self.prefill_chunk = prefill_chunk or max(1, max_batch_tokens - max_batch)
        if self.prefill_chunk + max_batch > max_batch_tokens:
            # otherwise decodes could leave too little budget for any prefill chunk: starvation
            raise ValueError(f"prefill_chunk {self.prefill_chunk} + max_batch {max_batch} exceeds "
                             f"max_batch_tokens {max_batch_tokens}")
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.on_preempt = None          # called before pages are taken back (Engine publishes its commit)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if seq.pages:
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        else:
            seq.status = SeqStatus.WAITING
            self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)

    def preempt(self, seq: Sequence) -> None:
        if self.on_preempt is not None:
            self.on_preempt()
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.blocks.journal.add_counter(seq.slot, "num_preempted", 1)

    def _chunk(self, seq: Sequence, start: int | None = None) -> int:
        """Tokens to compute next, from `start` (default: its computed tokens). Prefill chunks
        end at multiples of prefill_chunk (counted from position 0), so a prompt is always cut
        the same way whatever else is running."""
        c = self.prefill_chunk
        start = seq.num_computed if start is None else start
        return min(seq.num_tokens - start, c - start % c)

    def schedule(self, decode_only: bool = False) -> list[Scheduled]:
        """The next step's work. decode_only: just the sequences whose next token is one
        decode away (used right after a takeover, to stream again as soon as possible)."""
        if decode_only:
            plan = [Scheduled(s, 1) for s in self.running[:self.max_batch]
                    if s.num_uncomputed == 1 and self.blocks.pages_needed(s, 1) <= self.blocks.num_available]
            for p in plan:
                self.blocks.allocate(p.seq, self.blocks.pages_needed(p.seq, 1))
            if plan:
                return plan
        plan: list[Scheduled] = []
        budget = self.max_batch_tokens
        i = 0
        while i < len(self.running) and budget > 0 and len(plan) < self.max_batch:
            seq = self.running[i]
            n = self._chunk(seq)
            if n > budget:
                break
            need = self.blocks.pages_needed(seq, n)
            if not self.blocks.can_allocate(need) and self.on_preempt is not None:
                self.on_preempt()       # a pending commit's finished sequences may free enough
            while not self.blocks.can_allocate(need) and self.running[-1] is not seq:
                self.preempt(self.running[-1])
            if not self.blocks.can_allocate(need):
                self.preempt(seq)          # alone and still too big: wait for pages
                break
            self.blocks.allocate(seq, need)
            plan.append(Scheduled(seq, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(plan) < self.max_batch:
            seq = self.waiting[0]
            cached = self.blocks.cached_prefix(seq)     # a prefix cache's pages: fewer to compute
            start = len(cached) * self.blocks.page_tokens
            n = self._chunk(seq, start)
            if n > budget:
                break
            need = self.blocks.pages_needed(seq, n, start)
            if not self.blocks.can_start(cached, need):
                break                      # a waiting sequence holds no page, cached or not
            self.waiting.popleft()
            self.blocks.start_on_cached_prefix(seq, cached)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self.blocks.allocate(seq, need)
            plan.append(Scheduled(seq, n))
            budget -= n
        return plan
