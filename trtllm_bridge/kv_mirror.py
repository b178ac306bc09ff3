"""KV mirror: protect an engine that owns its KV pool by copying committed blocks into kvhold.

An engine such as TensorRT-LLM allocates its own KV pool, so a crash loses it. The
mirror copies every newly committed block of that pool into a kvhold page and
commits the page exactly as the native engine does (ipc.page_table + ipc.checksum):
the page is assigned to (request id, logical block index) under the writer's epoch,
the new token rows are copied, then (token count, checksum) is published under the
seqlock, the checksum growing by the hash of those rows only. Copy and checksum run on
the pool's device (the fused Triton checksum on CUDA, as in the native engine); only
the checksums come back to the host. The page table is
therefore the durable record of which page holds which (request, block): it
outlives the engine process, and a replacement rebuilds everything from it.

`restore` (in the replacement, after the dead writer is fenced) validates the
mirrored pages with ipc.validation, copies the intact prefix of each request into
the fresh engine's blocks, releases every page no request keeps, and reports per
request how many blocks were restored and which must be recomputed. If the dead
writer's exit is not confirmed yet (its epoch in `pending_epochs`), pages it may
still write are quarantined instead of reused: unkept pages, and partially filled
tails (their rows are restored, but the mirror continues them in a fresh page);
`release_quarantined(epochs)` frees them once the sidecar reports the exit.

Contract with the engine:
* a block's committed tokens never change and never shrink; `mirror_committed` is
  called after the engine's device work for those tokens is complete;
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

from executor.kv_cache import TORCH_DTYPES
from executor.page_allocator import NULL_PAGE, PageAllocator
from ipc.checksum import TorchChecksum, to_u64
from ipc.layout import PageFlag
from ipc.page_table import PageTable
from ipc.tables import Tables
from ipc.validation import trusted
from trtllm_bridge.block_layout import BlockLayout, PerLayerBlocks, PooledBlocks  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)
_M64 = (1 << 64) - 1
LOAD_CHUNK_BYTES = 256 << 20          # bounds the temporaries of `load`


# ------------------------------------------------------------------------- mirror
def device_checksum(pool: torch.Tensor):
    """The checksum over `pool` computed on its device: the fused Triton pass on CUDA (what the
    native engine uses), torch elsewhere. Both give the same bits (ipc.checksum)."""
    if pool.device.type == "cuda":
        from executor.cuda_checksum import TritonChecksum

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


@dataclass(slots=True)
class _Held:
    page: int
    num_tokens: int
    checksum: int


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

    `kv_pool` is kvhold's KV region as [pages, L, 2, T, H, D] (executor.kv_cache.KvCache.pool);
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
        self.pool_rows = kv_pool.view(-1, kv.num_kv_heads * kv.head_dim)     # [(page, l, k/v, token), H*D]
        self.held: dict[tuple[int, int], _Held] = {}
        self.quarantined: dict[int, int] = {}      # page -> epoch of a writer not yet reaped
        self.last_restore = {"pages_checked": 0, "pages_bad": 0, "pages_quarantined": 0}
        records = self.page_table.snapshot()
        busy = (records["owner"] != 0) | ((records["flags"] & PageFlag.QUARANTINED) != 0)
        self.allocator = PageAllocator(p for p in (~busy).nonzero()[0].tolist() if p != NULL_PAGE)

    def page_of(self, request_id: int, index: int) -> int | None:
        held = self.held.get((request_id, index))
        return None if held is None else held.page

    # ------------------------------------------------------------------ writer
    def mirror_committed(self, committed: Iterable[Committed],
                         row_hashes: Mapping[tuple[int, int], int] | None = None) -> int:
        """Copy the newly committed tokens of each block into its page and publish them.

        Only the new token rows move, in one gather from the engine's blocks and one scatter
        into kvhold's pages, both on the device; the checksum grows by the hash of those rows.
        `row_hashes` {(engine block, row): hash}: hashes of single new rows that the engine
        already computed over its own block (the same bytes at the same in-page index hash
        the same, ipc.checksum), e.g. inside a CUDA decode step; the rest are hashed here, on
        kvhold's copy. Blocks with nothing new are skipped. Returns the number of pages published."""
        work = self._new_work(committed)
        if not work:
            return 0
        self.lease.check()                  # a fenced writer must not even copy bytes
        self._assign([c for c in work if (c.request_id, c.index) not in self.held])
        held = [self.held[c.request_id, c.index] for c in work]
        self._copy_rows(held, work)
        added = self._added_hashes(held, work, row_hashes or {})   # returns once the copy is done
        with np.errstate(over="ignore"):
            sums = np.array([h.checksum for h in held], dtype=np.uint64) + added
        pages = np.array([h.page for h in held], dtype=np.int64)
        counts = np.array([c.num_tokens for c in work], dtype=np.uint32)
        self.lease.check()
        self.page_table.publish(pages, counts, sums, self.lease.epoch)
        for h, c, s in zip(held, work, sums.tolist()):
            h.num_tokens, h.checksum = c.num_tokens, int(s)
        return len(work)

    def _copy_rows(self, held: list[_Held], work: list[Committed]) -> None:
        """Rows [held num_tokens, committed num_tokens) of each block -> the same rows of its page:
        one transfer of indices, one gather from the engine's blocks, one index_copy_ into
        kvhold's pool seen as rows [(page, layer, k/v, token), H*D]."""
        pages, blocks, rows = [], [], []
        for h, c in zip(held, work):
            n = c.num_tokens - h.num_tokens
            pages += [h.page] * n
            blocks += [c.block] * n
            rows += range(h.num_tokens, c.num_tokens)
        n, lkv = len(rows), self.pool.shape[1] * 2
        dst = (np.array(pages)[:, None] * lkv + np.arange(lkv)) * self.page_tokens + np.array(rows)[:, None]
        idx = torch.from_numpy(np.concatenate([blocks, rows, dst.ravel()])).to(self.layout.device)
        data = self.layout.read_rows(idx[:n], idx[n:2 * n])         # [N, L, 2, H, D]
        dev = self.pool.device
        self.pool_rows.index_copy_(0, idx[2 * n:].to(dev), data.reshape(-1, self.pool_rows.shape[1]).to(dev))

    def _added_hashes(self, held: list[_Held], work: list[Committed], row_hashes) -> np.ndarray:
        """Hash of each item's new rows (uint64), once the copy has reached kvhold's pool."""
        added = np.zeros(len(work), dtype=np.uint64)
        rest = []
        for i, (h, c) in enumerate(zip(held, work)):
            known = row_hashes.get((c.block, h.num_tokens)) if c.num_tokens == h.num_tokens + 1 else None
            if known is None:
                rest.append(i)
            else:
                added[i] = int(known) & _M64
        if rest:                            # reading the checksums back waits for the copy too
            ranges = torch.tensor([[held[i].page for i in rest], [held[i].num_tokens for i in rest],
                                   [work[i].num_tokens for i in rest]], dtype=torch.long, device=self.pool.device)
            added[rest] = to_u64(self.checksum.ranges(ranges[0], ranges[1], ranges[2]))
        elif self.pool.device.type == "cuda":
            torch.cuda.current_stream(self.pool.device).synchronize()
        return added

    def warm_up(self) -> None:
        """Load the checksum and row-gather kernels without writing any page (a standby)."""
        dev = self.pool.device
        zero = torch.zeros(1, dtype=torch.long, device=dev)
        self.checksum.pages(zero, zero)
        self.checksum.ranges(zero, zero, zero + 1)
        rows = torch.zeros(1, dtype=torch.long, device=self.layout.device)
        data = self.layout.read_rows(rows, rows).reshape(-1, self.pool_rows.shape[1]).to(dev)
        scratch = torch.empty_like(self.pool_rows[:len(data)])
        scratch.index_copy_(0, torch.arange(len(data), device=dev), data)

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
            done = held[key].num_tokens if key in held else 0
            if c.num_tokens < done:
                raise ValueError(f"{c}: {done} tokens were already committed (commits never shrink)")
            if c.num_tokens > done:
                work.append(c)
        return work

    def _assign(self, new: list[Committed]) -> None:
        if not new:
            return
        pages = self.allocator.allocate(len(new))
        self.lease.check()
        self.page_table.assign(pages, np.array([c.request_id for c in new], dtype=np.uint64),
                               np.array([c.index for c in new], dtype=np.uint32), self.lease.epoch)
        for page, c in zip(pages, new):
            self.held[c.request_id, c.index] = _Held(page, 0, 0)

    def release(self, request_id: int) -> int:
        """Free the pages of a finished request; returns how many."""
        keys = [k for k in self.held if k[0] == request_id]
        pages = [self.held.pop(k).page for k in keys]
        if pages:
            self.page_table.release(pages)
            self.allocator.free(pages)
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
                     full_blocks_only: bool = False) -> dict[int, "RestorePlan"]:
        """The validating half of `restore`, for engines that allocate blocks later.

        `requests` maps request id -> how many logical blocks it may use. Returns per request
        the kvhold pages of its intact prefix (copy them with `load` once the engine has
        blocks). `full_blocks_only`: a partial tail is not restored but released, for engines
        whose recomputation of a block may not reproduce its bytes exactly (TensorRT-LLM)."""
        self.lease.check()
        self.held = {}
        pending = {int(e) for e in pending_epochs}
        records = self.page_table.snapshot()
        odd = ((records["version"] & 1) == 1).nonzero()[0]
        self.page_table.repair_versions(odd)                 # the writer is fenced: settle its records
        plan = self._candidates(records, requests)
        ok = self._validate(records, [page for _, _, page in plan])
        plans = self._prefixes(requests, plan, ok, records, full_blocks_only)
        self._unhold_live_tails(records, pending)
        self._settle(records, {h.page for h in self.held.values()}, pending)
        self.last_restore = {"pages_checked": len(plan), "pages_bad": int((~ok).sum()),
                             "pages_quarantined": len(self.quarantined)}
        return plans

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
        for key, h in list(self.held.items()):
            if h.num_tokens < self.page_tokens and int(records["epoch"][h.page]) in pending:
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

    def _candidates(self, records, requests: Mapping[int, int]) -> list[tuple[int, int, int]]:
        """(request, logical index, page) of each mirrored block, in order, up to the first gap
        (a block with no page, or with a page assigned but holding no committed token)."""
        where = {}
        for page in ((records["owner"] != 0) & ((records["flags"] & PageFlag.QUARANTINED) == 0)).nonzero()[0]:
            where.setdefault((int(records["owner"][page]), int(records["logical"][page])), int(page))
        plan = []
        for rid, num_blocks in requests.items():
            for index in range(int(num_blocks)):
                page = where.get((int(rid), index))
                if page is None or records["num_tokens"][page] == 0:
                    break                   # never mirrored, or assigned but nothing published yet
                plan.append((int(rid), index, page))
        return plan

    def _validate(self, records, pages: list[int]) -> np.ndarray:
        """One batched checksum pass; True where a page may be trusted (ipc.validation)."""
        if not pages:
            return np.zeros(0, dtype=bool)
        idx = np.array(pages, dtype=np.int64)
        sub = records[idx]
        counts = np.minimum(sub["num_tokens"], self.page_tokens).astype(np.int64)
        dev = self.pool.device
        sums = to_u64(self.checksum.pages(torch.from_numpy(idx).to(dev), torch.from_numpy(counts).to(dev)))
        return trusted(sub, self.page_tokens, sums == sub["checksum"]) & ((sub["flags"] & PageFlag.BAD) == 0)

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
                if full_only and count < self.page_tokens:
                    break
                pages.append(page)
                self.held[rid, index] = _Held(page, count, int(records["checksum"][page]))
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
