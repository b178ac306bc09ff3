"""vLLM's prefix caching over kvhold's shared pages, without vLLM: the connector's planner and
worker (kvhold.vllm_bridge.connector) and the KV mirror's sharing (KvMirror.settle_full) on real
shared-memory tables and KV region, vLLM's CPU cache layout over private tensors, scheduler
outputs as vLLM 0.32 shapes them. vLLM's own cache decisions (which blocks a request starts on)
are given here as vLLM would make them."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvhold.executor.engine_bridge import list_mirrored_pages
from kvhold.executor.prefix_cache import PrefixCache, chain_keys, root_key
from kvhold.protocol.layout import PageFlag
from kvhold.vllm_bridge.connector import Bridge, MirrorPlanner, MirrorWorker
from tests.unit.helpers import mirror_geometry

KV = mirror_geometry().kv
BLOCKS = 12
BT = KV.page_tokens
SALT = b"weights:float32"
SHARED = list(range(100, 108))               # two full blocks both prompts begin with


@pytest.fixture
def pool_geometry():
    return mirror_geometry()


def caches():
    shape = (BLOCKS, KV.num_kv_heads, BT, 2 * KV.head_dim)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(shape) for i in range(KV.num_layers)}


def no_cached():
    return SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())


class Lists:
    """The journal's page lists (what list_mirrored_pages reads and writes), one per slot."""

    def __init__(self):
        self.lists: dict[int, list[int]] = {}

    def num_pages(self, slot):
        return len(self.lists.get(slot, []))

    def set_pages(self, slot, pages, first=0):
        self.lists[slot] = self.lists.get(slot, [])[:first] + list(pages)


def engine(pool, slot=0):
    b = Bridge(pool.tables, pool.kv, pool.lease(slot), active=True, prefix=PrefixCache(SALT, BT))
    planner, worker = MirrorPlanner(b, BT), MirrorWorker(b, BT, KV.num_kv_heads, KV.head_dim)
    return b, planner, worker


def start(planner, worker, vid, tokens, blocks, local=0):
    """vLLM schedules a new request whose first `local` tokens it found in its own prefix cache."""
    planner.matched_tokens(vid, len(tokens), local, tokens)
    req = SimpleNamespace(req_id=vid, block_ids=(blocks,), num_computed_tokens=local, prompt_token_ids=tokens)
    meta = planner.build([req], no_cached(), {vid: len(tokens) - local})
    worker.save(meta)
    return meta


def test_full_pages_are_cached_under_the_native_keys_and_a_cache_hit_shares_them(pool):  # noqa: F811
    b, planner, worker = engine(pool)
    vllm = caches()
    worker.register(vllm)
    mirror, lists = b.mirror, Lists()
    a_tokens, b_tokens = SHARED + [1, 2], SHARED + [3, 4, 5, 6]
    start(planner, worker, "kvh7-e1", a_tokens, [3, 5, 8])
    list_mirrored_pages(lists, mirror, 0, 7)
    a_pages = lists.lists[0]
    keys = chain_keys(root_key(SALT), a_tokens, BT, 2)
    assert keys == b.prefix.keys(a_tokens, 2)                          # the native engine's keys
    rec = pool.tables.pages
    assert rec["owner"][a_pages[:2]].tolist() == keys and (rec["flags"][a_pages[:2]] & PageFlag.CACHED).all()
    assert rec["owner"][a_pages[2]] == 7 and not rec["flags"][a_pages[2]] & PageFlag.CACHED   # partial: its own
    # vLLM serves B's first two blocks from its cache (A's blocks 3 and 5): B lists A's pages, no copy
    meta = start(planner, worker, "kvh9-e1", b_tokens, [3, 5, 6], local=2 * BT)
    assert [f.hit for f in meta.full] == [True, True, False]     # 0, 1 found; 2 computed whole
    list_mirrored_pages(lists, mirror, 1, 9)
    b_pages = lists.lists[1]
    assert b_pages[:2] == a_pages[:2] and b_pages[2] not in a_pages
    assert mirror.pages_shared == 2 and mirror.pages_copied == 0
    assert [b.prefix.refs[p] for p in a_pages[:2]] == [2, 2]
    assert rec["owner"][b_pages[2]] == b.prefix.keys(b_tokens, 3)[2]     # B's own full block, cached too
    # a shared page is one page of the pool, whoever lists it
    used = int((rec["owner"] != 0).sum())
    assert used == 4 == len(set(a_pages) | set(b_pages))
    # A ends: its own tail is freed, the shared pages keep B's reference; B ends: they are idle
    mirror.release(7)
    assert rec["owner"][a_pages[2]] == 0 and [b.prefix.refs[p] for p in a_pages[:2]] == [1, 1]
    mirror.release(9)
    assert b.prefix.evictable == 3 and (rec["flags"][b_pages] & PageFlag.CACHED).all()


