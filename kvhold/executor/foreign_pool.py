"""Foreign-pool mode: the reference engine keeps its own KV pool, protected only by the mirror.

This is how kvhold sits behind an engine that allocates its own KV memory (TensorRT-LLM's
`KVCacheManager`): the engine computes into a private pool with its own block
ids, and after each step's device work the KV mirror (kvhold.executor.kv_mirror) copies the
newly committed rows into kvhold pages, published with version and checksum. Enabled by
`kvhold sidecar --kv-mode foreign`; with the default `native` nothing here runs.

Commit order of a step (kvhold.executor.commit; MirrorPages is its pages stage here):
  1. mirror: kvhold page records assigned (owner = request id, logical = block index),
     bytes copied, then, once the copy has landed, (count, checksum) published under the
     seqlock (a decode step: KvMirror.queue_decode / publish_decode; the copy may be queued
     by the runner's `after_forward` hook, before the step's read-back);
  2. the journal's page list names those kvhold pages (prefix, in block order), so the
     tables describe where each request's committed KV lives, as in native mode;
  3. journal tokens, finish, then pages released (journal list shortened first).
The mirror's commit is never pipelined: each step commits at once.
Takeover (kvhold.executor.takeover with `ForeignTakeover`): the new executor rebuilds
every live request from the journal, gives it fresh private blocks, and `KvMirror.restore`
validates the mirrored pages (quarantining those of a writer not yet reaped) and copies
each request's intact prefix into them; a request with a damaged block recomputes from
that block, one with nothing usable re-prefills. There is no tail step: the private
blocks are this process's own, and the mirror writes kvhold's pages only for the active
executor. Sampling is keyed by (seed, position), so the continuation equals an
uninterrupted run.
"""
from __future__ import annotations

import logging
import math

from kvhold.executor.commit import PagesStage
from kvhold.executor.engine import Engine
from kvhold.executor.engine_bridge import list_mirrored_pages
from kvhold.executor.engine_workload import EngineWorkload
from kvhold.executor.kv_cache import KvCache
from kvhold.executor.kv_mirror import Committed, DecodeBatch, KvMirror, PooledBlocks, Restored
from kvhold.executor.page_allocator import NULL_PAGE, PageAllocator
from kvhold.executor.sequence import Sequence
from kvhold.executor.takeover import PageFigures, RequestPlan, TakeoverContext
from kvhold.protocol.layout import PageFlag

log = logging.getLogger(__name__)
KV_MODES = ("native", "foreign")


def engine_blocks(kv: KvCache) -> PooledBlocks:
    """The private pool seen as TensorRT-LLM's primary-pool layout [blocks, layers, 2, T*H*D]."""
    g = kv.geometry
    pool = kv.pool.view(kv.num_pages, g.num_layers, 2, -1)
    return PooledBlocks(pool, g.num_kv_heads, g.head_dim, g.page_tokens)


class PrivateBlocks:
    """BlockManager's interface over the engine's private pool: nothing goes to shared memory.

    `free` calls `on_free(seq)` first, so the caller can drop the request's mirrored pages."""

    def __init__(self, num_blocks: int, journal, page_tokens: int, on_free):
        self.allocator = PageAllocator(range(NULL_PAGE + 1, num_blocks))
        self.journal = journal                  # the scheduler counts preemptions through it
        self.page_tokens = page_tokens
        self.on_free = on_free

    def pages_needed(self, seq: Sequence, n: int, start: int | None = None) -> int:
        """New pages for `n` more tokens after its computed ones, or after `start` (a start
        on `start // page_tokens` cached pages it does not hold yet)."""
        held = len(seq.pages) if start is None else start // self.page_tokens
        start = seq.num_computed if start is None else start
        return max(0, math.ceil((start + n) / self.page_tokens) - held)

    prefix = None                               # no prefix cache over a private pool

    @property
    def num_available(self) -> int:
        return self.allocator.num_free

    def can_allocate(self, n: int) -> bool:
        return self.allocator.can_allocate(n)

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """No prefix cache here: every prompt is computed."""
        return []

    def can_start(self, cached: list[int], need: int) -> bool:
        return self.can_allocate(need)

    def start_on_cached_prefix(self, seq: Sequence, cached: list[int]) -> None:
        """No prefix cache here."""

    def allocate(self, seq: Sequence, n: int) -> None:
        if n > 0:
            seq.pages.extend(self.allocator.allocate(n))

    def free(self, seq: Sequence) -> None:
        self.on_free(seq)
        if seq.pages:
            self.allocator.free(seq.pages)
            seq.pages = []


