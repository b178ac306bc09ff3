"""The prefix cache (kvhold.executor.prefix_cache): its index and references alone, then engines
run in this process on one tables segment and one KV pool, as in test_takeover_inprocess: a
request that finds its prompt's pages cached gives the tokens of one that computes them, and a
takeover (the first engine abandoned, as if SIGKILLed, its epoch still pending) finds the cache
as the tables hold it, keeps every request exact, and never serves a damaged page again."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kvhold.executor.prefix_cache import PrefixCache, chain_keys, root_key
from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import PageFlag
from tests.unit.helpers import (ENGINE_PAGE_TOKENS as PT, EnginePool, decode_until, float64_model,
                                outputs_alone, run_to_end)
from tools.bench_engine_setup import admit

SALT = b"weights-fingerprint:float64"
SYSTEM = [5 + (11 * j) % 400 for j in range(3 * PT)]          # a shared prompt of 3 full pages


def request(i: int, suffix_len: int = 7, max_tokens: int = 12) -> dict:
    return dict(prompt_ids=SYSTEM + [17 + (13 * i + j) % 300 for j in range(suffix_len)], max_tokens=max_tokens,
                temperature=(0.0, 0.8)[i % 2], top_p=0.9, seed=100 + i)


@pytest.fixture(scope="module")
def model(tiny_model):
    return float64_model(tiny_model)


def system_pages(cache: PrefixCache) -> list[int]:
    """The cached pages of the shared prompt, in order."""
    return [cache.by_key[k] for k in cache.keys(SYSTEM, 3)]


def uncached_outputs(model, requests) -> list[list[int]]:
    return outputs_alone(model, requests)


# ---------------------------------------------------------------- the index alone
def test_keys_chain_over_the_pages_before():
    tokens = list(range(4 * PT))
    keys = chain_keys(root_key(SALT), tokens, PT, 4)
    assert len(set(keys)) == 4 and all(keys)
    assert chain_keys(root_key(SALT), tokens, PT, 2) == keys[:2]          # a prefix's keys are a prefix
    changed = tokens[:PT - 1] + [999] + tokens[PT:]
    assert all(a != b for a, b in zip(chain_keys(root_key(SALT), changed, PT, 4), keys))   # all after it
    assert chain_keys(root_key(b"other weights"), tokens, PT, 1) != keys[:1]
    cache = PrefixCache(SALT, PT)
    known = cache.keys(tokens, 2)
    assert cache.keys(tokens, 4, known) == keys and known == keys           # extended in place


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["lookup", "insert", "unref", "evict"]), st.integers(0, 7)),
                max_size=60))
def test_references_and_eviction_keep_their_invariants(ops):
    """Whatever the order of lookups, inserts, releases and evictions: only idle pages (no
    sequence lists them) are evicted, least recently used first; references never go below 0."""
    cache = PrefixCache(SALT, PT)
    held: list[int] = []                # one entry per reference a "sequence" holds
    next_page = [1]
    for op, k in ops:
        key = 1000 + k
        if op == "lookup":
            got = cache.lookup([key], PT)
            held += got
        elif op == "insert":
            page = next_page[0]
            next_page[0] += 1
            if cache.insert(key, page):
                held.append(page)
        elif op == "unref" and held:
            cache.unref([held.pop(k % len(held))])
        elif op == "evict":
            idle_before = list(cache.idle)
            out = cache.evict(k % 3)
            assert out == idle_before[:len(out)]                   # least recently used first
            assert not set(out) & set(held)
        for page, n in cache.refs.items():
            assert n == held.count(page) >= 0
        assert set(cache.idle) == {p for p in cache.key_of if p not in held}
        assert {cache.by_key[k]: k for k in cache.by_key} == cache.key_of


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 6)), max_size=40, unique_by=lambda t: t[0]),
       st.lists(st.integers(1, 45), max_size=60), st.booleans())
def test_a_rebuild_indexes_the_first_page_under_each_key(entries, listed, wide_keys):
    """A takeover's rebuild, whatever the order of the pages and however many share a key: the
    first page under a key is indexed with as many references as list entries name it, those
    no list names become idle in the given order, and the other pages under a key are returned
    in the given order; keys are the records' uint64 owners (a negative int64 one wraps)."""
    import numpy as np

    pages = np.array([p for p, _ in entries], dtype=np.int64)
    raw = [((k & 3) << 62) | (k + 1) if wide_keys else k + 1 for _, k in entries]
    keys = np.array(raw, dtype=np.uint64)
    cache = PrefixCache(SALT, PT)
    cache.unverified[99] = (1, 2)                       # a rebuild starts from nothing
    left = cache.rebuild(pages, keys, np.array(listed, dtype=np.int64))
    first: dict[int, int] = {}
    for page, key in zip(pages.tolist(), raw):
        first.setdefault(key, page)
    assert cache.by_key == first and all(type(k) is int for k in cache.by_key)
    assert cache.key_of == {p: k for k, p in first.items()}
    assert cache.refs == {p: listed.count(p) for p in first.values()}
    assert list(cache.idle) == [p for p in pages.tolist() if p in cache.key_of and p not in listed]
    assert left == [p for p in pages.tolist() if p not in cache.key_of] and not cache.unverified
    wrapped = PrefixCache(SALT, PT)
    wrapped.rebuild(np.array([3]), np.array([-2], dtype=np.int64), np.zeros(0, dtype=np.int64))
    assert wrapped.by_key == {(1 << 64) - 2: 3} and list(wrapped.idle) == [3]


