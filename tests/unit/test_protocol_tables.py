"""Shared tables: layout, validation of untrusted bytes, metadata overhead, seqlock ops."""
import os
import stat

import numpy as np
import posix_ipc
import pytest
from hypothesis import given, settings, strategies as st

from kvhold.protocol.layout import (HEADER_BYTES, LAYOUT_VERSION, KvGeometry, PageFlag, TableGeometry,
                                   header_crc)
from kvhold.protocol.page_table import PageTable
from kvhold.protocol.tables import Tables, TableFormatError
from kvhold.protocol.sampling import SamplingParams

SMALL = TableGeometry(kv=KvGeometry(2, 2, 8, "float32", 4), num_pages=16, num_slots=4,
                      max_seq_len=32, num_leases=4)


def _name():
    return f"/kvhold-test-{os.getpid()}-{np.random.randint(1 << 30)}"


@pytest.fixture
def table_geometry():
    return SMALL


@pytest.fixture
def table_generation():
    return 7


def test_create_attach_roundtrip(tables):
    other = Tables.attach(tables._mm)
    assert other.geometry == SMALL
    assert other.generation == 7
    tables.pages["num_tokens"][3] = 2
    assert other.pages["num_tokens"][3] == 2  # same memory, no copy


def test_segment_is_owner_only_and_unlinked(tables):
    path = "/dev/shm" + tables._shm.name
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    name = tables._shm.name
    tables.unlink()
    with pytest.raises(posix_ipc.ExistentialError):
        posix_ipc.SharedMemory(name)
    tables._shm = None


def test_attach_by_name_and_fd(tables):
    t2 = Tables.attach_name(tables._shm.name)
    assert t2.geometry == SMALL
    t2.close()


@pytest.mark.parametrize("field,value", [
    ("magic", b"NOTKVHLD"), ("layout_version", 99), ("num_pages", 17), ("page_bytes", 1),
    ("off_pages", 8), ("total_bytes", 1 << 40),
])
def test_attach_rejects_inconsistent_headers(tables, field, value):
    buf = bytearray(tables._mm[:])
    header = np.ndarray((), tables.header.dtype, buffer=buf)
    header[field] = value
    with pytest.raises(TableFormatError):
        Tables.attach(buf)


def test_segments_of_the_32_bit_word_checksum_are_refused(tables):
    """Layout 3 checksummed pages one mix per 32-bit word: its pages must not be validated
    with the 64-bit definition, so the whole segment is refused by its version."""
    assert LAYOUT_VERSION >= 4
    buf = bytearray(tables._mm[:])
    header = np.ndarray((), tables.header.dtype, buffer=buf)
    header["layout_version"] = 3
    header["geometry_crc"] = header_crc(header)
    with pytest.raises(TableFormatError, match=f"layout version 3, this build reads {LAYOUT_VERSION}"):
        Tables.attach(buf)


def test_attach_rejects_short_buffer(tables):
    with pytest.raises(TableFormatError):
        Tables.attach(bytearray(tables._mm[:HEADER_BYTES + 10]))
    with pytest.raises(TableFormatError):
        Tables.attach(bytearray(10))


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=6000))
def test_random_bytes_never_crash_the_reader(data):
    try:
        Tables.attach(bytearray(data))
    except TableFormatError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, SMALL.offsets()["total_bytes"] - 1), st.integers(0, 255)),
                max_size=40))
def test_random_corruption_of_a_valid_segment(mutations):
    t = Tables.create(_name(), SMALL, generation=1)
    try:
        buf = bytearray(t._mm[:])
        for offset, byte in mutations:
            buf[offset] = byte
        try:
            t2 = Tables.attach(buf)
        except TableFormatError:
            return
        # a readable segment with garbage records still yields counts, never an exception
        counts = PageTable(t2).counts()
        assert sum(counts[k] for k in ("free", "committed", "writing", "quarantined")) >= 0
    finally:
        t.unlink()


@pytest.mark.parametrize("pool_gib,layers,kv_heads,head_dim", [
    (8, 32, 8, 128),    # Llama-3-8B, bf16, a small pool
    (40, 32, 8, 128),
    (60, 80, 8, 128),   # Llama-3-70B shapes
    (2, 28, 4, 128),    # Qwen2-7B-like
])
def test_metadata_is_under_half_a_percent(pool_gib, layers, kv_heads, head_dim):
    kv = KvGeometry(layers, kv_heads, head_dim, "bfloat16", 16)
    g = TableGeometry(kv=kv, num_pages=pool_gib * 2**30 // kv.page_bytes, num_slots=256,
                      max_seq_len=8192)
    assert g.metadata_fraction < 0.005


def test_geometry_validation():
    with pytest.raises(ValueError):
        KvGeometry(0, 2, 8)
    with pytest.raises(ValueError):
        KvGeometry(2, 1, 1, "bfloat16")  # a row must be whole 64-bit words (the checksum's)
    with pytest.raises(ValueError, match="64-bit words"):
        KvGeometry(2, 1, 2, "bfloat16")  # 4 bytes: whole 32-bit words are not enough
    with pytest.raises(ValueError):
        TableGeometry(kv=SMALL.kv, num_pages=0)