def test_idle_cached_pages_are_evicted_lru_and_an_evicted_hit_is_copied(pool):  # noqa: F811
    b, planner, worker = engine(pool)
    vllm = caches()
    worker.register(vllm)
    mirror, lists = b.mirror, Lists()
    start(planner, worker, "kvh7-e1", SHARED + [1], [3, 5, 8])
    list_mirrored_pages(lists, mirror, 0, 7)
    first = lists.lists[0][:2]
    mirror.release(7)
    assert b.prefix.evictable == 2
    others = mirror.allocator.allocate(mirror.allocator.num_free - 1)   # the pool all but full
    # a request needing 3 fresh pages: the free one, then the idle cached ones, least recently used first
    a_keys = b.prefix.keys(SHARED, 2)
    start(planner, worker, "kvh8-e1", list(range(200, 212)), [1, 2, 4])
    list_mirrored_pages(lists, mirror, 3, 8)
    rec = pool.tables.pages
    assert b.prefix.evictable == 0 and set(first) <= set(lists.lists[3])   # reused for the new request
    assert not set(a_keys) & set(b.prefix.by_key) and mirror.source.get(3) != first[0]
    mirror.allocator.free(others)
    # vLLM still has A's blocks 3 and 5 cached; kvhold evicted their pages: they are copied
    start(planner, worker, "kvh9-e1", SHARED + [9, 9], [3, 5, 6], local=2 * BT)
    list_mirrored_pages(lists, mirror, 1, 9)
    copied = lists.lists[1][:2]
    assert mirror.pages_copied == 2 and (rec["flags"][copied] & PageFlag.CACHED).all()
    got = pool.kv[torch.tensor(copied)]
    want = worker.layout.read(torch.tensor([3, 5])).to(got.dtype)
    assert torch.equal(got, want)                     # every row of both blocks, bit for bit
    assert rec["num_tokens"][copied].tolist() == [BT, BT]
    # and another hit on them shares the copies
    start(planner, worker, "kvh10-e1", SHARED + [8, 8], [3, 5, 7], local=2 * BT)
    list_mirrored_pages(lists, mirror, 2, 10)
    assert lists.lists[2][:2] == copied and mirror.pages_copied == 2


def test_a_block_vllm_reuses_stops_standing_for_its_old_page(pool):  # noqa: F811
    b, planner, worker = engine(pool)
    worker.register(caches())
    mirror = b.mirror
    start(planner, worker, "kvh7-e1", SHARED + [1], [3, 5, 8])
    old = mirror.source[3]
    mirror.release(7)
    # vLLM evicts block 3 from its cache and gives it to another request, which computes into it
    start(planner, worker, "kvh8-e1", [50, 51], [3])
    assert 3 not in mirror.source and b.prefix.is_cached(old)      # the page keeps its own bytes