# ---------------------------------------------------------------- engines
def test_a_request_on_cached_pages_gives_the_uncached_tokens(model):
    first, second = [request(0)], [request(1), request(2)]
    expected = uncached_outputs(model, first + second)
    pool = EnginePool(model, 96)
    try:
        engine, ids = pool.started(first, prefix_salt=SALT)
        run_to_end(engine)
        cache = engine.blocks.prefix
        assert cache.num_cached == cache.evictable == 4     # its 4 full pages (the last one generated), idle
        shared = system_pages(cache)
        flags = pool.tables.pages["flags"][shared]
        assert ((flags & PageFlag.CACHED) != 0).all()
        ids += admit(pool.tables, second)
        engine.step()                                                   # admits and starts them
        assert sorted(s.num_cached for s in engine.seqs.values()) == [3 * PT, 3 * PT]
        journal = Journal(pool.tables)
        assert [journal.cached_tokens(s) for s in engine.seqs] == [3 * PT, 3 * PT]     # usage's figure
        for seq in engine.seqs.values():
            assert journal.pages_of(seq.slot, 3).tolist() == shared                  # listed, shared
        assert all(cache.refs[p] == 2 for p in shared) and cache.evictable == 1
        run_to_end(engine)
        assert pool.outputs(ids) == expected
        assert cache.hits == 2 * 3 * PT
    finally:
        pool.close()


def test_idle_cached_pages_are_evicted_when_the_pool_needs_them(model):
    """A pool too small for the cache and the new requests: idle cached pages go first, least
    recently used first, and every request finishes as without a cache."""
    requests = [dict(request(i), prompt_ids=[40 + i * 50 + j for j in range(2 * PT + 3)]) for i in range(4)]
    expected = uncached_outputs(model, requests)
    pool = EnginePool(model, 1 + 6)         # 3 pages a request at most: two at a time
    try:
        engine, ids = pool.started(requests[:2], prefix_salt=SALT)
        run_to_end(engine)
        assert engine.blocks.prefix.evictable == 4
        ids += admit(pool.tables, requests[2:])
        run_to_end(engine)
        assert pool.outputs(ids) == expected
        assert engine.blocks.allocator.num_free + engine.blocks.prefix.evictable == 6
    finally:
        pool.close()


def test_a_reset_frees_the_idle_cached_pages_and_leaves_the_listed_ones(model):
    requests = [request(i, max_tokens=40) for i in range(2)]
    pool = EnginePool(model, 64)
    try:
        engine, ids = pool.started(requests[:1], prefix_salt=SALT)
        run_to_end(engine)
        ids += admit(pool.tables, requests[1:])
        decode_until(engine, 2)                         # the second runs on the shared prompt's pages
        cache, header = engine.blocks.prefix, pool.tables.header
        idle, shared = cache.evictable, system_pages(cache)
        assert idle > 0 and all(cache.refs[p] == 1 for p in shared)
        assert engine.reset_prefix_cache_if_asked() is None            # nothing asked
        header["prefix_reset_asked"] = 1
        free = engine.blocks.allocator.num_free
        assert engine.reset_prefix_cache_if_asked() == idle
        assert int(header["prefix_reset_done"]) == 1 and engine.reset_prefix_cache_if_asked() is None
        assert cache.evictable == 0 and engine.blocks.allocator.num_free == free + idle
        assert all(cache.is_cached(p) for p in shared)                  # listed: kept, still found
        run_to_end(engine)
        assert pool.outputs(ids) == uncached_outputs(model, requests)
    finally:
        pool.close()


