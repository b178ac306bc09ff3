"""The takeover's array bookkeeping equals a plain per-page reference on random page states.

A native takeover classifies every listed page and derives, per request, the KV of its valid
prefix, the tokens its pages had recorded and its first bad page, then releases or quarantines
every page no request keeps and builds the free list; kvhold.executor.recovery does all of it
with array operations over every listed page at once. Here the reference walks pages one by one
(the rules of kvhold.executor.takeover's docstring) on random tables: pages valid, corrupt
(checksum), interrupted (odd version, with a matching checksum or not, or torn: the count
of a publish written and not yet its checksum, which covers fewer rows), flagged BAD or
QUARANTINED, malformed (count above the page), owned by another request or listed at another
logical index, released or quarantined while still listed (no record left: not usable), the
same page listed by two requests, garbage page numbers, partial tails (full
pages after one), orphans of a pending or a reaped writer, empty lists, and an entry into the
prefix cache interrupted after its key replaced the owner (the page is given back). Then: a takeover
that dies after any of its steps leaves lists the next takeover keeps whole."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings, strategies as st
from safetensors.torch import load_file

from kvhold.executor.block_manager import CommittedPages
from kvhold.executor.engine import Engine
from kvhold.executor.kv_cache import KvCache
from kvhold.executor.llama import LlamaModel
from kvhold.executor.page_allocator import NULL_PAGE, PageAllocator
from kvhold.executor.recovery import NativeTakeover, first_per_segment, valid_prefixes
from kvhold.executor.takeover import _resume as resume, live_requests
from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import KvGeometry, PageFlag, TableGeometry
from kvhold.protocol.leases import Lease, LeaseTable
from kvhold.protocol.checksum import TorchChecksum
from kvhold.protocol.model_spec import ModelSpec
from kvhold.protocol.tables import Tables
from kvhold.protocol.sampling import SamplingParams

PT = 4                   # tokens per page
NUM_PAGES = 48
SLOTS = 6
MAX_SEQ = 64
CHUNK = 16


# ---------------------------------------------------------------- segment reductions alone

def _reference_prefixes(lens, ok, belongs, counts, page_tokens):
    valid, recorded, first_bad, i0 = [], [], [], 0
    for n in lens:
        v = r = 0
        f = None
        for i in range(n):
            good, mine, count = ok[i0 + i], belongs[i0 + i], counts[i0 + i]
            if mine:
                r += count
            if f is not None and i >= f:
                continue
            if v != i * page_tokens:
                continue                          # after a partially filled page
            if good:
                v += count
            else:
                f = i
        valid.append(v)
        recorded.append(r)
        first_bad.append(-1 if f is None else f)
        i0 += n
    return valid, recorded, first_bad


@st.composite
def _segments(draw):
    lens = draw(st.lists(st.integers(0, 7), min_size=0, max_size=8))
    total = sum(lens)
    ok = draw(st.lists(st.booleans(), min_size=total, max_size=total))
    belongs = draw(st.lists(st.booleans(), min_size=total, max_size=total))
    counts = draw(st.lists(st.sampled_from([0, 1, PT - 1, PT, PT, PT]), min_size=total, max_size=total))
    return lens, ok, belongs, counts


@given(_segments())
@settings(max_examples=400, deadline=None)
def test_valid_prefixes_equal_a_page_by_page_walk(seg):
    lens, ok, belongs, counts = seg
    got = valid_prefixes(np.array(lens, dtype=np.int64), np.array(ok, dtype=bool),
                         np.array(belongs, dtype=bool), np.array(counts, dtype=np.int64), PT)
    assert [g.tolist() for g in got] == list(_reference_prefixes(lens, ok, belongs, counts, PT))


@given(st.lists(st.lists(st.booleans(), max_size=6), max_size=6))
@settings(max_examples=200, deadline=None)
def test_first_per_segment(lists):
    lens = np.array([len(x) for x in lists], dtype=np.int64)
    flat = np.array([b for x in lists for b in x], dtype=bool)
    want = [x.index(True) if True in x else len(x) for x in lists]
    assert first_per_segment(lens, flat).tolist() == want


def test_from_sorted_pops_low_pages_first_and_refuses_a_double_free():
    a = PageAllocator.from_sorted(np.array([2, 5, 9], dtype=np.int64))
    assert a.num_free == 3 and a.allocate(2) == [2, 5]
    a.free([5])
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free([9])
    assert a.allocate(2) == [5, 9]


# ---------------------------------------------------------------- whole validate + clear

@pytest.fixture(scope="module")
def rig(tiny_model):
    spec = ModelSpec.from_dir(tiny_model)
    weights = {}
    for f in sorted(tiny_model.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    model = LlamaModel(spec, {k: v.to(torch.float64) for k, v in weights.items()}, torch.float64,
                       torch.device("cpu"), MAX_SEQ)
    geometry = TableGeometry(kv=KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float64", PT),
                             num_pages=NUM_PAGES, num_slots=SLOTS, max_seq_len=MAX_SEQ, num_leases=4)
    tables = Tables.create(f"/kvhold-test-bookkeeping-{os.getpid()}-{time.monotonic_ns()}", geometry, 1)
    kv = KvCache.private(geometry.kv, NUM_PAGES)
    torch.manual_seed(0)
    kv.pool.copy_(torch.randn_like(kv.pool))
    leases = LeaseTable(tables)
    dead_epoch = leases.grant(0, os.getpid())
    raw = np.frombuffer(tables._buf, dtype=np.uint8)
    yield model, kv, tables, leases, dead_epoch, raw, raw.copy()
    tables.unlink()


_GOOD = dict(mine=True, logical_ok=True, count=PT, sum_ok=True, odd=False, flag=PageFlag.NONE, writer="dead",
             cleared=False, torn=False)


@st.composite
def _state(draw):
    n_req = draw(st.integers(0, SLOTS))
    reqs = []
    for _ in range(n_req):
        prompt = draw(st.integers(1, 40))
        gen = draw(st.integers(0, 8))
        n_pages = draw(st.integers(0, min(12, -(-(prompt + gen) // PT))))
        pages = []
        for i in range(n_pages):
            page = draw(st.one_of(st.integers(1, NUM_PAGES - 1), st.integers(1, NUM_PAGES - 1),
                                  st.sampled_from([-3, NUM_PAGES, NUM_PAGES + 7])))
            rec = draw(st.fixed_dictionaries({
                "mine": st.sampled_from([True, True, True, False]),
                "logical_ok": st.sampled_from([True, True, True, False]),
                "count": st.sampled_from([PT, PT, PT, 0, 1, PT - 1, PT + 1]),
                "sum_ok": st.sampled_from([True, True, True, False]),
                "odd": st.sampled_from([False, False, False, True]),
                "flag": st.sampled_from([PageFlag.NONE] * 4 + [PageFlag.BAD, PageFlag.QUARANTINED]),
                "writer": st.sampled_from(["dead", "dead", "reaped"]),
                # released or quarantined (no owner, no count) by a takeover that then died
                "cleared": st.sampled_from([False] * 7 + [True]),
                # a publish interrupted between count and checksum: the checksum of fewer rows
                "torn": st.sampled_from([False] * 5 + [True]),
            }))
            pages.append((page, rec))
        reqs.append((prompt, gen, pages))
    orphans = draw(st.lists(st.tuples(st.integers(1, NUM_PAGES - 1), st.sampled_from(["dead", "reaped"]),
                                      st.sampled_from([PageFlag.NONE, PageFlag.QUARANTINED, PageFlag.BAD])),
                            max_size=6))
    return reqs, orphans


def _write_state(tables, kv, engine_checksum, state, dead_epoch, reaped_epoch):
    journal = Journal(tables)
    pages = tables.pages
    reqs, orphans = state
    for page, writer, flag in orphans:
        pages["owner"][page] = 999
        pages["logical"][page] = 0
        pages["num_tokens"][page] = PT
        pages["flags"][page] = flag
        pages["epoch"][page] = dead_epoch if writer == "dead" else reaped_epoch
    for slot, (prompt, gen, listed) in enumerate(reqs):
        rid = (1 << 40) | (slot + 1)
        journal.admit(slot, rid, list(range(3, 3 + prompt)), SamplingParams(max_tokens=50, seed=slot, temperature=0.0,
                                                                            top_p=1.0, top_k=0, ignore_eos=True))
        journal.take(slot, rid, dead_epoch)
        tables.tokens[slot, prompt:prompt + gen] = 5
        tables.requests["num_generated"][slot] = gen
        ids = []
        for i, (page, rec) in enumerate(listed):
            ids.append(page)
            if not 0 <= page < NUM_PAGES:
                continue
            count = rec["count"]
            true_sum = int(engine_checksum.pages(torch.tensor([page]), torch.tensor([min(count, PT)]))[0]) \
                & ((1 << 64) - 1)
            pages["owner"][page] = rid if rec["mine"] else rid + 1000
            pages["logical"][page] = i if rec["logical_ok"] else i + 1
            pages["num_tokens"][page] = count
            pages["checksum"][page] = true_sum if rec["sum_ok"] else true_sum ^ 0x5A5A
            if rec.get("torn") and 0 < count <= PT:
                pages["checksum"][page] = _sum(engine_checksum, page, count // 2)
            pages["version"][page] = 2 * (i + 1) + (1 if rec["odd"] else 0)
            pages["flags"][page] = rec["flag"]
            pages["epoch"][page] = dead_epoch if rec["writer"] == "dead" else reaped_epoch
            if rec.get("cleared"):
                pages["owner"][page] = pages["num_tokens"][page] = pages["checksum"][page] = 0
        journal.set_pages(slot, ids)


def _sum(checksum, page, count):
    return int(checksum.pages(torch.tensor([page]), torch.tensor([count]))[0]) & ((1 << 64) - 1)


def _reference(records, plans, checksum, chunk):
    """The rules, page by page: per request (valid tokens, recorded tokens, first bad page), and
    the listed pages found bad."""
    out, bad = {}, set()
    # the requests whose lists a takeover reads (a first page in range)
    listing = {plan.entry.request_id for plan in plans if plan.pages and 0 <= plan.pages[0] < len(records)}
    for plan in plans:
        rid = plan.entry.request_id
        valid = recorded = 0
        first_bad = None
        for i, page in enumerate(plan.pages):
            if not 0 <= page < len(records):
                first_bad = i if first_bad is None else first_bad
                break
            r = records[page]
            count = min(int(r["num_tokens"]), PT)
            sum_ok = int(checksum.pages(torch.tensor([page]), torch.tensor([count]))[0]) & ((1 << 64) - 1) \
                == int(r["checksum"])
            belongs = (int(r["owner"]) == rid and int(r["logical"]) == i and not int(r["flags"]) & PageFlag.BAD
                       and int(r["num_tokens"]) <= PT)
            if (not belongs and int(r["version"]) & 1 and sum_ok and int(r["num_tokens"]) == PT
                    and int(r["logical"]) == i and not int(r["flags"]) & (PageFlag.BAD | PageFlag.CACHED)
                    and int(r["owner"]) != 0 and int(r["owner"]) not in listing):
                # the prefix cache's entry (`mark_cached`) interrupted after a key replaced the
                # owner, before the CACHED flag: a full, whole page, given back to its request
                belongs = True
            if belongs and int(r["version"]) & 1 and not sum_ok:
                # an interrupted publish: the longest shorter prefix its checksum covers
                match = [k for k in range(count) if _sum(checksum, page, k) == int(r["checksum"])]
                if match:
                    count, sum_ok = match[-1], True
            good = belongs and sum_ok
            if not good:
                bad.add(page)
            if belongs:
                recorded += count
            if first_bad is not None and i >= first_bad:
                continue
            if valid != i * PT:
                continue
            if good:
                valid += count
            else:
                first_bad = i
        e = plan.entry
        if first_bad is None and e.num_generated == e.num_prefix and e.num_tokens >= 2 and valid >= e.num_tokens:
            valid = (e.num_tokens - 1) // chunk * chunk      # a prompt whose first token was not sampled
        out[plan.entry.slot] = (valid, recorded, first_bad)
    return out, bad


@given(_state())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# listed pages a takeover that died had quarantined (a first page: nothing usable) and released
@example(state=([(6, 0, [(5, dict(_GOOD, count=PT - 2, cleared=True, flag=PageFlag.QUARANTINED))]),
                 (9, 0, [(7, _GOOD), (8, dict(_GOOD, cleared=True))])], []))
# an entry into the prefix cache interrupted between the key (the owner) and the CACHED flag
@example(state=([(1, 0, [(1, dict(_GOOD, mine=False, odd=True))])], []))
# publishes interrupted between count and checksum: a first page (its first rows) and a tail
@example(state=([(6, 0, [(5, dict(_GOOD, count=PT - 1, odd=True, torn=True))]),
                 (9, 0, [(7, _GOOD), (8, dict(_GOOD, count=PT, odd=True, torn=True))]),
                 (3, 0, [(9, dict(_GOOD, count=1, odd=True, torn=True))])], []))
def test_validate_and_clear_equal_a_page_by_page_reference(rig, state):
    model, kv, tables, leases, dead_epoch, raw, pristine = rig
    raw[:] = pristine
    reaped_epoch = dead_epoch + 1000            # a writer whose exit is confirmed: not pending
    checksum = TorchChecksum(kv.pool)
    _write_state(tables, kv, checksum, state, dead_epoch, reaped_epoch)
    pending = {dead_epoch}
    before = tables.pages.copy()
    plans, _ = live_requests(Journal(tables))
    want, bad = _reference(before, plans, checksum, CHUNK)

    leases.fence(0)
    engine = Engine(model, kv, tables, Lease(tables, 1, leases.grant(1, os.getpid())), 4, 64, prefill_chunk=CHUNK)
    strategy = NativeTakeover(engine.takeover_context())
    strategy.validate(plans, pending)
    for plan in plans:
        assert (plan.valid_tokens, plan.recorded_tokens, plan.first_bad) == want[plan.entry.slot]
    strategy.clear(plans, pending)

    # the reference's clear: every used page no request keeps goes, held while its writer is pending
    kept = set()
    for plan in plans:
        kept.update(plan.pages[:-(-plan.kv_valid // PT)])
    used = [p for p in range(NUM_PAGES)
            if before["owner"][p] != 0 or before["flags"][p] & (PageFlag.QUARANTINED | PageFlag.BAD) or p in bad]
    hold = {p: int(before["epoch"][p]) for p in used if p not in kept and int(before["epoch"][p]) in pending}
    released = [p for p in used if p not in kept and p not in hold]
    free = [p for p in range(NULL_PAGE + 1, NUM_PAGES) if p not in kept and p not in hold]
    assert engine.quarantined == hold
    assert engine.blocks.allocator.allocate(len(free)) == free and engine.blocks.allocator.num_free == 0
    pages = tables.pages
    assert all(pages["flags"][p] == PageFlag.QUARANTINED and pages["owner"][p] == 0 for p in hold)
    assert all(pages["flags"][p] == PageFlag.NONE and pages["owner"][p] == 0 for p in released)
    # a listed page found bad is flagged BAD; clearing then releases or quarantines every one no
    # request keeps (one listed twice, good for one request and bad for the other, stays kept)
    assert {p for p in range(NUM_PAGES) if pages["flags"][p] & PageFlag.BAD} == bad & kept
    # and every page held or flagged BAD keeps its writer's epoch in its record, so that a later
    # takeover (this executor may die too) holds it for that writer, not for this executor
    assert all(pages["epoch"][p] == epoch for p, epoch in hold.items())
    assert all(pages["epoch"][p] == before["epoch"][p] for p in bad & kept)


def test_committed_pages_read_adopted_values_until_set_or_removed():
    c = CommittedPages()
    c[3] = 7
    c.adopt(np.array([3, 5, 9]), np.array([30, 50, 90], dtype=np.uint64), 12)
    assert (c[3], c[5], c.get(9), c.get(4), 5 in c, 4 in c) == (30, 50, 90, None, True, False)
    assert type(c[5]) is int
    c[5] = 51                                    # a commit after the takeover
    assert c[5] == 51 and c.pop(5) == 51 and 5 not in c and c.get(5) is None
    assert c.pop(9) == 90 and 9 not in c and c.pop(9, None) is None
    with pytest.raises(KeyError):
        c[9]
    c.adopt(np.array([1]), np.array([10], dtype=np.uint64), 12)   # a second adoption keeps the first's
    assert (c[1], c[3], 9 in c) == (10, 30, False)


# ---------------------------------------------------------------- a takeover that dies half way

def _promote(tables, leases, model, kv, slot):
    """An engine under a fresh lease of `slot` (the previous holder fenced)."""
    leases.fence(slot - 1)
    lease = Lease(tables, slot, leases.grant(slot, os.getpid()))
    return Engine(model, kv, tables, lease, 4, 64, prefill_chunk=CHUNK)


@given(_state(), st.sampled_from(["validated", "cleared", "tails", "resumed"]))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(state=([(6, 0, [(5, dict(_GOOD, count=PT - 2))])], []), died="cleared")     # a first page that is its tail
@example(state=([(6, 0, [(5, dict(_GOOD, count=PT - 2))])], []), died="tails")
@example(state=([(9, 0, [(5, _GOOD), (6, dict(_GOOD, count=0))])], []), died="cleared")   # a page never published
@example(state=([(17, 0, [(5, _GOOD), (6, _GOOD), (7, _GOOD), (8, _GOOD), (9, dict(_GOOD, count=1))])], []),
         died="tails")                                                        # a prompt realigned to its chunk
def test_a_takeover_that_dies_half_way_leaves_lists_the_next_one_keeps(rig, state, died):
    """The promoted executor dies after one of its takeover's steps (its writes so far are in
    the tables); the next takeover keeps exactly the KV the dead one had decided to keep, and
    once the dead one had cleared pages, counts no request lost or damaged: no journal list
    names a page it released, quarantined or flagged."""
    model, kv, tables, leases, dead_epoch, raw, pristine = rig
    listed = [page for _, _, pages in state[0] for page, _ in pages if 0 <= page < NUM_PAGES]
    assume(len(listed) == len(set(listed)))       # a page listed twice is bad for one of them
    raw[:] = pristine
    checksum = TorchChecksum(kv.pool)
    _write_state(tables, kv, checksum, state, dead_epoch, dead_epoch + 1000)

    engine = _promote(tables, leases, model, kv, 1)
    first = NativeTakeover(engine.takeover_context())
    plans, _ = live_requests(Journal(tables))
    pending = {dead_epoch}
    steps = ["validated", "cleared", "tails", "resumed"]
    first.validate(plans, pending)                 # take_over's steps, up to the death
    if steps.index(died) >= 1:
        first.clear(plans, pending)
    if steps.index(died) >= 2:
        first.place_tails(plans, pending)
    if steps.index(died) >= 3:
        resume(engine, first, plans)
    decided = {plan.entry.slot: (plan.kv_valid, plan.first_bad) for plan in plans}

    successor = _promote(tables, leases, model, kv, 2)
    again, _ = live_requests(Journal(tables))
    NativeTakeover(successor.takeover_context()).validate(again, pending | {engine.lease.epoch})
    assert {plan.entry.slot for plan in again} == set(decided)
    for plan in again:
        kv_valid, first_bad = decided[plan.entry.slot]
        assert plan.kv_valid == kv_valid, (died, plan.entry.slot, plan.pages)
        # once the lists are cut (the clear), every listed page is kept; before, nothing changed
        assert plan.first_bad == (first_bad if died == "validated" else None), (died, plan.entry.slot, plan.pages)
