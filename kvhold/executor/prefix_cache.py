"""PrefixCache: full KV pages shared by the requests whose tokens they hold.

A full page is known by a key chained over the pages before it: key(i) = H(key(i-1), the
page's token ids), key(-1) = H(salt), where the salt is everything else that changes the KV
(the weights' fingerprint and the KV dtype). H is BLAKE2b cut to 64 bits, never 0 (0 is a
free page's owner). Two requests whose first k pages hold the same tokens have the same k keys,
and the second one's prefill starts after the pages it finds.

The index lives in the shared tables: a cached page's record (kvhold.protocol.page_table,
`mark_cached`) has the CACHED flag, its key as owner, its place in the prefix as logical
index, a full count and a published checksum. A request that uses it lists it in its journal
page list like any page of its own; it never writes it again (a request writes only pages past
its computed tokens). This class is the active executor's private view of that index, as
PageAllocator is of the free list: key -> page, how many live sequences list each page, and the
pages no sequence lists in least-recently-used order, which are evicted first when the pool
needs room. A takeover rebuilds it from the records it validated (`rebuild`).
"""
from __future__ import annotations

import collections
import hashlib
import itertools
from typing import Iterable, Sequence

import numpy as np

_MASK = (1 << 64) - 1


def _as_keys(keys) -> np.ndarray:
    """Keys as uint64 (a record's owner; a negative int64 wraps as `& _MASK` would)."""
    keys = np.asarray(keys)
    if keys.dtype == object:
        return np.array([int(k) & _MASK for k in keys], dtype=np.uint64)
    return keys.astype(np.uint64)


def root_key(salt: bytes) -> int:
    return _key(hashlib.blake2b(salt, digest_size=8).digest())


def _key(digest: bytes) -> int:
    return int.from_bytes(digest, "little") or 1


def chain_keys(parent: int, tokens: Sequence[int], page_tokens: int, n_pages: int) -> list[int]:
    """The keys of `n_pages` full pages of `tokens` (page 0 is tokens[:page_tokens]), chained
    from `parent` (the root key, or the key of the page before tokens[0])."""
    data = np.asarray(tokens[:n_pages * page_tokens], dtype="<i4").tobytes()
    step = page_tokens * 4
    out = []
    for i in range(n_pages):
        h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
        h.update(data[i * step:(i + 1) * step])
        parent = _key(h.digest())
        out.append(parent)
    return out


