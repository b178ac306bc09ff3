"""KV mirror: engine blocks -> kvhold pages (versioned, checksummed) -> a fresh engine pool.

Real shared-memory tables and KV region; the engine pools are private tensors in two
layouts (per-layer NHD, TensorRT-LLM-style pooled HND). The crash test SIGKILLs a real
writer process at an arbitrary instruction and restores in the parent.
"""
import os
import random
import signal
import time

import pytest
import torch

from kvhold.executor.kv_cache import KvCache
from kvhold.protocol.leases import Fenced, Lease
from kvhold.protocol.tables import Tables
from kvhold.executor.block_layout import BlockLayout
from kvhold.executor.kv_mirror import Committed, KvMirror, PerLayerBlocks, PooledBlocks
from tests.unit.helpers import ShmPool, mirror_geometry

GEOM = mirror_geometry()
KV = GEOM.kv
ENGINE_BLOCKS = 300


@pytest.fixture
def pool_geometry():
    return GEOM


def per_layer(fill=None):
    shape = (ENGINE_BLOCKS, 2, KV.page_tokens, KV.num_kv_heads, KV.head_dim)
    caches = [torch.zeros(shape) if fill is None else fill(shape) for _ in range(KV.num_layers)]
    return PerLayerBlocks(caches, KV.num_kv_heads, KV.head_dim, KV.page_tokens)


def pooled():
    size = KV.page_tokens * KV.num_kv_heads * KV.head_dim
    return PooledBlocks(torch.zeros(ENGINE_BLOCKS, KV.num_layers, 2, size), KV.num_kv_heads,
                        KV.head_dim, KV.page_tokens, head_major=True)


def token_kv(rid: int, pos: int) -> torch.Tensor:
    """Deterministic K/V of one token of one request, [L, 2, H, D]."""
    gen = torch.Generator().manual_seed(rid * 100_003 + pos)
    return torch.randn(KV.num_layers, 2, KV.num_kv_heads, KV.head_dim, generator=gen)