@pytest.mark.parametrize("gaps", [(0, 2, 2, 0, 3, 3), (1, 0, 3, 2, 0, 1), (0, 0, 1, 3, 2, 3)])
def test_preemption_in_a_small_pool_never_stalls_on_cached_pages(model, gaps):
    """Requests arriving a few steps apart in a pool that holds about two of them: preempted
    ones go back to the queue, their full pages cached. A waiting request holds no page, cached
    or not, until it starts (one that took its cached pages while it could not start pinned
    them, and the pool stalled with every page cached and referenced); every request finishes
    as without a cache."""
    requests = [dict(prompt_ids=[30 + 40 * i + j for j in range(8)], max_tokens=60, temperature=0.8,
                     seed=i) for i in range(6)]
    expected = uncached_outputs(model, requests)
    pool = EnginePool(model, 13)
    try:
        engine = pool.engine(max_batch=8, max_batch_tokens=64, prefill_chunk=32, prefix_salt=SALT)
        engine.take_over([], 0)
        ids = []
        for r, gap in zip(requests, gaps):
            ids += admit(pool.tables, [r])
            for _ in range(gap):
                engine.step()
        run_to_end(engine, limit=1000)
        assert pool.outputs(ids) == expected
        assert engine.scheduler.num_preemptions > 0
    finally:
        pool.close()


@pytest.mark.parametrize("damage", [False, True])
def test_a_takeover_with_no_request_running_keeps_the_idle_cache(model, damage):
    """An executor dies while idle, its cache warm: the successor keeps the idle pages (neither
    lost to it nor leaked out of the free list) without hashing them on the recovery's path, then
    checks them (`verify_cache`) and indexes the intact ones; a damaged one is freed, never
    found. The next request finds what is left."""
    pool = EnginePool(model, 32)
    try:
        dead, ids = pool.started([request(99)], prefix_salt=SALT)
        run_to_end(dead)
        idle = sorted(dead.blocks.prefix.idle)
        shared = system_pages(dead.blocks.prefix)
        if damage:
            pool.kv.pool[shared[2]].view(-1)[7] += 1.0
        free = dead.blocks.allocator.num_free
        epoch = pool.fence(dead)
        survivor = pool.engine(prefix_salt=SALT)
        report = survivor.take_over([epoch], 0).to_dict()
        cache = survivor.blocks.prefix
        assert report["pages_checked"] == 0 and not cache.idle            # none hashed on the way
        assert sorted(cache.unverified) == idle and survivor.blocks.allocator.num_free == free
        assert survivor.verify_cache() == len(idle) and not cache.unverified
        if damage:
            assert shared[2] not in cache.key_of and survivor.blocks.allocator.num_free == free + 1
            assert sorted(cache.idle) == sorted(set(idle) - {shared[2]})
        else:
            assert sorted(cache.idle) == idle
        ids += admit(pool.tables, [request(1)])
        run_to_end(survivor)
        assert survivor.blocks.prefix.hits == (2 if damage else 3) * PT
        assert pool.outputs(ids) == uncached_outputs(model, [request(99), request(1)])
    finally:
        pool.close()


@pytest.mark.parametrize("damage", [False, True])
def test_a_takeover_keeps_the_cache_and_a_damaged_shared_page_is_recomputed(model, damage):
    """Eight requests share three cached pages; the executor dies mid-decode (abandoned, its exit
    not confirmed). The successor keeps the cache as the tables hold it: its references and its
    idle pages. With a bit flipped in a shared page first, that page is found bad once, every
    request listing it recomputes from its committed tokens, all eight give the uninterrupted
    run's tokens, and the page is never found in the cache again."""
    requests = [request(i) for i in range(8)]
    expected = uncached_outputs(model, [request(99)] + requests)
    pool = EnginePool(model, 96)
    try:
        dead, ids = pool.started([request(99)], prefix_salt=SALT)
        run_to_end(dead)
        shared = system_pages(dead.blocks.prefix)
        ids += admit(pool.tables, requests)
        decode_until(dead, 3)
        assert all(s.num_cached == 3 * PT for s in dead.seqs.values())
        if damage:
            pool.kv.pool[shared[1]].view(-1)[5] += 1.0
        epoch = pool.fence(dead)
        survivor = pool.engine(prefix_salt=SALT)
        report = survivor.take_over([epoch], 0).to_dict()
        cache = survivor.blocks.prefix
        assert report["requests_lost"] == 0
        assert report["pages_checked"] < 8 * 4     # a shared page is listed 8 times, hashed once
        if damage:
            assert report["pages_bad"] == 1 and report["requests_damaged"] == 8
            assert shared[1] not in cache.key_of and shared[0] in cache.key_of
            # out of the index and out of use until its writer's exit is confirmed
            assert shared[1] in survivor.quarantined
            assert int(pool.tables.pages["flags"][shared[1]]) == PageFlag.QUARANTINED
        else:
            assert report["pages_bad"] == 0 and report["tokens_recomputed"] == 0
            assert set(shared) <= set(cache.key_of)
            assert all(cache.refs[p] == 8 for p in shared)
        survivor.step()
        survivor.release_quarantined([epoch])
        run_to_end(survivor)
        assert pool.outputs(ids) == expected
    finally:
        pool.close()