class MirrorPages(PagesStage):
    """The commit's pages stage in foreign-pool mode: the mirror copies the rows a step wrote
    into kvhold pages and publishes them (count, checksum), then the journal's page lists name
    those pages. Never deferred: the mirror publishes from the plan as it stood, at once."""

    def __init__(self, mirror: KvMirror, journal, page_tokens: int):
        self.mirror = mirror
        self.journal = journal
        self.page_tokens = page_tokens
        self.mirrored_blocks = 0
        self._queued = None             # (plan, _queue_decode(plan)) queued by after_forward

    def after_forward(self, plan) -> None:
        """The step's forward is queued and its results not yet read back. Queue the mirror's
        copy of a decode step now, behind the forward: the step's read-back then waits for it
        too, and the commit only publishes (no wait of its own)."""
        self._queued = (plan, self._queue_decode(plan))

    def _queue_decode(self, plan) -> tuple[DecodeBatch, list[int]] | None:
        """The decode fast path's copy (KvMirror.queue_decode) and the rows that start a block;
        None if a row is not a decode row extending its block by one token (nothing was done)."""
        pt, rids, indices, blocks, rows, started = self.page_tokens, [], [], [], [], []
        for p in plan:
            if p.n != 1:
                return None
            s = p.seq
            i, row = divmod(s.num_computed, pt)
            if not row:
                started.append(len(rows))
            rids.append(s.request_id)
            indices.append(i)
            blocks.append(s.pages[i])
            rows.append(row)
        batch = self.mirror.queue_decode(rids, indices, blocks, rows)
        return None if batch is None else (batch, started)

    def publish(self, plan, slot_hashes) -> None:
        """Mirror every block this step wrote, then list the new kvhold pages in the journal.

        A CUDA decode step hashes the one slot it wrote in each private block (`slot_hashes`,
        by block); the mirror reuses those for the copied rows. A decode step takes the
        mirror's fast path (queued by `after_forward` if the runner calls it)."""
        queued, self._queued = self._queued, None
        fast = queued[1] if queued is not None and queued[0] is plan else self._queue_decode(plan)
        if fast is None:
            self._publish_blocks(plan, slot_hashes)
            return
        batch, started = fast
        hashes = [slot_hashes.get(b) for b in batch.blocks.tolist()]
        self.mirrored_blocks += self.mirror.publish_decode(batch, None if None in hashes else hashes)
        for i in started:                   # a journal list grows when a page is assigned
            self._list_pages(plan[i].seq)

    def _publish_blocks(self, plan, slot_hashes) -> None:
        """The general path (prefill chunks, mixed steps): one Committed per written block."""
        pt, work, row_hashes = self.page_tokens, [], {}
        for p in plan:
            s = p.seq
            for i in range(s.num_computed // pt, (s.num_computed + p.n - 1) // pt + 1):
                work.append(Committed(s.request_id, i, s.pages[i], min(pt, s.num_computed + p.n - i * pt)))
            if p.n == 1 and (block := s.pages[s.num_computed // pt]) in slot_hashes:
                row_hashes[block, s.num_computed % pt] = slot_hashes[block]
        fresh = {c.request_id for c in work if self.mirror.page_of(c.request_id, c.index) is None}
        self.mirrored_blocks += self.mirror.mirror_committed(work, row_hashes)
        for p in plan:                  # a journal list grows only when the mirror assigns a page
            if p.seq.request_id in fresh:
                self._list_pages(p.seq)

    def _list_pages(self, seq: Sequence) -> None:
        list_mirrored_pages(self.journal, self.mirror, seq.slot, seq.request_id)


class ForeignEngine(Engine):
    """Engine over a private KV pool; its commit's pages stage is the mirror (MirrorPages), which
    writes kvhold's pool (see module docstring)."""

    def __init__(self, model, private_kv: KvCache, tables, lease, max_batch: int,
                 max_batch_tokens: int, mirror: KvMirror, runner=None, checksum=None,
                 prefill_chunk=None):
        super().__init__(model, private_kv, tables, lease, max_batch, max_batch_tokens,
                         runner=runner, checksum=checksum, prefill_chunk=prefill_chunk)
        self.mirror = mirror
        self.blocks = PrivateBlocks(private_kv.num_pages, self.journal, self.page_tokens, self._drop)
        self.scheduler.blocks = self.commits.blocks = self.blocks
        self.commits.pages = MirrorPages(mirror, self.journal, self.page_tokens)

    def _drop(self, seq: Sequence) -> None:
        self.lease.check()
        self.journal.set_num_pages(seq.slot, 0)          # the list shrinks before the records clear
        self.mirror.release(seq.request_id)

    # ------------------------------------------------------------------ takeover
    def takeover_strategy(self) -> ForeignTakeover:
        return ForeignTakeover(self.takeover_context(), self.mirror)

    def release_quarantined(self, epochs) -> int:
        return self.mirror.release_quarantined(epochs)


class ForeignEngineWorkload(EngineWorkload):
    """EngineWorkload whose engine computes into a private pool (settings.kv_mode == "foreign").

    The private pool has as many blocks as kvhold's pool (so whatever fits in kvhold's pages
    fits in the engine); it is this process's memory and dies with it. kvhold's pool is
    written only by the mirror, and only by the active executor (a standby builds the
    mirror but writes nothing until `promote` restores)."""

    def prepare(self) -> None:
        super().prepare()
        self.engine.mirror.warm_up()            # reads kvhold's pool, writes a scratch tensor only

    def _kv_cache(self, geometry, device) -> KvCache:
        self.shared_kv = KvCache.from_mapping(self.ctx.mappings["kv"], geometry.kv, geometry.num_pages)
        return KvCache.private(geometry.kv, geometry.num_pages, device)

    def _make_engine(self, model, kv, max_batch, max_tokens, runner, checksum, chunk) -> Engine:
        mirror = KvMirror(self.ctx.tables, self.shared_kv.pool, engine_blocks(kv), self.ctx.lease)
        log.info("foreign KV pool: %d private blocks, mirrored into kvhold's %d pages",
                 kv.num_pages, self.shared_kv.num_pages)
        return ForeignEngine(model, kv, self.ctx.tables, self.ctx.lease, max_batch, max_tokens, mirror,
                             runner=runner, checksum=checksum, prefill_chunk=chunk)


def foreign_engine_like(engine: Engine, shared_kv: KvCache) -> ForeignEngine:
    """`engine`'s model, runner, private pool and tables, run in foreign mode with a mirror into
    `shared_kv` (tools/bench_mirror: both modes measured on one loaded model). `engine` must
    have no requests, and is not stepped again."""
    sched = engine.scheduler
    mirror = KvMirror(engine.tables, shared_kv.pool, engine_blocks(engine.kv), engine.lease)
    return ForeignEngine(engine.model, engine.kv, engine.tables, engine.lease, sched.max_batch,
                         sched.max_batch_tokens, mirror, runner=engine.runner, checksum=engine.checksum,
                         prefill_chunk=sched.prefill_chunk)


class ForeignTakeover:
    """TakeoverStrategy of a ForeignEngine: restore each request's intact KV from kvhold's
    mirrored pages into fresh private blocks (module docstring). `ctx`: the engine's
    TakeoverContext (its blocks are the private pool's); `mirror`: its KV mirror."""
    kv_mode = "foreign"

    def __init__(self, ctx: TakeoverContext, mirror: KvMirror):
        self.ctx = ctx
        self.mirror = mirror
        self.blocks: dict[int, list[int]] = {}        # request id -> private blocks, logical order
        self.restored: dict[int, Restored] = {}

    def validate(self, plans: list[RequestPlan], pending: set[int]) -> None:
        """Give every request the private blocks its KV needs, then `KvMirror.restore`."""
        ctx = self.ctx
        recorded = _recorded_tokens(ctx.page_table)
        allocator = ctx.blocks.allocator
        for plan in plans:     # the last journal token is the next input: its KV is recomputed
            need = math.ceil(max(0, plan.entry.num_tokens - 1) / ctx.page_tokens)
            self.blocks[plan.entry.request_id] = allocator.allocate(min(need, allocator.num_free))
        self.restored = self.mirror.restore(self.blocks, self.mirror.layout, pending)
        for plan in plans:
            r = self.restored[plan.entry.request_id]
            plan.valid_tokens, plan.first_bad = r.tokens_restored, r.first_bad
            plan.recorded_tokens = recorded.get(plan.entry.request_id, 0)

    def clear(self, plans: list[RequestPlan], pending: set[int]) -> None:
        pass                    # `restore` released or quarantined every page nothing keeps

    def place_tails(self, plans: list[RequestPlan], pending: set[int]) -> None:
        pass                    # restored tails are copies in private blocks already

    def attach(self, plans: list[RequestPlan]) -> list[list[int]]:
        return [self._attach(plan) for plan in plans]

    def _attach(self, plan: RequestPlan) -> list[int]:
        """Keep the restored blocks, free the others; the kvhold pages are the mirror's."""
        rid = plan.entry.request_id
        own, kept = self.blocks[rid], self.restored[rid].blocks_restored
        self.ctx.blocks.allocator.free(own[kept:])
        plan.seq.pages = own[:kept]
        pages = []
        while (page := self.mirror.page_of(rid, len(pages))) is not None:
            pages.append(page)
        return pages

    def figures(self) -> PageFigures:
        stats = self.mirror.last_restore
        return PageFigures(checked=stats["pages_checked"], bad=stats["pages_bad"],
                           quarantined=stats["pages_quarantined"], interrupted=0, copied=0)


def _recorded_tokens(page_table) -> dict[int, int]:
    """KV tokens the dead executor had mirrored, per request (for the recomputation figure)."""
    records = page_table.snapshot()
    live = (records["owner"] != 0) & ((records["flags"] & PageFlag.QUARANTINED) == 0)
    out: dict[int, int] = {}
    for owner, count in zip(records["owner"][live].tolist(), records["num_tokens"][live].tolist()):
        out[int(owner)] = out.get(int(owner), 0) + int(count)
    return out
