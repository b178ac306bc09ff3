"""BlockManager: gives sequences KV pages and records every change in shared memory.

Allocation order makes a crash at any instruction classifiable: the page record
is assigned (owner, logical index, empty) first, then the journal's page list
entry, then the list length. Freeing shortens the journal list first, then
clears the records. Recovery trusts a page only if the journal lists it and the
record agrees (owner and logical index); anything else is an orphan.
The free list itself is private (kvhold.executor.page_allocator) and rebuilt on takeover.
With a prefix cache (kvhold.executor.prefix_cache), a sequence's full published pages enter it
(`cache_full_pages`), a new sequence starts on the cached pages of its prompt (`attach_cached`),
freeing a sequence releases only its own pages (cached ones lose a reference), and idle cached
pages are evicted, least recently used first, when the free list runs short.
"""
from __future__ import annotations

import math

import numpy as np

from kvhold.executor.page_allocator import PageAllocator
from kvhold.executor.prefix_cache import PrefixCache
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
        self.prefix: PrefixCache | None = None  # full pages shared by prompt (--enable-prefix-caching)

    def pages_needed(self, seq: Sequence, n: int, start: int | None = None) -> int:
        """New pages for `n` more tokens after its computed ones, or after `start` (a start
        on `start // page_tokens` cached pages it does not hold yet)."""
        held = len(seq.pages) if start is None else start // self.page_tokens
        start = seq.num_computed if start is None else start
        return max(0, math.ceil((start + n) / self.page_tokens) - held)

    @property
    def num_available(self) -> int:
        """Pages an allocation may take: the free ones and the idle cached ones."""
        return self.allocator.num_free + (self.prefix.evictable if self.prefix is not None else 0)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_available

    def _make_room(self, n: int) -> None:
        """Evict idle cached pages, least recently used first, until `n` pages are free."""
        short = n - self.allocator.num_free
        if short <= 0 or self.prefix is None:
            return
        self._release(self.prefix.evict(short))

    def reset_prefix_cache(self) -> int:
        """Every idle cached page out of the index and freed (vLLM's reset_prefix_cache); the
        pages running sequences list stay. The number freed."""
        if self.prefix is None:
            return 0
        pages = self.prefix.reset()
        self._release(pages)
        return len(pages)

    def release_unverified(self, pages: list[int], intact: list[bool], checksums) -> None:
        """The checks of idle cached pages a takeover kept (Engine.verify_cache): the intact
        ones enter the index, idle, with their count and checksum; the others are freed."""
        ok = [p for p, good in zip(pages, intact) if good]
        self.record(ok, [self.page_tokens] * len(ok), [int(checksums[i]) for i, good in enumerate(intact) if good])
        self._release(self.prefix.verified(pages, intact))

    def _release(self, pages: list[int]) -> None:
        """Pages no sequence lists any more back to the free list, their records cleared."""
        if not pages:
            return
        self.page_table.release(pages)
        self.allocator.free(pages)
        for page in pages:
            self.checksums.pop(page, None)
            self.counts.pop(page, None)

    def allocate(self, seq: Sequence, n: int) -> None:
        if n <= 0:
            return
        self._make_room(n)
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

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached pages a sequence about to start (no pages) would start on: the longest
        cached prefix of its full pages, all but its last token's (its logits give the next
        token); none for a request asking for its prompt's log-probs (they come from its
        prefill's rows). Nothing is taken: `start_on_cached_prefix` takes them once the
        scheduler knows the sequence fits."""
        if self.prefix is None or seq.pages or seq.sampling.prompt_logprobs is not None:
            return []
        n = (seq.num_tokens - 1) // self.page_tokens
        return self.prefix.find(self.prefix.keys(seq.tokens, n, seq.page_keys)) if n > 0 else []

    def can_start(self, cached: list[int], need: int) -> bool:
        """Whether `need` new pages fit beside a start on `cached` (idle ones among them stop
        being evictable once taken)."""
        taken = self.prefix.num_idle(cached) if cached else 0
        return need <= self.num_available - taken

    def start_on_cached_prefix(self, seq: Sequence, cached: list[int]) -> None:
        """The sequence starts on the pages `cached_prefix` found (the hit-rate figures count
        its prompt once per start)."""
        if self.prefix is None:
            return
        self.prefix.use(cached, seq.num_tokens)
        if cached:
            self.attach_cached(seq, cached)

    def attach_cached(self, seq: Sequence, pages: list[int]) -> None:
        """A sequence starts on cached pages (PrefixCache.use referenced them): listed in its
        journal row as its first pages, their KV computed."""
        self.journal.set_pages(seq.slot, pages, 0)
        seq.pages = list(pages)
        seq.cached_upto = len(pages)
        seq.num_computed = len(pages) * self.page_tokens
        if not seq.num_cached:            # usage's cached_tokens: what its first start found
            seq.num_cached = seq.num_computed
            self.journal.set_cached_tokens(seq.slot, seq.num_cached)

    def cache_full_pages(self, seq: Sequence) -> None:
        """The sequence's full pages whose count and checksum are published enter the prefix
        cache, in order from its first page not looked at yet (a page whose key is cached
        already stays the sequence's own). The caller has checked the lease."""
        prefix, pt = self.prefix, self.page_tokens
        full = min(seq.num_computed // pt, len(seq.pages))
        start = seq.cached_upto
        if prefix is None or full <= start:
            return
        counts = self.page_table.pages["num_tokens"][seq.pages[start:full]]
        published = start + int(np.argmin(counts == pt)) if (counts != pt).any() else full
        if published <= start:
            return
        keys = prefix.keys(seq.tokens, published, seq.page_keys)
        new, new_keys = [], []
        for k in range(start, published):
            page = seq.pages[k]
            if not prefix.is_cached(page) and prefix.insert(keys[k], page):
                new.append(page)
                new_keys.append(keys[k])
        if new:
            self.page_table.mark_cached(new, new_keys)
        seq.cached_upto = published

    def free(self, seq: Sequence) -> None:
        if not seq.pages:
            return
        if self.prefix is not None:
            self.cache_full_pages(seq)          # what it computed stays for the next request
        self.journal.set_num_pages(seq.slot, 0)
        own = seq.pages
        if self.prefix is not None:
            own = [p for p in seq.pages if not self.prefix.is_cached(p)]
            self.prefix.unref([p for p in seq.pages if self.prefix.is_cached(p)])
        self._release(own)
        seq.pages = []
        seq.cached_upto = 0