class PrefixCache:
    def __init__(self, salt: bytes, page_tokens: int):
        self.root = root_key(salt)
        self.page_tokens = page_tokens
        self.by_key: dict[int, int] = {}                 # key -> page
        self.key_of: dict[int, int] = {}                 # page -> key
        self.refs: dict[int, int] = {}                   # page -> sequences listing it (cached pages)
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()   # unreferenced, LRU first
        # idle pages a takeover kept but has not checked: page -> (key, recorded checksum); not
        # found by lookups, evicted before any idle page, indexed by `verified`
        self.unverified: dict[int, tuple[int, int]] = {}
        self.queries = 0                                 # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0                                    # of those, found cached (prefix_cache_hits)

    # ------------------------------------------------------------------ keys
    def keys(self, tokens: Sequence[int], n_pages: int, known: list[int] | None = None) -> list[int]:
        """The chained keys of the first `n_pages` full pages of `tokens`; `known`: keys already
        computed for its first pages (extended in place and returned)."""
        known = [] if known is None else known
        if len(known) < n_pages:
            parent = known[-1] if known else self.root
            pt = self.page_tokens
            known.extend(chain_keys(parent, tokens[len(known) * pt:], pt, n_pages - len(known)))
        return known[:n_pages]

    # ------------------------------------------------------------------ lookups
    def find(self, keys: Iterable[int]) -> list[int]:
        """The pages of the longest cached prefix of these keys; nothing is taken (`use` does)."""
        pages = []
        for key in keys:
            page = self.by_key.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def use(self, pages: list[int], tokens: int) -> None:
        """A sequence starts on these found pages (referenced: it lists them); `tokens` is how
        many prompt tokens it looked up (the hit-rate figures)."""
        self.queries += tokens
        self.hits += len(pages) * self.page_tokens
        self.ref(pages)

    def lookup(self, keys: Iterable[int], tokens: int) -> list[int]:
        """`find`, then `use` what it found."""
        pages = self.find(keys)
        self.use(pages, tokens)
        return pages

    def num_idle(self, pages: Iterable[int]) -> int:
        """How many of these pages are idle (an allocation could evict them)."""
        return sum(1 for page in pages if page in self.idle)

    def is_cached(self, page: int) -> bool:
        return page in self.key_of

    def ref(self, pages: Iterable[int]) -> None:
        for page in pages:
            self.refs[page] = self.refs.get(page, 0) + 1
            self.idle.pop(page, None)

    def unref(self, pages: Iterable[int]) -> None:
        """A sequence no longer lists these cached pages: those no sequence lists become idle,
        most recently used last."""
        for page in pages:
            n = self.refs[page] - 1
            if n < 0:
                raise RuntimeError(f"cached page {page} released more often than listed")
            self.refs[page] = n
            if n == 0:
                self.idle[page] = None

    def add(self, key: int, page: int, refs: int = 1) -> None:
        """A full, published page enters the index under `key` with `refs` references (an
        engine bridge, whose engine does the lookups: kvhold.executor.kv_mirror). A page
        cached under a key another page holds already is shared and counted like any cached
        page but not found by lookups (the engine may hold two blocks of the same tokens)."""
        if page in self.key_of:
            raise ValueError(f"page {page} is cached already")
        self.by_key.setdefault(key, page)
        self.key_of[page] = key
        self.refs[page] = refs
        if not refs:
            self.idle[page] = None

    def insert(self, key: int, page: int) -> bool:
        """A full, published page of one sequence (which lists it: one reference) enters the index;
        False if the key is cached already (the page stays that sequence's own)."""
        if key in self.by_key or page in self.key_of:
            return False
        self.by_key[key] = page
        self.key_of[page] = key
        self.refs[page] = 1
        return True

    # ------------------------------------------------------------------ room
    @property
    def evictable(self) -> int:
        return len(self.idle) + len(self.unverified)

    @property
    def num_cached(self) -> int:
        return len(self.key_of)

    def evict(self, n: int) -> list[int]:
        """Take the `n` least recently used idle pages out of the index (the caller frees them)."""
        out = []
        while self.unverified and len(out) < n:          # never checked: cheapest to lose
            page, _ = self.unverified.popitem()
            out.append(page)
        while self.idle and len(out) < n:
            page, _ = self.idle.popitem(last=False)
            out.append(page)
            self._forget(page)
        return out

    def drop(self, pages: Iterable[int]) -> None:
        """Pages that must not be found again (found damaged, reset): out of the index."""
        for page in pages:
            self.unverified.pop(page, None)
            if page in self.key_of:
                self.idle.pop(page, None)
                self._forget(page)

    def reset(self) -> list[int]:
        """Every idle page out of the index (vLLM's reset_prefix_cache); referenced ones stay."""
        return self.evict(self.evictable)

    def hold_unverified(self, pages, keys, checksums) -> None:
        """After a takeover: idle cached pages kept whole but not checked yet (kvhold.executor.
        recovery), each with its key and its recorded checksum."""
        pages = np.asarray(pages, dtype=np.int64).tolist()
        keys = _as_keys(keys).tolist()
        checksums = np.asarray(checksums).astype(np.uint64).tolist()
        self.unverified.update(zip(pages, zip(keys, checksums)))

    def to_verify(self, n: int) -> tuple[list[int], list[int]]:
        """Up to `n` unverified pages and their recorded checksums (they stay unverified until
        `verified`)."""
        pages = list(itertools.islice(self.unverified, n))
        return pages, [self.unverified[p][1] for p in pages]

    def verified(self, pages: list[int], intact: list[bool]) -> list[int]:
        """The checks of `to_verify`'s pages: an intact one is indexed, idle and most recently
        used; returns the pages to free (damaged, or a second page under a key)."""
        release = []
        for page, ok in zip(pages, intact):
            entry = self.unverified.pop(page, None)
            if entry is None:
                continue                               # evicted meanwhile
            key = entry[0]
            if not ok or key in self.by_key:
                release.append(page)
                continue
            self.by_key[key] = page
            self.key_of[page] = key
            self.refs[page] = 0
            self.idle[page] = None
        return release

    def _forget(self, page: int) -> None:
        key = self.key_of.pop(page)
        if self.by_key.get(key) == page:
            del self.by_key[key]
        self.refs.pop(page, None)

    def rebuild(self, pages: np.ndarray, keys: np.ndarray, listed: np.ndarray) -> list[int]:
        """After a takeover: the cached pages it kept (`pages`, their `keys`) and every page list
        entry of the live sequences (`listed`, repeats included): the references. Returns the
        pages left out of the index (a second page under a key: the caller frees those no
        sequence lists; one that a sequence lists stays its own). Of pages under one key, the
        first in `pages` order is indexed; the idle ones become idle in `pages` order. Array
        operations: a takeover indexes thousands of pages."""
        self.by_key.clear()
        self.key_of.clear()
        self.refs.clear()
        self.idle.clear()
        self.unverified.clear()
        pages = np.asarray(pages, dtype=np.int64)
        keys = _as_keys(keys)
        listed = np.asarray(listed, dtype=np.int64)
        if not len(pages):
            return []
        pages_list, keys_list = pages.tolist(), keys.tolist()
        # the first page under a key wins (zipped in reverse: the last write is the first page)
        self.by_key.update(zip(reversed(keys_list), reversed(pages_list)))
        left: list[int] = []
        if len(self.by_key) < len(pages_list):               # pages under one key: rare
            _, first = np.unique(keys, return_index=True)
            indexed = np.zeros(len(pages), dtype=bool)
            indexed[first] = True
            left = pages[~indexed].tolist()
            pages, keys = pages[indexed], keys[indexed]
            pages_list, keys_list = pages.tolist(), keys.tolist()
        size = int(max(pages.max(), listed.max() if len(listed) else 0)) + 1
        refs = np.bincount(listed, minlength=size)[pages] if len(listed) else np.zeros(len(pages), dtype=np.int64)
        self.key_of.update(zip(pages_list, keys_list))
        self.refs.update(zip(pages_list, refs.tolist()))
        idle = refs == 0
        if idle.any():
            self.idle.update(dict.fromkeys(pages[idle].tolist()))
        return left

    def stats(self) -> dict:
        return {"queries": self.queries, "hits": self.hits, "cached_pages": self.num_cached,
                "idle_pages": len(self.idle), "unverified_pages": len(self.unverified)}
