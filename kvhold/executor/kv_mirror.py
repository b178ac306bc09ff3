"""KV mirror: protect an engine that owns its KV pool by copying committed blocks into kvhold.

An engine such as TensorRT-LLM allocates its own KV pool, so a crash loses it. The
mirror copies every newly committed block of that pool into a kvhold page and
commits the page exactly as the native engine does (kvhold.protocol.page_table + kvhold.protocol.checksum):
the page is assigned to (request id, logical block index) under the writer's epoch,
the new token rows are copied, then (token count, checksum) is published under the
seqlock, the checksum growing by the hash of those rows only. Copy and checksum run on
the pool's device (the fused Triton checksum on CUDA, as in the native engine); only
the checksums come back to the host. The page table is
therefore the durable record of which page holds which (request, block): it
outlives the engine process, and a replacement rebuilds everything from it.

`restore` (in the replacement, after the dead writer is fenced) validates the
mirrored pages with kvhold.protocol.validation, copies the intact prefix of each request into
the fresh engine's blocks, releases every page no request keeps, and reports per
request how many blocks were restored and which must be recomputed. If the dead
writer's exit is not confirmed yet (its epoch in `pending_epochs`), pages it may
still write are quarantined instead of reused: unkept pages, and partially filled
tails (their rows are restored, but the mirror continues them in a fresh page);
`release_quarantined(epochs)` frees them once the sidecar reports the exit.

A decode step (one new row in each of its blocks) has a cheaper path that publishes exactly
what `mirror_committed` would: `queue_decode` validates with array operations, assigns the
pages of rows that start a block and queues the copy; `publish_decode` waits for the copy
(an event: free once the step's own read-back has waited for it) and publishes. Queued
right after the engine's forward, the copy overlaps the step instead of adding a wait.

Shared pages (an engine with a prefix cache of its own, e.g. vLLM's): with `prefix` set (a
kvhold.executor.prefix_cache.PrefixCache, the native engine's index) every full published page
enters kvhold's prefix cache under the chained key of its tokens (`mark_cached`: CACHED, key as
owner), as the native engine's do, and the mirror remembers which engine block it holds
(`source`). The engine does the lookups: when it serves a request's block from its own cache
(`settle_full`, a `FullBlock` with `hit`), the request lists the page that holds that block,
referenced (never copied); a block whose page kvhold has evicted is copied into a fresh page,
which is cached in its turn. A page that a request held for that block before (a takeover's
restore, a recomputation after a preemption) is superseded: the request's journal list is
rewritten from there (`relist`) and only then is the old page let go (`relisted`). So an engine
block in use has one kvhold page however many requests share it, and kvhold's pool, as large as
the engine's, holds every block the engine uses; unreferenced cached pages are evicted least
recently used first when a fresh page is needed. A takeover (`plan_restore` with the journal's
page lists) validates a shared page once and rebuilds the index with each page's references; the
cached pages no live request lists and that look whole are kept out of the index, unchecked, as
the native engine's takeover keeps them, until `verify_cached` checks them (between steps, or
those a new request would be offered, before the offer). `offer` gives a new request the cached
pages of its full blocks that the engine's own cache lacks (the engine loads them, an external
hit), referenced until the request holds them (`take_offered`) or the offer is `withdraw`n.

Contract with the engine:
* a block's committed tokens never change and never shrink; `mirror_committed` and
  `queue_decode` are called once the engine's device work for those tokens is complete or
  queued on the current stream of the engine's device (the copy is queued behind it);
* request ids are non-zero integers (0 marks a free page); `release` when done;
* engine blocks hold exactly `page_tokens` tokens with the kvhold geometry and dtype;
  how they are laid out in the engine's tensors is a `BlockLayout` adapter's job;
* the mirror owns the whole kvhold pool except the null page (foreign-pool mode).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from kvhold.executor.kv_cache import TORCH_DTYPES
from kvhold.executor.page_allocator import NULL_PAGE, PageAllocator
from kvhold.executor.prefix_cache import PrefixCache
from kvhold.protocol.checksum import TorchChecksum, to_u64
from kvhold.protocol.layout import PageFlag
from kvhold.protocol.page_table import PageTable
from kvhold.protocol.tables import Tables
from kvhold.protocol.validation import torn_prefixes, trusted
from kvhold.executor.block_layout import BlockLayout, PerLayerBlocks, PooledBlocks, RowCopy  # noqa: F401

log = logging.getLogger(__name__)
_M64 = (1 << 64) - 1
LOAD_CHUNK_BYTES = 256 << 20          # bounds the temporaries of `load`


# ------------------------------------------------------------------------- mirror
def device_checksum(pool: torch.Tensor):
    """The checksum over `pool` computed on its device: the fused Triton pass on CUDA (what the
    native engine uses), torch elsewhere. Both give the same bits (kvhold.protocol.checksum)."""
    if pool.device.type == "cuda":
        from kvhold.executor.cuda.checksum import TritonChecksum

        return TritonChecksum(pool)
    return TorchChecksum(pool)


@dataclass(frozen=True, slots=True)
class Committed:
    """Engine block `block` holds the first `num_tokens` committed tokens of logical block
    `index` of request `request_id`."""

    request_id: int
    index: int
    block: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class FullBlock:
    """After a step, engine block `block` holds the whole logical block `index` of request
    `request_id`, whose chained prefix key is `key`: computed or loaded into it by the request
    (`hit` False: the request's own page holds the same bytes), or found in the engine's prefix
    cache (`hit` True: computed for another request, or before)."""

    request_id: int
    index: int
    block: int
    key: int
    hit: bool


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """A decode step queued by `KvMirror.queue_decode`: row i of the step writes token slot
    `rows[i]` of kvhold page `pages[i]` (int64 arrays), copied from engine block `blocks[i]`."""

    pages: np.ndarray
    rows: np.ndarray
    blocks: np.ndarray


@dataclass(frozen=True, slots=True)
class Restored:
    request_id: int
    blocks_restored: int             # logical blocks 0..blocks_restored-1 are back in the engine
    tokens_restored: int             # KV tokens they cover
    first_bad: int | None            # first mirrored block that failed validation, if any
    recompute: tuple[int, ...]       # logical blocks the engine must recompute


@dataclass(frozen=True, slots=True)
class RestorePlan:
    restored: Restored
    pages: tuple[int, ...]           # kvhold pages of logical blocks 0..restored.blocks_restored-1


class KvMirror:
    """Mirrors committed engine blocks into kvhold pages; restores them after a takeover.

    `kv_pool` is kvhold's KV region as [pages, L, 2, T, H, D] (kvhold.executor.kv_cache.KvCache.pool);
    `lease` is the writer's lease (`epoch`, and `check()` raising once fenced); `checksum`
    defaults to `device_checksum(kv_pool)`.
    """

    def __init__(self, tables: Tables, kv_pool: torch.Tensor, layout: BlockLayout, lease, checksum=None):
        kv = tables.geometry.kv
        got = (layout.num_layers, layout.block_tokens, layout.num_kv_heads, layout.head_dim, layout.dtype)
        want = (kv.num_layers, kv.page_tokens, kv.num_kv_heads, kv.head_dim, TORCH_DTYPES[kv.dtype])
        if got != want:
            raise ValueError(f"engine blocks (layers, tokens, kv_heads, head_dim, dtype) = {got} do "
                             f"not match the kvhold pages {want}")
        self.tables, self.pool, self.layout, self.lease = tables, kv_pool, layout, lease
        self.page_table = PageTable(tables)
        self.page_tokens = kv.page_tokens
        self.checksum = checksum or device_checksum(kv_pool)
        self.copy_rows = RowCopy(layout, kv_pool)
        self.held: dict[tuple[int, int], int] = {}       # (request id, logical block) -> page
        self.counts = np.zeros(tables.geometry.num_pages, dtype=np.int64)       # published, by page
        self.checksums = np.zeros(tables.geometry.num_pages, dtype=np.uint64)   # (0 unless held)
        self.quarantined: dict[int, int] = {}      # page -> epoch of a writer not yet reaped
        self.last_restore = {"pages_checked": 0, "pages_bad": 0, "pages_quarantined": 0}
        self.prefix: PrefixCache | None = None     # shared full pages (module docstring)
        self.source: dict[int, int] = {}           # engine block -> cached page with its bytes
        self.block_of: dict[int, int] = {}         # that page -> the block
        self.superseded: dict[int, list[int]] = {}  # request -> pages it held before, until relisted
        self.relist: dict[int, int] = {}           # request -> first logical block to list again
        self.pages_shared = 0                      # engine cache hits served by a cached page
        self.pages_copied = 0                      # engine cache hits copied (page evicted)
        records = self.page_table.snapshot()
        busy = (records["owner"] != 0) | ((records["flags"] & PageFlag.QUARANTINED) != 0)
        self.allocator = PageAllocator(p for p in (~busy).nonzero()[0].tolist() if p != NULL_PAGE)

    def page_of(self, request_id: int, index: int) -> int | None:
        return self.held.get((request_id, index))

    def holdings(self) -> list[tuple[int, int, int, int]]:
        """(request id, logical block, page, published tokens) of every page this mirror holds."""
        return [(rid, index, page, int(self.counts[page])) for (rid, index), page in self.held.items()]

    # ------------------------------------------------------------------ writer
    def mirror_committed(self, committed: Iterable[Committed],
                         row_hashes: Mapping[tuple[int, int], int] | None = None) -> int:
        """Copy the newly committed tokens of each block into its page and publish them.

        Only the new token rows move, in one gather from the engine's blocks and one scatter
        into kvhold's pages, both on the device; the checksum grows by the hash of those rows.
        `row_hashes` {(engine block, row): hash}: hashes of single new rows that the engine
        already computed over its own block (the same bytes at the same in-page index hash
        the same, kvhold.protocol.checksum), e.g. inside a CUDA decode step; the rest are hashed here, on
        kvhold's copy. Blocks with nothing new are skipped. Returns the number of pages published."""
        work = self._new_work(committed)
        if not work:
            return 0
        self.lease.check()                  # a fenced writer must not even copy bytes
        self._assign([(c.request_id, c.index) for c in work if (c.request_id, c.index) not in self.held])
        pages = np.array([self.held[c.request_id, c.index] for c in work], dtype=np.int64)
        blocks = np.array([c.block for c in work], dtype=np.int64)
        ends = np.array([c.num_tokens for c in work], dtype=np.int64)
        starts = self.counts[pages]
        new = ends - starts                 # rows [start, end) of each block are new
        first = np.repeat(np.cumsum(new) - new, new)
        self.copy_rows(np.stack([np.repeat(blocks, new), np.repeat(pages, new),
                                 np.arange(len(first), dtype=np.int64) - first + np.repeat(starts, new)]))
        added = self._added_hashes(pages, blocks, starts, ends, row_hashes or {})
        self._publish(pages, ends, added)
        return len(work)

    def _added_hashes(self, pages, blocks, starts, ends, row_hashes) -> np.ndarray:
        """Hash of each item's new rows (uint64), once the copy has reached kvhold's pool."""
        added = np.zeros(len(pages), dtype=np.uint64)
        rest = []
        for i, (block, start, end) in enumerate(zip(blocks.tolist(), starts.tolist(), ends.tolist())):
            known = row_hashes.get((block, start)) if end == start + 1 else None
            if known is None:
                rest.append(i)
            else:
                added[i] = int(known) & _M64
        if rest:
            added[rest] = self._hash_on_copy(pages[rest], starts[rest], ends[rest])
        return added

    def _hash_on_copy(self, pages, starts, ends) -> np.ndarray:
        """Hashes of rows [starts, ends) of kvhold pages, computed on kvhold's copy (after it)."""
        dev = self.pool.device
        ranges = torch.from_numpy(np.stack([pages, starts, ends]).astype(np.int64)).to(dev)
        return to_u64(self.checksum.ranges(ranges[0], ranges[1], ranges[2]))

    def _publish(self, pages: np.ndarray, counts: np.ndarray, added: np.ndarray) -> None:
        """Once the copy has landed: (count, checksum + added) of each page under the seqlock."""
        sums = self.checksums[pages] + added       # uint64 arrays wrap around (mod 2**64)
        self.copy_rows.wait()               # a page is never vouched for before its bytes are there
        self.lease.check()
        self.page_table.publish(pages, counts.astype(np.uint32), sums, self.lease.epoch)
        self.counts[pages] = counts
        self.checksums[pages] = sums

    # ------------------------------------------------------------------ writer, decode steps
    def queue_decode(self, request_ids: Sequence[int], indices: Sequence[int], blocks: Sequence[int],
                     rows: Sequence[int]) -> DecodeBatch | None:
        """Queue the copy of a decode step: row `rows[i]` of engine block `blocks[i]` is the next
        token of logical block `indices[i]` of request `request_ids[i]` (every request once).

        Returns None, having changed nothing, unless every row extends its block by exactly
        that one token (the block's page holds `rows[i]` tokens, or none and `rows[i]` is 0):
        the caller then uses `mirror_committed`, which handles (or rejects) everything else.
        Pages of rows that start a block are assigned here; the copy is queued, not awaited."""
        keys = list(zip(request_ids, indices))
        found = [self.held.get(k) for k in keys]
        new = [i for i, page in enumerate(found) if page is None] if None in found else []
        for i in new:
            found[i] = NULL_PAGE                 # holds nothing: the row must start the block
        idx = np.array((blocks, found, rows), dtype=np.int64)
        pages, rows = idx[1], idx[2]
        if not (keys and (self.counts[pages] == rows).all() and rows.max() < self.page_tokens
                and min(request_ids) > 0 and min(indices) >= 0 and min(blocks) >= 0
                and max(blocks) < self.layout.num_blocks and len(set(keys)) == len(keys)):
            return None
        self.lease.check()                  # a fenced writer must not even copy bytes
        if new:
            pages[new] = self._assign([keys[i] for i in new])
        self.copy_rows(idx)
        return DecodeBatch(pages, rows, idx[0])

    def publish_decode(self, batch: DecodeBatch, hashes: Sequence[int] | None = None) -> int:
        """Publish a queued decode step once its copy has landed; returns the pages published.

        `hashes[i]`: the hash of row i's slot, computed by the engine over its own block (as a
        CUDA decode step does); None: hashed here, on kvhold's copy."""
        pages, rows = batch.pages, batch.rows
        added = (self._hash_on_copy(pages, rows, rows + 1) if hashes is None else _as_u64(hashes))
        self._publish(pages, rows + 1, added)
        return len(pages)

    def warm_up(self) -> None:
        """Load the checksum and row-copy kernels without writing any page (a standby)."""
        dev = self.pool.device
        zero = torch.zeros(1, dtype=torch.long, device=dev)
        self.checksum.pages(zero, zero)
        self.checksum.ranges(zero, zero, zero + 1)
        self.copy_rows.warm_up()

    def _new_work(self, committed: Iterable[Committed]) -> list[Committed]:
        latest: dict[tuple[int, int], Committed] = {}
        page_tokens, num_blocks, held = self.page_tokens, self.layout.num_blocks, self.held
        for c in committed:
            if c.request_id <= 0 or c.index < 0 or not 0 < c.num_tokens <= page_tokens:
                raise ValueError(f"bad committed block {c}")
            if not 0 <= c.block < num_blocks:
                raise ValueError(f"{c}: engine block out of range 0..{num_blocks - 1}")
            latest[c.request_id, c.index] = c
        work = []
        for key, c in latest.items():
            done = int(self.counts[held[key]]) if key in held else 0
            if c.num_tokens < done:
                raise ValueError(f"{c}: {done} tokens were already committed (commits never shrink)")
            if c.num_tokens > done:
                work.append(c)
        return work

    def _assign(self, keys: list[tuple[int, int]]) -> list[int]:
        """Fresh pages for (request id, logical block) `keys`, recorded in the page table."""
        if not keys:
            return []
        short = len(keys) - self.allocator.num_free
        if short > 0 and self.prefix is not None:
            self._free_cached(self.prefix.evict(short))        # idle cached pages, LRU first
        pages = self.allocator.allocate(len(keys))
        self.lease.check()
        self.page_table.assign(pages, np.array([k[0] for k in keys], dtype=np.uint64),
                               np.array([k[1] for k in keys], dtype=np.uint32), self.lease.epoch)
        self.counts[pages] = 0
        self.checksums[pages] = 0
        for page, key in zip(pages, keys):
            self.held[key] = page
        return pages

    def release(self, request_id: int) -> int:
        """Free the pages of a finished request (a cached one loses a reference and, with none
        left, stays idle in the index); returns how many it held."""
        keys = [k for k in self.held if k[0] == request_id]
        pages = [self.held.pop(k) for k in keys] + self.superseded.pop(request_id, [])
        self.relist.pop(request_id, None)
        self._let_go(pages)
        return len(keys)

    def _let_go(self, pages: list[int]) -> None:
        own = pages
        if self.prefix is not None:
            own = [p for p in pages if not self.prefix.is_cached(p)]
            self.prefix.unref([p for p in pages if self.prefix.is_cached(p)])
        if own:
            self.page_table.release(own)
            self.allocator.free(own)

    def _free_cached(self, pages: list[int]) -> None:
        """Evicted cached pages (out of the index already): their records cleared, free again."""
        for page in pages:
            self._unsource(page)
        if pages:
            self.lease.check()
            self.page_table.release(pages)
            self.allocator.free(pages)

    # ------------------------------------------------------------------ shared pages
    def note_written(self, committed: Iterable[Committed]) -> None:
        """The engine writes these blocks this step: a cached page no longer stands for a block
        rewritten for a request that does not list it (the engine reused the block)."""
        for c in committed:
            page = self.source.get(c.block)
            if page is not None and self.held.get((c.request_id, c.index)) != page:
                self._unsource(page)

    def _unsource(self, page: int) -> None:
        block = self.block_of.pop(page, None)
        if block is not None and self.source.get(block) == page:
            del self.source[block]

    def _set_source(self, block: int, page: int) -> None:
        old = self.source.get(block)
        if old is not None:
            self.block_of.pop(old, None)
        moved = self.block_of.get(page)
        if moved is not None:
            self.source.pop(moved, None)
        self.source[block] = page
        self.block_of[page] = block

    def settle_full(self, full: Iterable[FullBlock]) -> int:
        """Once the step's pages are published: each full block enters the prefix cache (the
        request's own page, `hit` False) or is served from it (`hit` True: the page that holds
        the engine block, referenced; a copy of the block into a fresh page where kvhold has
        evicted it). Returns the pages copied. A no-op without `prefix`."""
        if self.prefix is None:
            return 0
        full = list(full)
        to_cache: dict[int, int] = {}        # page -> key
        for f in full:
            if f.hit:
                continue
            held = self.held.get((f.request_id, f.index))
            if held is None or int(self.counts[held]) != self.page_tokens:
                continue                     # not mirrored (a standby), or not published whole
            if not self.prefix.is_cached(held):
                to_cache[held] = f.key
            self._set_source(f.block, held)
        self._cache(to_cache)
        copies: list[FullBlock] = []
        for f in full:
            if not f.hit:
                continue
            key = (f.request_id, f.index)
            held, src = self.held.get(key), self.source.get(f.block)
            if src is not None:              # a source is always a cached page
                if held != src:
                    self.prefix.ref([src])
                    self.held[key] = src
                    self.counts[src] = self.page_tokens
                    if held is not None:
                        self._supersede(f.request_id, f.index, held)
                    self.pages_shared += 1
                continue
            if held is not None:
                del self.held[key]
                self._supersede(f.request_id, f.index, held)
            copies.append(f)
        if copies:
            self.mirror_committed([Committed(f.request_id, f.index, f.block, self.page_tokens) for f in copies])
            self._cache({self.held[f.request_id, f.index]: f.key for f in copies})
            for f in copies:
                self._set_source(f.block, self.held[f.request_id, f.index])
            self.pages_copied += len(copies)
        return len(copies)

    def _cache(self, keys: dict[int, int]) -> None:
        """Full published pages, each listed by one request, into the index and the records."""
        if not keys:
            return
        pages = list(keys)
        self.lease.check()
        for page in pages:
            self.prefix.add(keys[page], page)
        self.page_table.mark_cached(pages, [keys[p] for p in pages])

    def _supersede(self, request_id: int, index: int, page: int) -> None:
        self.superseded.setdefault(request_id, []).append(page)
        self.relist[request_id] = min(index, self.relist.get(request_id, index))

    def relisted(self, request_id: int) -> None:
        """The request's journal list no longer names the pages it held before a share: they
        are let go (a cached one loses a reference, an own one is freed)."""
        self.relist.pop(request_id, None)
        self._let_go(self.superseded.pop(request_id, []))

    def reset_prefix_cache(self) -> int:
        """Every idle cached page out of the index and freed (vLLM's reset_prefix_cache)."""
        if self.prefix is None:
            return 0
        pages = self.prefix.reset()
        self._free_cached(pages)
        return len(pages)

    # ------------------------------------------------------------------ takeover
    def restore(self, requests: Mapping[int, Sequence[int]], target: BlockLayout,
                pending_epochs: Iterable[int] = ()) -> dict[int, Restored]:
        """Validate the mirrored pages and copy each request's intact prefix into `target`.

        `requests` maps request id -> the fresh engine's block ids for logical blocks 0, 1, ...
        Call only once the previous writer is fenced. `pending_epochs`: fenced writers whose
        exit is not confirmed; their pages are quarantined, never reused (module docstring).
        Afterwards this mirror holds the restored pages and continues them; every other page
        is released or quarantined. `last_restore` counts pages checked, bad and quarantined.
        """
        plans = self.plan_restore({rid: len(b) for rid, b in requests.items()}, pending_epochs)
        pairs = [(int(requests[rid][i]), page) for rid, p in plans.items() for i, page in enumerate(p.pages)]
        self.load([page for _, page in pairs], [block for block, _ in pairs], target)
        return {rid: p.restored for rid, p in plans.items()}

    def plan_restore(self, requests: Mapping[int, int], pending_epochs: Iterable[int] = (),
                     full_blocks_only: bool = False,
                     listed: Mapping[int, Sequence[int]] | None = None) -> dict[int, "RestorePlan"]:
        """The validating half of `restore`, for engines that allocate blocks later.

        `requests` maps request id -> how many logical blocks it may use. Returns per request
        the kvhold pages of its intact prefix (copy them with `load` once the engine has
        blocks). `full_blocks_only`: a partial tail is not restored but released, for engines
        whose recomputation of a block may not reproduce its bytes exactly (TensorRT-LLM).
        `listed`: each request's journal page list, where its shared (cached) pages are named
        (their records are owned by their key); a shared page is validated once."""
        self.lease.check()
        self.held = {}
        self.counts[:] = 0
        self.checksums[:] = 0
        self.source, self.block_of, self.superseded, self.relist = {}, {}, {}, {}
        pending = {int(e) for e in pending_epochs}
        records = self.page_table.snapshot()
        odd = ((records["version"] & 1) == 1).nonzero()[0]
        self.page_table.repair_versions(odd)                 # the writer is fenced: settle its records
        plan = self._candidates(records, requests, listed or {})
        pages = np.array([page for _, _, page in plan], dtype=np.int64)
        uniq, inverse = np.unique(pages, return_inverse=True)
        ok_once = self._validate(records, uniq.tolist())
        ok = ok_once[inverse] if len(pages) else ok_once
        plans = self._prefixes(requests, plan, ok, records, full_blocks_only)
        self._unhold_live_tails(records, pending)
        self._own_listed(records)
        kept = set(self.held.values())
        idle = self._idle_cached(records, kept)
        self._settle(records, kept | set(idle.tolist()), pending)
        self._rebuild_cache(records)
        if len(idle):                      # checked before any request is offered one (`verify_cached`)
            self.prefix.hold_unverified(idle, records["owner"][idle], records["checksum"][idle])
        self.last_restore = {"pages_checked": len(uniq), "pages_bad": int((~ok_once).sum()),
                             "pages_quarantined": len(self.quarantined)}
        return plans

    def _idle_cached(self, records, kept: set[int]) -> np.ndarray:
        """Cached pages no live request lists (the index's idle pages) that look whole: full, not
        being written, not flagged. A takeover keeps them, unchecked and out of the index, as the
        native engine's does (kvhold.executor.recovery); `verify_cached` checks them. None
        without a prefix cache: then every unkept page is released."""
        if self.prefix is None:
            return np.zeros(0, dtype=np.int64)
        flags = records["flags"]
        cand = np.flatnonzero(((flags & PageFlag.CACHED) != 0)
                              & ((flags & (PageFlag.BAD | PageFlag.QUARANTINED)) == 0)
                              & ((records["version"] & 1) == 0) & (records["owner"] != 0)
                              & (records["num_tokens"] == self.page_tokens))
        return np.array([p for p in cand.tolist() if p > NULL_PAGE and p not in kept], dtype=np.int64)

    def verify_cached(self, pages: Sequence[int] | None = None, limit: int | None = None) -> int:
        """Check the checksums of idle cached pages a takeover kept unchecked: `pages` (those of
        them still unchecked), or up to `limit` of them, or all. Those that match enter the index
        (idle, found by lookups); the others, and a second page under a key, are freed. Returns
        how many were checked."""
        if self.prefix is None or not self.prefix.unverified:
            return 0
        if pages is None:
            pages, expected = self.prefix.to_verify(limit or len(self.prefix.unverified))
        else:
            pages = [int(p) for p in pages if int(p) in self.prefix.unverified]
            expected = [self.prefix.unverified[p][1] for p in pages]
        if not pages:
            return 0
        self.lease.check()
        idx = np.array(pages, dtype=np.int64)
        sums = self._checksums(idx, np.full(len(idx), self.page_tokens, dtype=np.int64))
        intact = (sums == np.asarray(expected, dtype=np.uint64)).tolist()
        if not all(intact):
            log.warning("%d idle cached pages kept by the takeover failed their checksum: freed",
                        intact.count(False))
        release = self.prefix.verified(list(pages), intact)
        if release:
            self._free_cached(release)
        return len(pages)

    def unverified_with(self, keys: Sequence[int]) -> list[int]:
        """The unchecked idle cached pages (kept by a takeover) whose keys are among `keys`."""
        if self.prefix is None or not self.prefix.unverified:
            return []
        want = set(keys)
        return [p for p, (key, _) in self.prefix.unverified.items() if key in want]

    def offer(self, keys: Sequence[int], first: int) -> list[int]:
        """The cached pages of the longest cached prefix of `keys` (a new request's full blocks)
        from logical block `first` on, each referenced (an eviction cannot take it) until the
        request holds it (`take_offered`) or the offer is withdrawn (`withdraw`). A page a
        takeover kept unchecked is checked first: only pages the index holds as valid are
        offered."""
        if self.prefix is None:
            return []
        check = self.unverified_with(keys)
        if check:
            self.verify_cached(check)
        pages = self.prefix.find(keys)[first:]
        self.prefix.ref(pages)
        return pages

    def withdraw(self, pages: Sequence[int]) -> None:
        """Offered pages no request took: their references go (idle again when none is left)."""
        if pages:
            self.prefix.unref(pages)

    def take_offered(self, request_id: int, first: int, pages: Sequence[int]) -> None:
        """The request's logical blocks `first`, `first` + 1, ... are the offered `pages` (loaded
        into the engine's blocks): it holds and lists them, shared, with the offer's references."""
        for i, page in enumerate(pages):
            self.held[request_id, first + i] = int(page)
            self.counts[page] = self.page_tokens

    def _own_listed(self, records) -> None:
        """A kept page whose entry into the prefix cache its writer's death interrupted (the key
        replaced the owner, CACHED not set yet) belongs to its request again."""
        fix = [(page, rid) for (rid, _), page in self.held.items()
               if int(records["owner"][page]) != rid and not records["flags"][page] & PageFlag.CACHED]
        if fix:
            self.page_table.restore_owners([p for p, _ in fix], [r for _, r in fix])
            for page, rid in fix:
                records["owner"][page] = rid

    def _rebuild_cache(self, records) -> None:
        """The prefix cache after a takeover: the kept CACHED pages, each referenced once per
        request that keeps it (the idle ones were released with every unkept page)."""
        if self.prefix is None:
            return
        self.prefix.rebuild(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64))
        refs: dict[int, int] = {}
        for page in self.held.values():
            if records["flags"][page] & PageFlag.CACHED:
                refs[page] = refs.get(page, 0) + 1
        for page, n in refs.items():
            self.prefix.add(int(records["owner"][page]), page, refs=n)

    def load(self, pages: Sequence[int], blocks: Sequence[int], target: BlockLayout) -> None:
        """Copy kvhold `pages` into the engine's `blocks` (same order): a gather + scatter per
        `LOAD_CHUNK_BYTES` of pages, so a takeover of many requests needs no pool-sized temporary."""
        if not len(pages):
            return
        src = torch.tensor(list(pages), dtype=torch.long, device=self.pool.device)
        dst = torch.tensor(list(blocks), dtype=torch.long, device=target.device)
        step = max(1, LOAD_CHUNK_BYTES // (self.pool[0].numel() * self.pool.element_size()))
        for i in range(0, len(src), step):
            target.write(dst[i:i + step], self.pool[src[i:i + step]].to(target.device))

    def _unhold_live_tails(self, records, pending: set[int]) -> None:
        """A partial tail whose writer may still run is restored but not continued in place."""
        for key, page in list(self.held.items()):
            if self.counts[page] < self.page_tokens and int(records["epoch"][page]) in pending:
                del self.held[key]

    def release_quarantined(self, epochs: Iterable[int]) -> int:
        """The writers of these epochs have exited: their quarantined pages are free again."""
        epochs = {int(e) for e in epochs}
        pages = [p for p, e in self.quarantined.items() if e in epochs]
        if pages:
            self.page_table.release(pages)
            self.allocator.free(pages)
            for p in pages:
                del self.quarantined[p]
        return len(pages)

    def _candidates(self, records, requests: Mapping[int, int],
                    listed: Mapping[int, Sequence[int]]) -> list[tuple[int, int, int]]:
        """(request, logical index, page) of each mirrored block, in order, up to the first gap
        (a block with no page, or with a page assigned but holding no committed token). A block
        is found by its record (owner and logical index) or, for a shared page (owned by its
        key), in the request's journal list: a full page at that logical index that no live
        request owns (its checksum decides whether it is kept)."""
        where = {}
        for page in ((records["owner"] != 0) & ((records["flags"] & PageFlag.QUARANTINED) == 0)).nonzero()[0]:
            where.setdefault((int(records["owner"][page]), int(records["logical"][page])), int(page))
        live = {int(r) for r in requests}
        plan = []
        for rid, num_blocks in requests.items():
            names = listed.get(rid, ())
            for index in range(int(num_blocks)):
                page = where.get((int(rid), index))
                if page is None and index < len(names):
                    p = int(names[index])
                    if (0 < p < len(records) and int(records["logical"][p]) == index
                            and int(records["num_tokens"][p]) == self.page_tokens
                            and int(records["owner"][p]) not in live
                            and not records["flags"][p] & PageFlag.QUARANTINED):
                        page = p
                if page is None or records["num_tokens"][page] == 0:
                    break                   # never mirrored, or assigned but nothing published yet
                plan.append((int(rid), index, page))
        return plan

    def _validate(self, records, pages: list[int]) -> np.ndarray:
        """One batched checksum pass; True where a page may be trusted (kvhold.protocol.validation)."""
        if not pages:
            return np.zeros(0, dtype=bool)
        idx = np.array(pages, dtype=np.int64)
        sub = records[idx]
        counts = np.minimum(sub["num_tokens"], self.page_tokens).astype(np.int64)
        sums = self._checksums(idx, counts)
        sum_ok = sums == sub["checksum"]
        sane = ((sub["flags"] & PageFlag.BAD) == 0) & (sub["num_tokens"] <= self.page_tokens)
        torn = np.flatnonzero(((sub["version"] & 1) == 1) & ~sum_ok & sane & (counts > 0))
        if len(torn):       # a publish cut between its count and its checksum: keep the rows before
            counts, sum_ok = torn_prefixes(idx, sub["checksum"], counts, sum_ok, torn, self._checksums)
            cut = torn[sum_ok[torn]]
            if len(cut):    # the record says what is kept, for `_prefixes` and a later takeover
                self.page_table.set_counts(idx[cut], counts[cut])
                records["num_tokens"][idx[cut]] = counts[cut]
                sub = records[idx]
        return trusted(sub, self.page_tokens, sum_ok) & sane

    def _checksums(self, pages: np.ndarray, counts: np.ndarray) -> np.ndarray:
        dev = self.pool.device
        return to_u64(self.checksum.pages(torch.from_numpy(pages).to(dev), torch.from_numpy(counts).to(dev)))

    def _prefixes(self, requests, plan, ok, records, full_only: bool) -> dict[int, "RestorePlan"]:
        """Per request: the longest valid prefix of full blocks (plus one partial tail unless
        `full_only`); the mirror holds its pages from now on."""
        by_request: dict[int, list[tuple[int, int, bool]]] = {int(r): [] for r in requests}
        for (rid, index, page), good in zip(plan, ok.tolist()):
            by_request[rid].append((index, page, good))
        plans = {}
        for rid, num_blocks in requests.items():
            rid, tokens, pages, first_bad = int(rid), 0, [], None
            for index, page, good in by_request[rid]:
                if not good:
                    first_bad = index
                    break
                count = int(records["num_tokens"][page])
                if count == 0 or (full_only and count < self.page_tokens):
                    break              # (0: a first publish cut before its checksum kept no row)
                pages.append(page)
                self.held[rid, index] = page
                self.counts[page], self.checksums[page] = count, records["checksum"][page]
                tokens += count
                if count < self.page_tokens:
                    break                                      # a partial tail ends the prefix
            restored = Restored(rid, len(pages), tokens, first_bad, tuple(range(len(pages), int(num_blocks))))
            plans[rid] = RestorePlan(restored, tuple(pages))
        return plans

    def _settle(self, records, kept: set[int], pending: set[int]) -> None:
        """Release (or, for a live writer's pages, quarantine) every page nobody keeps, and
        rebuild the free list from the table."""
        flagged = (records["flags"] & PageFlag.QUARANTINED) != 0
        used = ((records["owner"] != 0) | flagged).nonzero()[0].tolist()
        unkept = [p for p in used if p not in kept]
        hold = [p for p in unkept if int(records["epoch"][p]) in pending]
        drop = [p for p in unkept if int(records["epoch"][p]) not in pending]
        if hold:
            self.page_table.quarantine(hold)
        if drop:
            self.page_table.release(drop)
        self.quarantined = {p: int(records["epoch"][p]) for p in hold}
        self.allocator = PageAllocator(p for p in range(len(records))
                                       if p != NULL_PAGE and p not in kept and p not in self.quarantined)
        log.info("restored %d mirrored pages, released %d, quarantined %d", len(kept), len(drop), len(hold))


def _as_u64(values: Sequence[int]) -> np.ndarray:
    """Hashes as uint64 bits, whether given as int64 (torch's `tolist()`) or as unsigned ints."""
    if isinstance(values, np.ndarray):
        return values.view(np.uint64) if values.dtype == np.int64 else values.astype(np.uint64)
    try:
        return np.array(values, dtype=np.int64).view(np.uint64)
    except OverflowError:
        return np.array([int(v) & _M64 for v in values], dtype=np.uint64)