def test_a_takeover_restores_shared_pages_checked_once_and_relists_a_superseded_page(pool):  # noqa: F811
    b, planner, worker = engine(pool)
    worker.register(caches())
    lists = Lists()
    a_tokens, b_tokens = SHARED + [1, 2], SHARED + [3, 4]
    start(planner, worker, "kvh7-e1", a_tokens, [3, 5, 8])
    start(planner, worker, "kvh9-e1", b_tokens, [3, 5, 6], local=2 * BT)
    for slot, rid in ((0, 7), (1, 9)):
        list_mirrored_pages(lists, b.mirror, slot, rid)
    shared = lists.lists[0][:2]
    assert lists.lists[1][:2] == shared

    # the executor dies; its successor validates what the journal lists
    b2, planner2, worker2 = engine(pool, slot=1)
    worker2.register({k: torch.zeros_like(v) for k, v in caches().items()})
    plans = b2.mirror.plan_restore({7: 3, 9: 3}, pending_epochs=[], listed={7: lists.lists[0], 9: lists.lists[1]})
    assert list(plans[7].pages) == lists.lists[0] and list(plans[9].pages) == lists.lists[1]
    assert b2.mirror.last_restore == {"pages_checked": 4, "pages_bad": 0, "pages_quarantined": 0}
    assert [b2.prefix.refs[p] for p in shared] == [2, 2] and b2.prefix.evictable == 0
    rec = pool.tables.pages
    assert (rec["flags"][shared] & PageFlag.CACHED).all()

    # resubmitted: A loads its prefix into blocks 0, 1, 2; vLLM then serves B's first two blocks from
    # A's loaded blocks: B's pages for them are the ones A loaded (here the same pages: nothing to do)
    for rid, pages in ((7, plans[7].pages), (9, plans[9].pages)):
        b2.restorable[rid] = (pages, tuple(int(b2.mirror.counts[p]) for p in pages))
    assert planner2.matched_tokens("kvh7-e2", 11, 0, a_tokens + [40]) == 10
    assert planner2.matched_tokens("kvh9-e2", 11, 2 * BT, b_tokens + [41]) == 2     # past the local hit
    reqs = [SimpleNamespace(req_id="kvh7-e2", block_ids=([0, 1, 2],), num_computed_tokens=10),
            SimpleNamespace(req_id="kvh9-e2", block_ids=([0, 1, 4],), num_computed_tokens=10)]
    meta = planner2.build(reqs, no_cached(), {"kvh7-e2": 1, "kvh9-e2": 1})
    assert meta.loads == [(7, list(plans[7].pages), [0, 1, 2], 10), (9, [plans[9].pages[2]], [4], 2)]
    worker2.load(meta)
    worker2.save(meta)
    assert b2.mirror.pages_shared == 0 and not b2.mirror.relist
    assert [b2.prefix.refs[p] for p in shared] == [2, 2]

    # a request that held its own page for a block vLLM now serves from another: the list is
    # rewritten first, then the old page goes
    own = b2.mirror.page_of(9, 2)
    b2.mirror.source[11] = shared[0]          # as if vLLM served B's block 2 from block 11
    from kvhold.executor.kv_mirror import FullBlock
    b2.mirror.settle_full([FullBlock(9, 2, 11, 0, True)])
    assert b2.mirror.relist == {9: 2} and b2.mirror.superseded == {9: [own]}
    assert rec["owner"][own] == 9                 # still listed: still held
    list_mirrored_pages(lists, b2.mirror, 1, 9)
    assert lists.lists[1][2] == shared[0] and rec["owner"][own] == 0 and not b2.mirror.superseded
    assert np.count_nonzero(rec["owner"]) == 3


