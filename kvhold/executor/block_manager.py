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

import numpy as np

from kvhold.executor.page_allocator import PageAllocator
from kvhold.executor.sequence import Sequence
from kvhold.protocol.journal import Journal
from kvhold.protocol.page_table import PageTable


class CommittedPages(dict):
    """page -> one committed value (count or checksum) of each page the engine holds.

    A takeover adopts thousands of pages at once (`adopt`): their values are read from one array
    until the page is set or removed, instead of being inserted one by one (that would cost about
    a millisecond at 64 streams). Lookups (`[]`, `get`, `in`, `pop`) see adopted pages; `len` and
    iteration see only the pages set one by one."""
    __slots__ = ("_base", "_held")

    def __init__(self):
        super().__init__()
        self._base = self._held = None       # per page: adopted value, and whether still held so

    def adopt(self, pages: np.ndarray, values: np.ndarray, num_pages: int) -> None:
        if self._held is not None:           # a second adoption: the first one's pages become entries
            for page in np.flatnonzero(self._held).tolist():
                if not dict.__contains__(self, page):
                    dict.__setitem__(self, page, int(self._base[page]))
        self._base = np.zeros(num_pages, dtype=np.asarray(values).dtype)
        self._base[pages] = values
        self._held = np.zeros(num_pages, dtype=bool)
        self._held[pages] = True
        if dict.__len__(self):               # the adopted value wins over an older entry
            for page in np.asarray(pages).tolist():
                dict.pop(self, page, None)

    def _adopted(self, page) -> bool:
        held = self._held
        return held is not None and 0 <= page < len(held) and bool(held[page])

    def __missing__(self, page):
        if self._adopted(page):
            return int(self._base[page])
        raise KeyError(page)

    def get(self, page, default=None):
        try:
            return self[page]
        except KeyError:
            return default

    def __contains__(self, page) -> bool:
        return dict.__contains__(self, page) or self._adopted(page)

    def pop(self, page, *default):
        if self._adopted(page):
            self._held[page] = False
            if not dict.__contains__(self, page):
                return int(self._base[page])
        return dict.pop(self, page, *default)


class BlockManager:
    def __init__(self, allocator: PageAllocator, page_table: PageTable, journal: Journal,
                 page_tokens: int, epoch: int):
        self.allocator = allocator
        self.page_table = page_table
        self.journal = journal
        self.page_tokens = page_tokens
        self.epoch = epoch
        self.checksums = CommittedPages()      # page -> committed checksum (uint64 as int)
        self.counts = CommittedPages()         # page -> committed tokens

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
        self.record(pages, counts, checksums)
        seq.pages = list(pages)

    def record(self, pages, counts, checksums) -> None:
        """The committed (count, checksum) of pages a takeover keeps (`adopt` without a sequence)."""
        self.checksums.update(zip(pages, checksums))
        self.counts.update(zip(pages, counts))

    def record_array(self, pages: np.ndarray, counts: np.ndarray, checksums: np.ndarray) -> None:
        """`record` for many pages (distinct) at once, as arrays (CommittedPages.adopt)."""
        num_pages = self.page_table.num_pages
        self.checksums.adopt(pages, checksums, num_pages)
        self.counts.adopt(pages, counts, num_pages)

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
