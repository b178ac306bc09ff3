"""PageAllocator: the executor's O(1) free list of KV pages. Knows nothing of torch.

The page table in shared memory is the truth; this free list is a private cache
of it, rebuilt from the table whenever an executor takes over (`from_table`).
Allocation pops from a stack, freeing pushes: O(1) per page. Page 0 is the null
page: never allocated, it absorbs the writes of padding rows (kvhold.executor.cuda.runner).
"""
from __future__ import annotations

from typing import Iterable

import numpy as np


NULL_PAGE = 0


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, free_pages: Iterable[int]):
        self._free: list[int] = sorted(int(p) for p in free_pages)[::-1]  # low ids popped first
        self._is_free = set(self._free)

    @classmethod
    def from_sorted(cls, free_pages) -> "PageAllocator":
        """From free page ids already unique and ascending (a numpy array: a takeover's mask)."""
        self = cls.__new__(cls)
        self._free = np.asarray(free_pages, dtype=np.int64)[::-1].tolist()   # low ids popped first
        self._is_free = set(self._free)
        return self

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._is_free.difference_update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        for p in pages:
            p = int(p)
            if p in self._is_free:
                raise RuntimeError(f"page {p} freed twice")
            self._free.append(p)
            self._is_free.add(p)