def test_a_request_resumed_on_cached_blocks_keeps_or_replaces_its_pages(pool):  # noqa: F811
    b, planner, worker = engine(pool)
    worker.register(caches())
    mirror, lists = b.mirror, Lists()
    tokens = SHARED + [1, 2, 3, 4]                       # 3 full blocks
    start(planner, worker, "kvh7-e1", tokens, [3, 5, 8])
    list_mirrored_pages(lists, mirror, 0, 7)
    own = list(lists.lists[0])
    assert [mirror.source[blk] for blk in (3, 5, 8)] == own
    # vLLM preempts it and resumes it on its own cached blocks 3 and 5, recomputing block 2 into 9
    resumed = SimpleNamespace(req_ids=["kvh7-e1"], new_block_ids=[([3, 5, 9],)], num_computed_tokens=[8],
                              resumed_req_ids={"kvh7-e1"})
    meta = planner.build([], resumed, {"kvh7-e1": 4})
    assert [(f.index, f.block, f.hit) for f in meta.full] == [(0, 3, True), (1, 5, True), (2, 9, False)]
    worker.save(meta)
    assert not mirror.relist and mirror.pages_shared == 0 and mirror.pages_copied == 0
    assert [mirror.page_of(7, i) for i in range(3)] == own and mirror.source[9] == own[2]
    # resumed again, now on block 2 as another request computed it (block 10): its own page for
    # block 2 is replaced by the one vLLM's block holds, once its list is written again
    planner.matched_tokens("kvh8-e1", 12, 8, list(tokens))        # vLLM's own hit: blocks 3 and 5
    other = SimpleNamespace(req_id="kvh8-e1", block_ids=([3, 5, 10],), num_computed_tokens=8,
                            prompt_token_ids=list(tokens))
    worker.save(planner.build([other], no_cached(), {"kvh8-e1": 4}))   # (a duplicate of block 9's tokens)
    dup = mirror.source[10]
    assert dup not in own and b.prefix.is_cached(dup)
    tokens.append(77)                     # it has generated a token since (vLLM's live view grows)
    resumed = SimpleNamespace(req_ids=["kvh7-e1"], new_block_ids=[([3, 5, 10, 11],)], num_computed_tokens=[12],
                              resumed_req_ids={"kvh7-e1"})
    worker.save(planner.build([], resumed, {"kvh7-e1": 1}))
    assert mirror.page_of(7, 2) == dup and mirror.relist == {7: 2} and mirror.superseded == {7: [own[2]]}
    list_mirrored_pages(lists, mirror, 0, 7)
    assert lists.lists[0][:3] == own[:2] + [dup] and b.prefix.refs[own[2]] == 0 and b.prefix.refs[dup] == 2


def test_a_resubmitted_request_wholly_in_vllms_cache_loads_nothing_and_drops_its_plan(pool):  # noqa: F811
    b, planner, worker = engine(pool)
    worker.register(caches())
    b.restorable[7] = ((1, 2), (BT, BT))
    assert planner.matched_tokens("kvh7-e2", 9, 2 * BT, SHARED + [1]) == 0     # all but the last token hit
    req = SimpleNamespace(req_id="kvh7-e2", block_ids=([3, 5, 6],), num_computed_tokens=2 * BT)
    meta = planner.build([req], no_cached(), {"kvh7-e2": 1})
    assert meta.loads == [] and 7 not in b.restorable


def test_kvhold_needs_no_more_pages_than_vllm_has_blocks(pool):  # noqa: F811
    """Six requests on one 2-block prefix use 2 + 6 of vLLM's 11 blocks (block 0 is its null
    block): with as many kvhold pages as that, every step is mirrored (copies would need 18)."""
    b, planner, worker = engine(pool)
    worker.register(caches())
    mirror, lists = b.mirror, Lists()
    mirror.allocator.allocate(mirror.allocator.num_free - (BLOCKS - 1))       # kvhold's pages = vLLM's blocks
    start(planner, worker, "kvh1-e1", SHARED + [1, 1, 1, 1], [1, 2, 3])
    for rid in range(2, 7):                              # vLLM serves the prefix from its cache
        start(planner, worker, f"kvh{rid}-e1", SHARED + [rid] * 4, [1, 2, 2 + rid], local=2 * BT)
    for rid in range(1, 7):
        list_mirrored_pages(lists, mirror, rid, rid)
    assert len({p for lst in lists.lists.values() for p in lst}) == 8 and mirror.allocator.num_free == 3
    assert all(lst[:2] == lists.lists[1][:2] for lst in lists.lists.values())


