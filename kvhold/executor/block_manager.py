"""BlockManager: gives sequences KV pages and records every change in shared memory.

Allocation order makes a crash at any instruction classifiable: the page record
is assigned (owner, logical index, empty) first, then the journal's page list
entry, then the list length. Freeing shortens the journal list first, then
clears the records. Recovery trusts a page only if the journal lists it and the
record agrees (owner and logical index); anything else is an orphan.
The free list itself is private (kvhold.executor.page_allocator) and rebuilt on takeover.
"""
from __future__ import annotations

import math

from kvhold.executor.page_allocator import PageAllocator
from kvhold.executor.sequence import Sequence
from kvhold.protocol.journal import Journal
from kvhold.protocol.page_table import PageTable


class BlockManager:
    def __init__(self, allocator: PageAllocator, page_table: PageTable, journal: Journal,
                 page_tokens: int, epoch: int):
        self.allocator = allocator
        self.page_table = page_table
        self.journal = journal
        self.page_tokens = page_tokens
        self.epoch = epoch
        self.checksums: dict[int, int] = {}    # page -> committed checksum (uint64 as int)
        self.counts: dict[int, int] = {}       # page -> committed tokens

    def pages_needed(self, seq: Sequence, n: int) -> int:
        return max(0, math.ceil((seq.num_computed + n) / self.page_tokens) - len(seq.pages))

    def can_allocate(self, n: int) -> bool:
        return self.allocator.can_allocate(n)

    def allocate(self, seq: Sequence, n: int) -> None:
        if n <= 0:
            return
        pages = self.allocator.allocate(n)
        first = len(seq.pages)
        self.page_table.assign(pages, seq.request_id, list(range(first, first + n)), self.epoch)
        for page in pages:
            self.checksums[page] = 0
            self.counts[page] = 0
        self.journal.set_pages(seq.slot, pages, first)
        seq.pages.extend(pages)

    def adopt(self, seq: Sequence, pages: list[int], counts: list[int], checksums: list[int]) -> None:
        """Take over pages a previous executor committed (recovery)."""
        for page, count, checksum in zip(pages, counts, checksums):
            self.checksums[page] = checksum
            self.counts[page] = count
        seq.pages = list(pages)

    def free(self, seq: Sequence) -> None:
        if not seq.pages:
            return
        self.journal.set_num_pages(seq.slot, 0)
        self.page_table.release(seq.pages)
        self.allocator.free(seq.pages)
        for page in seq.pages:
            self.checksums.pop(page, None)
            self.counts.pop(page, None)
        seq.pages = []
