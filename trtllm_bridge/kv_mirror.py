"""KV mirror: protect an engine that owns its KV pool by copying committed blocks into kvhold.

An engine such as TensorRT-LLM allocates its own KV pool, so a crash loses it. The
mirror copies every newly committed block of that pool into a kvhold page and
commits the page exactly as the native engine does (ipc.page_table + ipc.checksum):
the page is assigned to (request id, logical block index) under the writer's epoch,
the bytes are copied, then (token count, checksum) is published under the seqlock,
the checksum growing by the hash of the new token rows only. The page table is
therefore the durable record of which page holds which (request, block): it
outlives the engine process, and a replacement rebuilds everything from it.

`restore` (in the replacement, after the dead writer is fenced and has exited)
validates the mirrored pages with ipc.validation, copies the intact prefix of each
request into the fresh engine's blocks, releases every page no request keeps, and
reports per request how many blocks were restored and which must be recomputed.

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

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------- layouts
class BlockLayout:
    """An engine's KV blocks seen as kvhold's canonical [B, layer, k/v, token, kv_head, head_dim].

    `head_major` engines store each (layer, k/v) block as [kv_head][token][head_dim]
    ("HND") instead of [token][kv_head][head_dim] ("NHD").
    """

    def __init__(self, num_blocks: int, block_tokens: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, head_major: bool):
        self.num_blocks, self.block_tokens, self.num_layers = num_blocks, block_tokens, num_layers
        self.num_kv_heads, self.head_dim, self.head_major = num_kv_heads, head_dim, head_major
        self.dtype, self.device = dtype, device

    def _inner(self) -> tuple[int, int, int]:
        t, h, d = self.block_tokens, self.num_kv_heads, self.head_dim
        return (h, t, d) if self.head_major else (t, h, d)

    def _canonical(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(-3, -2) if self.head_major else x

    def read(self, blocks: torch.Tensor) -> torch.Tensor:
        """A copy of `blocks` (1-D long tensor), canonical shape [B, L, 2, T, H, D]."""
        raise NotImplementedError

    def write(self, blocks: torch.Tensor, data: torch.Tensor) -> None:
        """Store canonical `data` [B, L, 2, T, H, D] into `blocks`."""
        raise NotImplementedError


class PerLayerBlocks(BlockLayout):
    """One tensor per layer, [num_blocks, 2, T, H, D] (NHD) or [num_blocks, 2, H, T, D] (HND):
    vLLM-style caches and TensorRT-LLM's `KVCacheManager.get_buffers(layer)`."""

    def __init__(self, caches: Sequence[torch.Tensor], num_kv_heads: int, head_dim: int,
                 block_tokens: int, head_major: bool = False):
        first = caches[0]
        super().__init__(first.shape[0], block_tokens, len(caches), num_kv_heads, head_dim,
                         first.dtype, first.device, head_major)
        want = (first.shape[0], 2, *self._inner())
        for layer, c in enumerate(caches):
            if tuple(c.shape) != want or c.dtype != first.dtype:
                raise ValueError(f"layer {layer} cache is {tuple(c.shape)} {c.dtype}, expected {want}")
        self.caches = list(caches)

    def read(self, blocks):
        return self._canonical(torch.stack([c[blocks] for c in self.caches], dim=1))

    def write(self, blocks, data):
        for layer, c in enumerate(self.caches):
            c[blocks] = self._canonical(data[:, layer]).to(c.dtype)