def _cached_then_taken_over(pool, tokens):
    """An executor computes `tokens` for request 7, which finishes (its full pages stay cached,
    idle); the executor dies with no request live and a successor takes over. Returns the
    successor's (bridge, planner, worker), its vLLM caches and request 7's pages."""
    b, planner, worker = engine(pool)
    worker.register(caches())
    lists = Lists()
    start(planner, worker, "kvh7-e1", tokens, [3, 5, 8])
    list_mirrored_pages(lists, b.mirror, 0, 7)
    b.mirror.release(7)
    b2, planner2, worker2 = engine(pool, slot=1)
    vllm = {k: torch.zeros_like(v) for k, v in caches().items()}
    worker2.register(vllm)
    b2.mirror.plan_restore({}, pending_epochs=[], listed={})
    return b2, planner2, worker2, lists.lists[0]


def test_a_new_request_after_a_takeover_loads_the_dead_engines_cached_pages(pool):  # noqa: F811
    """The takeover keeps the idle cached pages (unchecked); a new request with the same prefix is
    offered them past vLLM's (empty) cache, checked first, as an external hit: loaded into the
    blocks vLLM gives it, listed shared (the same page ids), and then standing for those blocks."""
    a_tokens, b_tokens = SHARED + [1, 2], SHARED + [5, 6, 7]
    b2, planner2, worker2, a_pages = _cached_then_taken_over(pool, a_tokens)
    mirror, rec, shared = b2.mirror, pool.tables.pages, a_pages[:2]
    assert (rec["flags"][shared] & PageFlag.CACHED).all() and rec["owner"][a_pages[2]] == 0   # tail freed
    assert set(b2.prefix.unverified) == set(shared) and not b2.prefix.by_key     # kept, not checked yet
    assert not set(shared) & mirror.allocator._is_free
    # all but the last token at most: two full blocks, past vLLM's empty local hit
    assert planner2.matched_tokens("kvh9-e2", len(b_tokens), 0, b_tokens) == 2 * BT
    assert not b2.prefix.unverified and [b2.prefix.refs[p] for p in shared] == [1, 1]   # checked, referenced
    assert b2.prefix.evictable == 0                       # an eviction cannot take them while loading
    planner2.after_alloc("kvh9-e2", 2 * BT)
    req = SimpleNamespace(req_id="kvh9-e2", block_ids=([0, 1, 2],), num_computed_tokens=2 * BT)
    meta = planner2.build([req], no_cached(), {"kvh9-e2": len(b_tokens) - 2 * BT})
    assert meta.offers == [(9, 0, shared, [0, 1])] and meta.loads == []
    worker2.load(meta)
    got = worker2.layout.read(torch.tensor([0, 1]))
    assert torch.equal(got, pool.kv[torch.tensor(shared)].to(got.dtype))     # loaded bit for bit
    worker2.save(meta)
    lists = Lists()
    list_mirrored_pages(lists, mirror, 0, 9)
    assert lists.lists[0][:2] == shared and len(lists.lists[0]) == 3     # shared pages, then its own
    assert rec["owner"][lists.lists[0][2]] == 9
    assert b2.pages_offered == 2 and b2.tokens_offered == 2 * BT and b2.pages_loaded == 0
    assert [mirror.source[blk] for blk in (0, 1)] == shared               # vLLM's loaded blocks
    assert [b2.prefix.refs[p] for p in shared] == [1, 1] and mirror.pages_copied == 0
    # a second request vLLM serves from the loaded blocks lists the same pages, by reference
    start(planner2, worker2, "kvh10-e2", SHARED + [8, 8, 8], [0, 1, 4], local=2 * BT)
    list_mirrored_pages(lists, mirror, 1, 10)
    assert lists.lists[1][:2] == shared and [b2.prefix.refs[p] for p in shared] == [2, 2]
    mirror.release(9)
    mirror.release(10)
    assert b2.prefix.evictable == 2 and [b2.prefix.refs[p] for p in shared] == [0, 0]


