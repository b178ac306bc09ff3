"""The churn workload: synthetic KV traffic through the real page-table protocol.

No model and no torch: the active executor keeps allocating pages, writing
pseudo-random KV rows one token slot at a time into shared memory, publishing
(count, checksum) under the seqlock exactly as the engine does, and freeing full
pages. Crash tests kill it at arbitrary instructions and then check that every
page is still classifiable: free, committed and matching its checksum, or
interrupted (odd version). A committed page whose bytes do not match would mean
the commit protocol is broken.
"""
from __future__ import annotations

import logging

import numpy as np

from kvhold.executor import faults
from kvhold.executor.workload import WorkloadBase
from kvhold.protocol.checksum import words_checksum_np
from kvhold.protocol.page_table import PageTable
from kvhold.protocol.recovery_report import RecoveryReport

log = logging.getLogger(__name__)


class ChurnWorkload(WorkloadBase):
    def __init__(self, ctx):
        super().__init__(ctx)
        g = ctx.tables.geometry
        self.page_tokens = g.kv.page_tokens
        shape = (g.num_pages, g.kv.num_layers, 2, g.kv.page_tokens, g.kv.row_bytes // 8)
        self.words = ctx.mappings["kv"].numpy(np.uint64, shape)     # the checksum's 64-bit words
        self.index = np.arange(int(np.prod(shape[1:])), dtype=np.uint64).reshape(shape[1:])
        self.page_table = PageTable(ctx.tables)
        self.rng = np.random.default_rng()
        self.owned: dict[int, tuple[int, int]] = {}   # page -> (num_tokens, checksum)
        self.counter = 0

    def promote(self, msg) -> RecoveryReport:
        """Take the table over: repair interrupted versions, free every page (no requests)."""
        odd = self.page_table.interrupted_pages()
        self.page_table.repair_versions(odd)
        owned = self.page_table.owned_pages()
        self.page_table.release(owned)
        log.info("took over the page table: %d interrupted records repaired, %d pages released",
                 len(odd), len(owned))
        return RecoveryReport(pages_interrupted=int(len(odd)))

    def has_work(self) -> bool:
        return True

    def _allocate(self) -> None:
        free = self.page_table.unowned_pages()
        if not len(free):
            return
        page = int(free[self.rng.integers(len(free))])
        self.counter += 1
        self.ctx.lease.check()
        self.page_table.assign([page], (self.ctx.epoch << 32) | self.counter, 0, self.ctx.epoch)
        self.owned[page] = (0, 0)

    def step(self) -> list[int]:
        if len(self.owned) < 4 or self.rng.random() < 0.05:
            self._allocate()
        open_pages = [p for p, (n, _) in self.owned.items() if n < self.page_tokens]
        if not open_pages:
            return []
        page = open_pages[self.rng.integers(len(open_pages))]
        n, checksum = self.owned[page]
        rows = self.words[page, :, :, n, :]
        rows[...] = self.rng.integers(0, 2**64, size=rows.shape, dtype=np.uint64)
        faults.point("churn_data")
        checksum = (checksum + words_checksum_np(rows, self.index[:, :, n, :])) % (1 << 64)
        self.ctx.lease.check()
        self.page_table.publish([page], n + 1, checksum, self.ctx.epoch)
        faults.point("churn_published")
        self.owned[page] = (n + 1, checksum)
        if n + 1 == self.page_tokens and self.rng.random() < 0.5:
            self.page_table.release([page])
            del self.owned[page]
        return []