class FakeEngine:
    """Decodes token by token into its own pool; blocks come from a shuffled private free list."""

    def __init__(self, layout, seed=0):
        self.layout = layout
        self.free = list(range(ENGINE_BLOCKS))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[int, list[int]] = {}
        self.length: dict[int, int] = {}

    def step(self, rids) -> list[Committed]:
        out, T = [], KV.page_tokens
        for rid in rids:
            pos = self.length.get(rid, 0)
            blocks = self.blocks.setdefault(rid, [])
            if pos % T == 0:
                blocks.append(self.free.pop())
            block = torch.tensor([blocks[pos // T]])
            data = self.layout.read(block)
            data[0, :, :, pos % T] = token_kv(rid, pos)
            self.layout.write(block, data)
            self.length[rid] = pos + 1
            out.append(Committed(rid, pos // T, blocks[pos // T], pos % T + 1))
        return out


def expected(rid: int, tokens: int) -> torch.Tensor:
    return torch.stack([token_kv(rid, p) for p in range(tokens)])         # [N, L, 2, H, D]


def restored_tokens(layout, blocks, tokens: int) -> torch.Tensor:
    data = layout.read(torch.tensor(blocks, dtype=torch.long))            # [B, L, 2, T, H, D]
    return data.permute(0, 3, 1, 2, 4, 5).reshape(-1, *data.shape[1:3], *data.shape[4:])[:tokens]


def fresh_blocks(counts: dict[int, int], start=7) -> dict[int, list[int]]:
    out, nxt = {}, start
    for rid, n in counts.items():
        out[rid] = list(range(nxt, nxt + n))
        nxt += n
    return out


@pytest.mark.parametrize("make_source,make_target", [(per_layer, pooled), (pooled, per_layer)])
def test_mirror_then_restore_is_exact(pool, make_source, make_target):
    engine = FakeEngine(make_source())
    mirror = KvMirror(pool.tables, pool.kv, engine.layout, pool.lease(0))
    lengths = {11: 10, 12: 8, 13: 3}
    for step in range(max(lengths.values())):
        assert mirror.mirror_committed(engine.step([r for r, n in lengths.items() if step < n]))
    assert mirror.mirror_committed(engine.step([])) == 0
    rec = pool.tables.pages[mirror.page_of(11, 1)]
    assert rec["owner"] == 11 and rec["logical"] == 1 and rec["num_tokens"] == 4 and rec["version"] % 2 == 0

    target = make_target()
    fresh = KvMirror(pool.tables, pool.kv, target, pool.lease(1))
    blocks = fresh_blocks({11: 3, 12: 2, 13: 1})
    result = fresh.restore(blocks, target)
    for rid, n in lengths.items():
        r = result[rid]
        assert (r.blocks_restored, r.tokens_restored) == (len(blocks[rid]), n)
        assert r.first_bad is None and r.recompute == ()
        assert torch.equal(restored_tokens(target, blocks[rid], n), expected(rid, n))


def test_restored_mirror_continues_and_releases(pool):
    engine = FakeEngine(per_layer())
    old = KvMirror(pool.tables, pool.kv, engine.layout, pool.lease(0))
    for _ in range(6):
        old.mirror_committed(engine.step([5, 6]))
    pool.lease(0)                                        # the sidecar fences the old writer
    target = per_layer()
    fresh = KvMirror(pool.tables, pool.kv, target, pool.lease(1))
    blocks = fresh_blocks({5: 2})                       # request 6 finished meanwhile: released
    assert fresh.restore(blocks, target)[5].tokens_restored == 6
    assert set(pool.tables.pages["owner"][pool.tables.pages["owner"] != 0].tolist()) == {5}
    with pytest.raises(Fenced):
        old.mirror_committed(engine.step([5]))
    data = target.read(torch.tensor([blocks[5][1]]))
    data[0, :, :, 2] = token_kv(5, 6)                    # the new engine decodes token 6 ...
    target.write(torch.tensor([blocks[5][1]]), data)
    assert fresh.mirror_committed([Committed(5, 1, blocks[5][1], 3)]) == 1   # ... into the tail page
    again = per_layer()
    third = KvMirror(pool.tables, pool.kv, again, pool.lease(0))
    assert third.restore(blocks, again)[5].tokens_restored == 7
    assert torch.equal(restored_tokens(again, blocks[5], 7), expected(5, 7))
    assert third.release(5) == 2 and (pool.tables.pages["owner"] == 0).all()
    assert third.allocator.num_free == GEOM.num_pages - 1          # all but the null page


def test_bit_flip_marks_that_block_and_later_ones(pool):
    engine = FakeEngine(per_layer())
    mirror = KvMirror(pool.tables, pool.kv, engine.layout, pool.lease(0))
    for _ in range(14):                                   # 4 blocks: 4 + 4 + 4 + 2 tokens
        mirror.mirror_committed(engine.step([21, 22]))
    words = pool.kv.view(torch.int32)
    words[mirror.page_of(21, 1), 2, 1, 3, 1, 5] ^= 1 << 9    # layer 2, values, token 3
    words[mirror.page_of(22, 3), 0, 0, 3, 0, 0] ^= 1         # token 3 >= 2 committed: harmless
    target = per_layer()
    blocks = fresh_blocks({21: 4, 22: 4})
    result = KvMirror(pool.tables, pool.kv, target, pool.lease(1)).restore(blocks, target)
    assert result[21].first_bad == 1 and result[21].recompute == (1, 2, 3)
    assert result[21].blocks_restored == 1 and result[21].tokens_restored == 4
    assert torch.equal(restored_tokens(target, blocks[21], 4), expected(21, 4))
    assert result[22].first_bad is None and result[22].tokens_restored == 14


def test_interrupted_publish_keeps_the_rows_committed_before_it(pool):
    engine = FakeEngine(per_layer())
    mirror = KvMirror(pool.tables, pool.kv, engine.layout, pool.lease(0))
    for _ in range(6):                                    # blocks 0 (full) and 1 (2 tokens)
        mirror.mirror_committed(engine.step([41, 42, 43]))
    pages = pool.tables.pages
    pages["version"][mirror.page_of(41, 1)] += 1          # killed inside publish, fields intact
    torn = mirror.page_of(42, 1)
    pages["version"][torn] += 1                           # killed after the count, before the sum:
    pages["num_tokens"][torn] = 3                         # the old sum covers the 2 rows before
    broken = mirror.page_of(43, 1)
    pages["version"][broken] += 1                         # odd, and no prefix matches its sum
    pages["num_tokens"][broken] = 3
    pages["checksum"][broken] ^= 1
    target = per_layer()
    blocks = fresh_blocks({41: 2, 42: 2, 43: 2})
    result = KvMirror(pool.tables, pool.kv, target, pool.lease(1)).restore(blocks, target)
    assert result[41].tokens_restored == 6 and result[41].first_bad is None
    assert result[42].tokens_restored == 6 and result[42].first_bad is None
    assert torch.equal(restored_tokens(target, blocks[42], 6), expected(42, 6))
    assert pages["num_tokens"][torn] == 2                 # the record says what was kept
    assert result[43].tokens_restored == 4 and result[43].first_bad == 1 and result[43].recompute == (1,)
    assert (pages["version"] % 2 == 0).all()              # settled once the writer is gone
    assert pages["owner"][broken] == 0                    # the untrusted page went back to the pool


def decode_args(work: list[Committed]) -> tuple[list[int], list[int], list[int], list[int]]:
    """A decode step's Committed blocks as KvMirror.queue_decode's arguments."""
    return ([c.request_id for c in work], [c.index for c in work], [c.block for c in work],
            [c.num_tokens - 1 for c in work])


def mirror_decode(mirror: KvMirror, work: list[Committed], hashes=None) -> int:
    batch = mirror.queue_decode(*decode_args(work))
    assert batch is not None
    return mirror.publish_decode(batch, hashes)


def _writer(tables_name: str, kv_name: str, slot: int, epoch: int, wfd: int, fast: bool) -> None:
    """Child: decode and mirror forever, reporting each mirrored step's lengths on the pipe."""
    import posix_ipc

    from kvhold.protocol.memory import Mapping, RegionInfo

    torch.set_num_threads(1)                              # no OpenMP pool after fork
    tables = Tables.attach_name(tables_name)
    shm = posix_ipc.SharedMemory(kv_name)
    kv = KvCache.from_mapping(Mapping.from_fd(shm.fd, RegionInfo("kv", GEOM.kv_pool_bytes, "host", False)),
                              KV, GEOM.num_pages).pool
    engine = FakeEngine(per_layer(), seed=slot)
    mirror = KvMirror(tables, kv, engine.layout, Lease(tables, slot, epoch))
    rids = [31, 32, 33]
    for step in range(1, 10**6):
        if mirror.allocator.num_free < len(rids):
            signal.pause()
        work = engine.step(rids)
        mirror_decode(mirror, work) if fast else mirror.mirror_committed(work)
        os.write(wfd, f"{step}\n".encode())


@pytest.mark.parametrize("kill_after,fast", [(3, False), (9, False), (17, False), (40, False),
                                             (5, True), (23, True)])
def test_sigkilled_writer_loses_no_committed_block(pool, kill_after, fast):
    lease = pool.lease(0)
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:                                           # pragma: no cover - child
        os.close(rfd)
        try:
            _writer(pool.tables_name, pool.kv_name, 0, lease.epoch, wfd, fast)
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            os._exit(1)
    os.close(wfd)
    reported, buf = 0, b""
    with os.fdopen(rfd, "rb", buffering=0) as r:
        while reported < kill_after:
            chunk = r.read(4096)
            assert chunk, "the writer died on its own"
            *lines, buf = (buf + chunk).split(b"\n")
            reported = int(lines[-1]) if lines else reported
        time.sleep(random.Random(kill_after).uniform(0, 0.002))   # the point: a random moment
        os.kill(pid, signal.SIGKILL)                       # somewhere inside a later step
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    target = pooled()
    blocks = fresh_blocks({rid: GEOM.num_pages // 3 for rid in (31, 32, 33)}, start=0)
    result = KvMirror(pool.tables, pool.kv, target, pool.lease(1)).restore(blocks, target)
    for rid in (31, 32, 33):
        n = result[rid].tokens_restored
        assert n >= reported and result[rid].first_bad is None
        assert torch.equal(restored_tokens(target, blocks[rid], n), expected(rid, n))


def test_layout_must_match_geometry(pool):
    wrong = PerLayerBlocks([torch.zeros(4, 2, 8, 2, 8)] * 3, 2, 8, 8)      # 8-token blocks
    with pytest.raises(ValueError, match="do not match"):
        KvMirror(pool.tables, pool.kv, wrong, pool.lease(0))
    mirror = KvMirror(pool.tables, pool.kv, per_layer(), pool.lease(0))
    with pytest.raises(ValueError, match="bad committed block"):
        mirror.mirror_committed([Committed(0, 0, 1, 1)])                     # request id 0


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("kind", ["per_layer", "pooled"])
def test_read_rows_picks_the_rows_of_read(kind, head_major):
    """What the mirror copies each step: single token rows, in the canonical [N, L, 2, H, D]."""
    gen = torch.Generator().manual_seed(1)
    inner = (KV.num_kv_heads, KV.page_tokens, KV.head_dim) if head_major else \
        (KV.page_tokens, KV.num_kv_heads, KV.head_dim)
    if kind == "per_layer":
        layout = PerLayerBlocks([torch.randn(9, 2, *inner, generator=gen) for _ in range(KV.num_layers)],
                                KV.num_kv_heads, KV.head_dim, KV.page_tokens, head_major=head_major)
    else:
        layout = PooledBlocks(torch.randn(9, KV.num_layers, 2, KV.page_tokens * KV.num_kv_heads * KV.head_dim,
                                          generator=gen), KV.num_kv_heads, KV.head_dim, KV.page_tokens,
                              head_major=head_major)
    blocks, rows = torch.tensor([4, 0, 8, 4]), torch.tensor([3, 1, 0, 2])
    whole = layout.read(blocks)
    want = torch.stack([whole[i, :, :, int(r)] for i, r in enumerate(rows)])
    assert torch.equal(layout.read_rows(blocks, rows), want)
    assert torch.equal(BlockLayout.read_rows(layout, blocks, rows), want)     # the generic fallback


def test_engine_row_hashes_give_the_same_checksums(pool):
    """Hashes the engine computed over its own blocks (a CUDA decode step) stand in for hashing
    kvhold's copy: the published checksums are the same, and restore accepts them."""
    from kvhold.protocol.checksum import TorchChecksum, to_u64

    size = KV.page_tokens * KV.num_kv_heads * KV.head_dim
    layout = PooledBlocks(torch.zeros(ENGINE_BLOCKS, KV.num_layers, 2, size), KV.num_kv_heads,
                          KV.head_dim, KV.page_tokens)
    engine_sums = TorchChecksum(layout.view)                  # NHD blocks: kvhold's page layout
    a = FakeEngine(layout)
    hashed = KvMirror(pool.tables, pool.kv, a.layout, pool.lease(0))
    hashed.checksum = None                                    # every new row's hash is given
    for _ in range(7):
        work = a.step([51, 52])
        blocks = torch.tensor([c.block for c in work])
        slots = torch.tensor([c.num_tokens - 1 for c in work])
        sums = to_u64(engine_sums.slots(blocks, slots)).tolist()
        hashed.mirror_committed(work, {(c.block, c.num_tokens - 1): s for c, s in zip(work, sums)})
    pages = [hashed.page_of(51, 0), hashed.page_of(51, 1), hashed.page_of(52, 1)]
    published = pool.tables.pages["checksum"][pages].copy()
    recount = to_u64(TorchChecksum(pool.kv).pages(torch.tensor(pages), torch.tensor([4, 3, 3])))
    assert (published == recount).all()
    target = per_layer()
    blocks = fresh_blocks({51: 2, 52: 2})
    result = KvMirror(pool.tables, pool.kv, target, pool.lease(1)).restore(blocks, target)
    assert result[51].tokens_restored == 7 and result[52].first_bad is None
    assert torch.equal(restored_tokens(target, blocks[52], 7), expected(52, 7))


def test_restore_in_small_chunks_is_exact(pool, monkeypatch):
    """A takeover of many blocks copies them back a chunk at a time (bounded temporaries)."""
    import kvhold.executor.kv_mirror as kv_mirror

    monkeypatch.setattr(kv_mirror, "LOAD_CHUNK_BYTES", 2 * pool.kv[0].numel() * pool.kv.element_size())
    engine = FakeEngine(pooled())
    mirror = KvMirror(pool.tables, pool.kv, engine.layout, pool.lease(0))
    lengths = {61: 19, 62: 9, 63: 1}
    for step in range(max(lengths.values())):
        mirror.mirror_committed(engine.step([r for r, n in lengths.items() if step < n]))
    target = per_layer()
    blocks = fresh_blocks({61: 5, 62: 3, 63: 1})
    result = KvMirror(pool.tables, pool.kv, target, pool.lease(1)).restore(blocks, target)
    for rid, n in lengths.items():
        assert result[rid].tokens_restored == n
        assert torch.equal(restored_tokens(target, blocks[rid], n), expected(rid, n))


def _decode_schedule():
    """Which requests decode at each step: staggered starts (rows start blocks at different
    steps), a request that finishes and is released, one that joins late."""
    for step in range(23):
        rids = [rid for rid, (start, stop) in {71: (0, 23), 72: (2, 23), 73: (0, 9), 74: (11, 23)}.items()
                if start <= step < stop]
        yield step, rids


@pytest.mark.parametrize("make_layout", [per_layer, pooled])
@pytest.mark.parametrize("engine_hashes", [False, True])
def test_decode_fast_path_publishes_what_the_general_path_does(make_layout, engine_hashes):
    """queue_decode + publish_decode and mirror_committed, fed the same decode steps, leave the
    same page table (pages, owners, counts, checksums, versions), the same bytes in kvhold's
    pool, and the same holdings; restore reads the fast path's pages back exactly."""
    from kvhold.protocol.checksum import TorchChecksum, to_u64

    a, b = ShmPool(GEOM), ShmPool(GEOM)
    try:
        general = FakeEngine(make_layout(), seed=3)
        fast = FakeEngine(make_layout(), seed=3)
        slow_mirror = KvMirror(a.tables, a.kv, general.layout, a.lease(0))
        fast_mirror = KvMirror(b.tables, b.kv, fast.layout, b.lease(0))
        for step, rids in _decode_schedule():
            if step == 9:
                assert slow_mirror.release(73) == fast_mirror.release(73) == 3
            work = general.step(rids)
            assert fast.step(rids) == work
            hashes = None
            if engine_hashes:                             # the engine hashed its own rows
                canonical = TorchChecksum(general.layout.read(torch.arange(ENGINE_BLOCKS)).contiguous())
                hashes = to_u64(canonical.slots(torch.tensor([c.block for c in work]),
                                                torch.tensor([c.num_tokens - 1 for c in work]))).tolist()
            row_hashes = dict(zip([(c.block, c.num_tokens - 1) for c in work], hashes or []))
            assert slow_mirror.mirror_committed(work, row_hashes) == mirror_decode(fast_mirror, work, hashes) \
                == len(rids)
            assert (a.tables.pages == b.tables.pages).all(), step
            assert torch.equal(a.kv, b.kv), step
            assert slow_mirror.holdings() == fast_mirror.holdings()
        assert fast_mirror.allocator.num_free == slow_mirror.allocator.num_free
    finally:
        a.close()
    try:
        lengths = {71: 23, 72: 21, 74: 12}
        target = per_layer()
        blocks = fresh_blocks({rid: -(-n // KV.page_tokens) for rid, n in lengths.items()})
        result = KvMirror(b.tables, b.kv, target, b.lease(1)).restore(blocks, target)
        for rid, n in lengths.items():
            assert result[rid].tokens_restored == n and result[rid].first_bad is None
            assert torch.equal(restored_tokens(target, blocks[rid], n), expected(rid, n))
    finally:
        b.close()


def test_decode_fast_path_declines_what_it_cannot_publish(pool):
    """Anything but one new token per block, each request once: None, nothing changed (the
    engine then takes mirror_committed, which handles or rejects it)."""
    engine = FakeEngine(per_layer())
    lease = pool.lease(0)
    mirror = KvMirror(pool.tables, pool.kv, engine.layout, lease)
    for _ in range(5):                                   # 81: 4 + 1 tokens, 82: likewise
        mirror_decode(mirror, engine.step([81, 82]))
    b81, b82 = engine.blocks[81][1], engine.blocks[82][1]
    before = (pool.tables.pages.copy(), pool.kv.clone(), mirror.holdings(), mirror.allocator.num_free)
    declined = [
        ([81, 82], [1, 1], [b81, b82], [2, 1]),          # skips a row
        ([81, 82], [1, 1], [b81, b82], [0, 1]),          # rewrites a committed row
        ([81, 82], [1, 2], [b81, 7], [1, 1]),            # a block never mirrored, not from row 0
        ([81, 82], [0, 1], [engine.blocks[81][0], b82], [4, 1]),     # past the end of a full page
        ([81, 81], [1, 1], [b81, b81], [1, 1]),          # one request twice
        ([83, 83], [0, 0], [5, 5], [0, 0]),              # ... even for new blocks
        ([0, 82], [0, 1], [5, b82], [0, 1]),             # request id 0
        ([81, 82], [1, 1], [b81, ENGINE_BLOCKS], [1, 1]),            # engine block out of range
        ([], [], [], []),
    ]
    for args in declined:
        assert mirror.queue_decode(*args) is None, args
    after = (pool.tables.pages, pool.kv, mirror.holdings(), mirror.allocator.num_free)
    assert (before[0] == after[0]).all() and torch.equal(before[1], after[1]) and before[2:] == after[2:]
    with pytest.raises(ValueError, match="already committed"):
        mirror.mirror_committed([Committed(81, 0, engine.blocks[81][0], 3)])
    batch = mirror.queue_decode([81, 83], [1, 0], [b81, 5], [1, 0])       # a new request joins
    assert batch is not None and batch.pages[1] == mirror.page_of(83, 0)
    assert pool.tables.pages["owner"][batch.pages[1]] == 83                # assigned before the copy
    assert pool.tables.pages["num_tokens"][batch.pages[1]] == 0            # ... published after it
    assert mirror.publish_decode(batch) == 2
    assert pool.tables.pages["num_tokens"][batch.pages].tolist() == [2, 1]
    pool.lease(0)                                                          # fenced
    with pytest.raises(Fenced):
        mirror.queue_decode([81], [1], [b81], [2])