def test_a_cached_page_found_damaged_is_not_offered_and_is_freed(pool):  # noqa: F811
    b2, planner2, worker2, a_pages = _cached_then_taken_over(pool, SHARED + [1, 2])
    pool.kv[a_pages[1]].view(-1)[5] += 1.0                  # block 1's bytes changed since published
    assert planner2.matched_tokens("kvh9-e2", 11, 0, SHARED + [5, 6, 7]) == BT        # block 0 only
    rec = pool.tables.pages
    assert rec["owner"][a_pages[1]] == 0 and a_pages[1] in b2.mirror.allocator._is_free
    assert b2.prefix.find(b2.prefix.keys(SHARED, 2)) == [a_pages[0]]


def test_an_offer_vllm_does_not_take_is_withdrawn(pool):  # noqa: F811
    b2, planner2, worker2, a_pages = _cached_then_taken_over(pool, SHARED + [1, 2])
    shared, prefix = a_pages[:2], b2.prefix
    # a prompt of exactly the two blocks: its last token is computed, so one block is offered
    assert planner2.matched_tokens("kvh9-e2", len(SHARED), 0, SHARED) == BT
    # a request that skips the cache (prompt_logprobs): vLLM takes no external hit
    planner2.after_alloc("kvh9-e2", 0)
    assert prefix.refs[shared[0]] == 0 and prefix.evictable == 2
    # past vLLM's own hit of one block, the second page; the allocation fails, the lookup is made
    # again (the first offer withdrawn), then the request is aborted while waiting
    assert planner2.matched_tokens("kvh11-e2", 11, BT, SHARED + [4, 4, 4]) == BT
    assert planner2.matched_tokens("kvh11-e2", 11, BT, SHARED + [4, 4, 4]) == BT
    assert prefix.refs[shared[1]] == 1 and prefix.refs[shared[0]] == 0
    planner2.finished("kvh11-e2")
    assert prefix.refs[shared[1]] == 0 and prefix.evictable == 2
    # a takeover's resubmission is not offered anything (its own restore plan, if any, applies)
    b2.watch[12] = 11
    assert planner2.matched_tokens("kvh12-e2", 11, 0, SHARED + [4, 4, 4]) == 0
    # nor is a standby's
    b2.active = False
    assert planner2.matched_tokens("kvh13-e2", 11, 0, SHARED + [4, 4, 4]) == 0


def test_the_kept_idle_cached_pages_are_checked_in_batches(pool):  # noqa: F811
    b2, planner2, worker2, a_pages = _cached_then_taken_over(pool, SHARED + [1, 2])
    shared, prefix, mirror = a_pages[:2], b2.prefix, b2.mirror
    pool.kv[shared[0]].view(-1)[3] -= 1.0
    assert mirror.verify_cached(limit=1) == 1 and len(prefix.unverified) == 1
    assert mirror.verify_cached() == 1 and not prefix.unverified and mirror.verify_cached() == 0
    rec = pool.tables.pages
    assert rec["owner"][shared[0]] == 0 and shared[0] in mirror.allocator._is_free      # damaged: freed
    assert prefix.by_key == {prefix.keys(SHARED, 2)[1]: shared[1]} and prefix.idle == {shared[1]: None}
    # the run from block 0 is broken: nothing is offered
    assert planner2.matched_tokens("kvh9-e2", 11, 0, SHARED + [5, 6, 7]) == 0
