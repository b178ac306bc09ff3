"""Page table operations: the seqlock-protected record of each KV page.

One writer (the active executor) at a time. Each write makes the version odd,
changes the record, then makes the version even; a writer killed in between
leaves an odd version, which recovery treats as "interrupted": the page is kept
only if the checksum of its committed bytes still matches (see kvhold.protocol.validation).
Readers that race a live writer use `snapshot`, which retries until it sees an
even, unchanged version.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvhold.protocol.layout import PageFlag
from kvhold.protocol.tables import Tables


@dataclass(frozen=True, slots=True)
class PageRecord:
    version: int
    owner: int
    logical: int
    num_tokens: int
    checksum: int
    flags: int
    epoch: int

    @property
    def writing(self) -> bool:
        return bool(self.version & 1)


# Called by `publish` between its count and checksum writes where set: crash tests die there
# (the `publish_counts` fault point of kvhold.executor.faults).
between_count_and_checksum = None


class PageTable:
    def __init__(self, tables: Tables):
        self.tables = tables
        self.pages = tables.pages
        self.num_pages = len(tables.pages)
        self.page_tokens = tables.geometry.kv.page_tokens

    # ------------------------------------------------------------------ writer
    def _begin(self, idx):
        v = self.pages["version"][idx]
        self.pages["version"][idx] = v + 1
        return v

    def _end(self, idx, v):
        self.pages["version"][idx] = v + 2

    def assign(self, idx, owner, logical, epoch: int) -> None:
        """Give pages to a request (owner id) at logical positions, empty."""
        idx = np.asarray(idx, dtype=np.int64)
        v = self._begin(idx)
        p = self.pages
        p["owner"][idx] = owner
        p["logical"][idx] = logical
        p["num_tokens"][idx] = 0
        p["checksum"][idx] = 0
        p["flags"][idx] = PageFlag.NONE
        p["epoch"][idx] = epoch
        self._end(idx, v)

    def publish(self, idx, num_tokens, checksums, epoch: int) -> None:
        """Commit new (num_tokens, checksum) pairs: the KV bytes they cover are final."""
        idx = np.asarray(idx, dtype=np.int64)
        v = self._begin(idx)
        self.pages["num_tokens"][idx] = num_tokens
        if between_count_and_checksum is not None:
            between_count_and_checksum()
        self.pages["checksum"][idx] = checksums
        self.pages["epoch"][idx] = epoch
        self._end(idx, v)

    def mark_cached(self, idx, keys) -> None:
        """Full, published pages enter the prefix cache (kvhold.executor.prefix_cache): their key
        becomes the owner, CACHED is set; count, checksum, logical index and epoch stay."""
        idx = np.asarray(idx, dtype=np.int64)
        v = self._begin(idx)
        self.pages["owner"][idx] = np.asarray(keys, dtype=np.uint64)
        self.pages["flags"][idx] |= self.pages.dtype["flags"].type(PageFlag.CACHED)
        self._end(idx, v)

    def restore_owners(self, idx, owners) -> None:
        """A takeover's repair of pages whose entry into the prefix cache (`mark_cached`) its
        writer's death interrupted after the key replaced the owner and before CACHED was set:
        the requests that list them own them again (count, checksum, logical index, epoch and
        flags unchanged), so that a later takeover reads them as it did."""
        idx = np.asarray(idx, dtype=np.int64)
        v = self._begin(idx)
        self.pages["owner"][idx] = np.asarray(owners, dtype=np.uint64)
        self._end(idx, v)

    def set_counts(self, idx, num_tokens) -> None:
        """Cut records to `num_tokens` committed rows, checksum and writer epoch unchanged: a
        takeover keeping the rows that a torn publish had committed before (their recorded
        checksum covers exactly those), so that a later takeover reads the same."""
        idx = np.asarray(idx, dtype=np.int64)
        v = self._begin(idx)
        self.pages["num_tokens"][idx] = num_tokens
        self._end(idx, v)

    def mark_bad(self, idx) -> None:
        """Flag pages a takeover found untrustworthy. Their writer's epoch stays in the record:
        a fenced writer may still be writing them until its exit is confirmed, and whichever
        takeover clears them quarantines them under that epoch."""
        idx = np.asarray(idx, dtype=np.int64)
        v = self._begin(idx)
        self.pages["flags"][idx] |= self.pages.dtype["flags"].type(PageFlag.BAD)
        self._end(idx, v)

    def _clear(self, idx, flags: PageFlag) -> None:
        idx = np.asarray(idx, dtype=np.int64)
        v = self._begin(idx)
        p = self.pages
        p["owner"][idx] = 0
        p["num_tokens"][idx] = 0
        p["checksum"][idx] = 0
        p["flags"][idx] = flags
        self._end(idx, v)

    def release(self, idx) -> None:
        self._clear(idx, PageFlag.NONE)

    def quarantine(self, idx) -> None:
        """Take pages out of use without reusing them: a fenced writer (epoch kept in the
        record) may still be writing them. Freed by `release` once its exit is confirmed."""
        self._clear(idx, PageFlag.QUARANTINED)

    def repair_versions(self, idx) -> None:
        """Make interrupted (odd) versions even again; only after the writer is fenced."""
        idx = np.asarray(idx, dtype=np.int64)
        self.pages["version"][idx] |= np.uint64(1)
        self.pages["version"][idx] += np.uint64(1)

    # ------------------------------------------------------------------ readers
    def record(self, i: int) -> PageRecord:
        r = self.pages[i]
        return PageRecord(version=int(r["version"]), owner=int(r["owner"]),
                          logical=int(r["logical"]), num_tokens=int(r["num_tokens"]),
                          checksum=int(r["checksum"]), flags=int(r["flags"]), epoch=int(r["epoch"]))

    def records(self) -> np.ndarray:
        """A plain copy of every record, for a reader that fenced the only writer (a takeover):
        nothing changes them meanwhile, and odd versions are interrupted writes to repair."""
        return self.pages.copy()

    def snapshot(self, retries: int = 100) -> np.ndarray:
        """A consistent copy of the whole table while a writer may be live.

        Records still changing after `retries` passes keep their last (odd) version,
        so callers see them as being written.
        """
        snap = self.pages.copy()
        for _ in range(retries):
            again = self.pages["version"].copy()
            unstable = (again != snap["version"]) | (again & 1).astype(bool)
            if not unstable.any():
                break
            idx = unstable.nonzero()[0]
            snap[idx] = self.pages[idx]
            recheck = self.pages["version"][idx]
            settled = (recheck == snap["version"][idx]) & ~(recheck & 1).astype(bool)
            if settled.all():
                break
        return snap

    def quarantined_epochs(self) -> set[int]:
        """The writer epochs the quarantined pages are held for."""
        quarantined = (self.pages["flags"] & PageFlag.QUARANTINED) != 0
        return {int(e) for e in self.pages["epoch"][quarantined]}

    def counts(self) -> dict[str, int]:
        """Pages by state; the states add up to `total`. `cached`: prefix-cache pages
        (kvhold.executor.prefix_cache) that no live request lists, kept only to be found again
        and evicted first when the pool needs room (vLLM counts such blocks as free); a cached
        page that requests list is `committed`, once however many list it."""
        snap = self.snapshot()
        writing = (snap["version"] & 1).astype(bool)
        owned = snap["owner"] != 0
        bad = (snap["flags"] & PageFlag.BAD).astype(bool)
        quarantined = (snap["flags"] & PageFlag.QUARANTINED).astype(bool)
        committed = owned & ~writing & ~bad & ~quarantined
        cached = committed & (snap["flags"] & PageFlag.CACHED).astype(bool)
        if cached.any():
            cached[self.listed_pages()] = False
        return {
            "total": self.num_pages,
            "free": int((~owned & ~writing & ~quarantined).sum()),
            "committed": int((committed & ~cached).sum()),
            "cached": int(cached.sum()),
            "writing": int(writing.sum()),
            "quarantined": int(quarantined.sum()),
            "bad": int(bad.sum()),
        }

    def listed_pages(self) -> np.ndarray:
        """Every page that a live request's journal page list holds (repeats included); read
        without a lock, for counts."""
        req = self.tables.requests
        live = np.flatnonzero((req["request_id"] != 0) & (req["exec_request_id"] == req["request_id"]))
        if not len(live):
            return np.zeros(0, dtype=np.int64)
        n = np.minimum(req["num_pages"][live].astype(np.int64), self.tables.page_lists.shape[1])
        lists = self.tables.page_lists[live]
        pages = lists[np.arange(lists.shape[1])[None, :] < n[:, None]].astype(np.int64)
        return pages[(pages >= 0) & (pages < self.num_pages)]

    def interrupted_pages(self) -> np.ndarray:
        """Indices of pages whose last write did not finish (odd version)."""
        return ((self.pages["version"] & 1) == 1).nonzero()[0]

    def owned_pages(self) -> np.ndarray:
        """Indices of pages that belong to a request."""
        return (self.pages["owner"] != 0).nonzero()[0]

    def unowned_pages(self) -> np.ndarray:
        """Indices of pages that belong to no request (free, or quarantined)."""
        return (self.pages["owner"] == 0).nonzero()[0]
