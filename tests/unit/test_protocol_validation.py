"""Page classification: valid, interrupted, corrupt, malformed, free."""

import numpy as np
import pytest

from kvhold.protocol.checksum import words_checksum_np
from kvhold.protocol.layout import KvGeometry, TableGeometry
from kvhold.protocol.page_table import PageTable
from kvhold.protocol.validation import PageClass, classify_host, trusted, host_checksums_ok

GEOM = TableGeometry(kv=KvGeometry(2, 1, 4, "float32", 4), num_pages=6, num_slots=2,
                     max_seq_len=16, num_leases=2)


@pytest.fixture
def pool_geometry():
    return GEOM


@pytest.fixture
def pool(pool):
    """The shared pool (tests/conftest.py) as this module's tests take it: (tables, uint64 words)."""
    return pool.tables, pool.words(np.uint64)


def _commit(tables, words, page, n, rng):
    pt = PageTable(tables)
    pt.assign([page], 100 + page, 0, 1)
    words[page] = rng.integers(0, 2**64, size=words[page].shape, dtype=np.uint64)
    index = np.arange(words[page].size, dtype=np.uint64).reshape(words[page].shape)
    pt.publish([page], n, words_checksum_np(words[page][:, :, :n], index[:, :, :n]), 1)


def test_classes(pool):
    tables, words = pool
    rng = np.random.default_rng(0)
    for page in range(5):
        _commit(tables, words, page, 3, rng)
    words[1, 0, 1, 2, 0] ^= 1 << 7                 # bit flip inside committed bytes
    words[2, 1, 0, 3, 0] ^= 1                      # outside (token 3 >= count 3): harmless
    tables.pages["version"][3] += 1                # writer died mid-update, fields intact
    tables.pages["num_tokens"][4] = 99             # garbage count
    classes = classify_host(tables, words)
    assert list(classes) == [PageClass.VALID, PageClass.CORRUPT, PageClass.VALID,
                             PageClass.INTERRUPTED, PageClass.MALFORMED, PageClass.FREE]
    keep = trusted(tables.pages, GEOM.kv.page_tokens, host_checksums_ok(tables, words))
    assert list(keep[:5]) == [True, False, True, True, False]