def test_seqlock_publish_and_snapshot(tables):
    pt = PageTable(tables)
    pt.assign([1, 2], owner=42, logical=[0, 1], epoch=3)
    pt.publish([1], 4, 999, epoch=3)
    rec = pt.record(1)
    assert (rec.owner, rec.num_tokens, rec.checksum, rec.writing) == (42, 4, 999, False)
    assert rec.version % 2 == 0 and rec.version > 0
    tables.pages["version"][2] += 1           # a writer died mid-update
    assert pt.record(2).writing
    assert pt.counts()["writing"] == 1
    pt.repair_versions([2])
    assert not pt.record(2).writing
    pt.quarantine([2])
    assert pt.counts()["quarantined"] == 1
    pt.mark_bad([1])                          # flagged, its writer's epoch kept
    assert tables.pages["flags"][1] == PageFlag.BAD and tables.pages["epoch"][1] == 3
    assert tables.pages["version"][1] % 2 == 0
    pt.release([1, 2])
    assert pt.counts()["free"] == SMALL.num_pages


def test_idle_cached_pages_are_counted_apart_and_listed_ones_once(tables):
    pt = PageTable(tables)
    pt.assign([1, 2, 3, 4], owner=42, logical=[0, 1, 2, 3], epoch=1)
    pt.publish([1, 2, 3, 4], 16, 7, epoch=1)
    pt.mark_cached([1, 2, 3], [101, 102, 103])
    req = tables.requests
    for slot in (0, 1):                       # two live requests list cached page 2
        req["request_id"][slot] = req["exec_request_id"][slot] = 10 + slot
        req["num_pages"][slot] = 1
        tables.page_lists[slot, 0] = 2
    req["request_id"][2] = 12                 # admitted, its execution half not yet written: no list
    tables.page_lists[2, 0] = 3
    c = pt.counts()
    assert (c["cached"], c["committed"]) == (2, 2)        # pages 1 and 3 idle; pages 2 and 4
    assert sum(v for k, v in c.items() if k != "total") == c["total"]


def test_named_readers_of_the_header_pages_and_journal(tables):
    from kvhold.protocol.journal import Journal
    from kvhold.protocol.layout import WeightsState

    assert tables.sidecar_pid == os.getpid()
    tables.header["weights_epoch"] = 5
    tables.header["weights_state"] = WeightsState.LOADING
    tables.header["weights_fingerprint"] = bytes.fromhex("ab" * 31 + "00")
    assert (tables.weights_state, tables.weights_epoch) == (WeightsState.LOADING, 5)
    assert tables.weights_fingerprint == "ab" * 31 + "00"
    pt = PageTable(tables)
    pt.assign([2, 5], owner=9, logical=[0, 1], epoch=3)
    tables.pages["version"][5] += 1            # a writer died mid-update
    assert pt.owned_pages().tolist() == [2, 5] and pt.interrupted_pages().tolist() == [5]
    assert len(pt.unowned_pages()) == SMALL.num_pages - 2
    journal = Journal(tables)
    for slot, request_id in ((0, 11), (1, 12)):
        journal.admit(slot, request_id, [1, 2, 3], SamplingParams(max_tokens=4, seed=0, temperature=0.0, top_p=1.0, top_k=0))
    journal.take(0, 11, epoch=3)
    journal.cancel(1)
    assert journal.untaken_slots().tolist() == [1]
    assert journal.is_cancelled(1) and not journal.is_cancelled(0)
    journal.set_pages(0, [7, 4])
    assert journal.pages_of(0, 2).tolist() == [7, 4] and journal.entry(0).num_pages == 2


def test_journal_holds_answers_for_many_slots_at_once(tables):
    """`holds`: the slot still holds that request (not released; with `taken`, taken by an executor)."""
    from kvhold.protocol.journal import Journal

    j = Journal(tables)
    for slot, request_id in ((0, 11), (1, 12), (2, 13)):
        j.admit(slot, request_id, [1, 2, 3], SamplingParams(max_tokens=4, seed=0, temperature=0.0, top_p=1.0, top_k=0))
    j.take(0, 11, epoch=3)
    j.release(2)
    slots, rids = [0, 1, 2, 1], [11, 12, 13, 99]
    assert j.holds(slots, rids).tolist() == [True, True, False, False]
    assert j.holds(slots, rids, taken=True).tolist() == [True, False, False, False]
    assert j.holds(slots, rids, taken=[False, True, False, False]).tolist() == [True, False, False, False]
    assert j.holds(slots, rids, taken=[True, False, False, False]).tolist() == [True, True, False, False]
    assert j.live_request_ids() == {11: 0, 12: 1}


def test_queue_and_prefill_times_from_the_journal_marks(tables):
    """admitted (sidecar) -> first step (executor's mark_step, once) -> first token committed."""
    from kvhold.protocol.journal import Journal

    j = Journal(tables)
    j.admit(1, 99, [3, 4, 5], SamplingParams(max_tokens=4, seed=0, temperature=0.0, top_p=1.0, top_k=0))
    j.take(1, 99, epoch=1)
    assert j.timings_s(1) == (None, None)                     # not in a step yet
    r = tables.requests
    j.mark_step(np.array([1]), 1, 1, np.array([0]), np.array([3]))
    scheduled = int(r["scheduled_ns"][1])
    assert scheduled >= int(r["admitted_ns"][1]) > 0
    queue, prefill = j.timings_s(1)
    assert queue == (scheduled - int(r["admitted_ns"][1])) / 1e9 and prefill is None
    j.mark_step(np.array([1]), 2, 1, np.array([3]), np.array([4]))   # later steps (a successor's too)
    assert int(r["scheduled_ns"][1]) == scheduled                      # keep the first mark
    j.commit_tokens(np.array([1]), np.array([3]), np.array([7], dtype=np.int32), np.array([1], dtype=np.uint32))
    queue, prefill = j.timings_s(1)
    assert prefill == (int(r["first_token_ns"][1]) - scheduled) / 1e9 >= 0
    j.take(1, 99, epoch=3)                                  # a new take starts over (pool restart)
    assert r["scheduled_ns"][1] == 0