class PooledBlocks(BlockLayout):
    """One tensor for all layers, [num_blocks, num_layers, 2, T*H*D]: TensorRT-LLM's primary
    pool (`KVCacheManager.get_unique_primary_pool()`), NHD or HND inside a block."""

    def __init__(self, pool: torch.Tensor, num_kv_heads: int, head_dim: int, block_tokens: int,
                 head_major: bool = False):
        n, layers, two, size = pool.shape
        super().__init__(n, block_tokens, layers, num_kv_heads, head_dim, pool.dtype, pool.device,
                         head_major)
        if two != 2 or size != block_tokens * num_kv_heads * head_dim:
            raise ValueError(f"pool {tuple(pool.shape)} does not hold blocks of {block_tokens} tokens "
                             f"x {num_kv_heads} heads x {head_dim}")
        self.view = pool.view(n, layers, 2, *self._inner())

    def read(self, blocks):
        return self._canonical(self.view[blocks])

    def write(self, blocks, data):
        self.view[blocks] = self._canonical(data).to(self.view.dtype)


# ------------------------------------------------------------------------- mirror
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


class KvMirror:
    """Mirrors committed engine blocks into kvhold pages; restores them after a takeover.

    `kv_pool` is kvhold's KV region as [pages, L, 2, T, H, D] (executor.kv_cache.KvCache.pool);
    `lease` is the writer's lease (`epoch`, and `check()` raising once fenced).
    """

    def __init__(self, tables: Tables, kv_pool: torch.Tensor, layout: BlockLayout, lease):
        kv = tables.geometry.kv
        got = (layout.num_layers, layout.block_tokens, layout.num_kv_heads, layout.head_dim, layout.dtype)
        want = (kv.num_layers, kv.page_tokens, kv.num_kv_heads, kv.head_dim, TORCH_DTYPES[kv.dtype])
        if got != want:
            raise ValueError(f"engine blocks (layers, tokens, kv_heads, head_dim, dtype) = {got} do "
                             f"not match the kvhold pages {want}")
        self.tables, self.pool, self.layout, self.lease = tables, kv_pool, layout, lease
        self.page_table = PageTable(tables)
        self.page_tokens = kv.page_tokens
        self.checksum = TorchChecksum(kv_pool)
        self.held: dict[tuple[int, int], _Held] = {}
        records = self.page_table.snapshot()
        busy = (records["owner"] != 0) | ((records["flags"] & PageFlag.QUARANTINED) != 0)
        self.allocator = PageAllocator(p for p in (~busy).nonzero()[0].tolist() if p != NULL_PAGE)

    def page_of(self, request_id: int, index: int) -> int | None:
        held = self.held.get((request_id, index))
        return None if held is None else held.page

    # ------------------------------------------------------------------ writer
    def mirror_committed(self, committed: Iterable[Committed]) -> int:
        """Copy the newly committed tokens of each block into its page and publish them.

        Whole blocks move in one gather and one scatter (rows committed earlier are rewritten
        with the same bytes); the checksum grows by the hash of the new rows only. Blocks with
        nothing new are skipped. Returns the number of pages published."""
        work = self._new_work(committed)
        if not work:
            return 0
        self.lease.check()                  # a fenced writer must not even copy bytes
        self._assign([c for c in work if (c.request_id, c.index) not in self.held])
        held = [self.held[c.request_id, c.index] for c in work]
        dev = self.pool.device
        pages = torch.tensor([h.page for h in held], dtype=torch.long, device=dev)
        blocks = torch.tensor([c.block for c in work], dtype=torch.long, device=self.layout.device)
        self.pool[pages] = self.layout.read(blocks).to(dev)
        starts = torch.tensor([h.num_tokens for h in held], dtype=torch.long, device=dev)
        ends = torch.tensor([c.num_tokens for c in work], dtype=torch.long, device=dev)
        added = to_u64(self.checksum.ranges(pages, starts, ends))   # reads back: copy is done
        with np.errstate(over="ignore"):
            sums = np.array([h.checksum for h in held], dtype=np.uint64) + added
        counts = np.array([c.num_tokens for c in work], dtype=np.uint32)
        self.lease.check()
        self.page_table.publish(pages.cpu().numpy(), counts, sums, self.lease.epoch)
        for h, c, s in zip(held, work, sums.tolist()):
            h.num_tokens, h.checksum = c.num_tokens, int(s)
        return len(work)

    def _new_work(self, committed: Iterable[Committed]) -> list[Committed]:
        latest: dict[tuple[int, int], Committed] = {}
        for c in committed:
            if c.request_id <= 0 or c.index < 0 or not 0 < c.num_tokens <= self.page_tokens:
                raise ValueError(f"bad committed block {c}")
            if not 0 <= c.block < self.layout.num_blocks:
                raise ValueError(f"{c}: engine block out of range 0..{self.layout.num_blocks - 1}")
            latest[c.request_id, c.index] = c
        work = []
        for key, c in latest.items():
            done = self.held[key].num_tokens if key in self.held else 0
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
    def restore(self, requests: Mapping[int, Sequence[int]], target: BlockLayout) -> dict[int, Restored]:
        """Validate the mirrored pages and copy each request's intact prefix into `target`.

        `requests` maps request id -> the fresh engine's block ids for logical blocks 0, 1, ...
        Call only once the previous writer is fenced and gone. Afterwards this mirror holds
        the restored pages and continues them; every other page is released.
        """
        self.lease.check()
        self.held = {}
        records = self.page_table.snapshot()
        odd = ((records["version"] & 1) == 1).nonzero()[0]
        self.page_table.repair_versions(odd)                 # the writer is gone: settle its records
        plan = self._candidates(records, requests)
        ok = self._validate(records, [page for _, _, page in plan])
        results, keep = self._prefixes(requests, plan, ok, records)
        if keep:
            src = torch.tensor([page for _, page in keep], dtype=torch.long, device=self.pool.device)
            dst = torch.tensor([block for block, _ in keep], dtype=torch.long, device=target.device)
            target.write(dst, self.pool[src].to(target.device))
        self._settle(records, {page for _, page in keep})
        return results

    def _candidates(self, records, requests) -> list[tuple[int, int, int]]:
        """(request, logical index, page) of each mirrored block, in order, up to the first gap
        (a block with no page, or with a page assigned but holding no committed token)."""
        where = {}
        for page in ((records["owner"] != 0) & ((records["flags"] & PageFlag.QUARANTINED) == 0)).nonzero()[0]:
            where.setdefault((int(records["owner"][page]), int(records["logical"][page])), int(page))
        plan = []
        for rid, blocks in requests.items():
            for index in range(len(blocks)):
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

    def _prefixes(self, requests, plan, ok, records):
        """Per request: the longest valid prefix of full blocks (plus one partial tail)."""
        by_request: dict[int, list[tuple[int, int, bool]]] = {int(r): [] for r in requests}
        for (rid, index, page), good in zip(plan, ok.tolist()):
            by_request[rid].append((index, page, good))
        results, keep = {}, []
        for rid, blocks in requests.items():
            rid, tokens, restored, first_bad = int(rid), 0, 0, None
            for index, page, good in by_request[rid]:
                if not good:
                    first_bad = index
                    break
                count = int(records["num_tokens"][page])
                keep.append((int(blocks[index]), page))
                self.held[rid, index] = _Held(page, count, int(records["checksum"][page]))
                tokens, restored = tokens + count, restored + 1
                if count < self.page_tokens:
                    break                                      # a partial tail ends the prefix
            results[rid] = Restored(rid, restored, tokens, first_bad, tuple(range(restored, len(blocks))))
        return results, keep

    def _settle(self, records, kept: set[int]) -> None:
        """Release every page nobody keeps and rebuild the free list from the table."""
        used = (records["owner"] != 0).nonzero()[0].tolist()
        drop = [p for p in used if p not in kept]
        if drop:
            self.page_table.release(drop)
        quarantined = (records["flags"] & PageFlag.QUARANTINED) != 0
        self.allocator = PageAllocator(p for p in range(len(records))
                                       if p != NULL_PAGE and p not in kept and not quarantined[p])
        log.info("restored %d mirrored pages, released %d", len(kept), len(drop))
