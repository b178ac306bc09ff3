"""Fixtures of the unit tests: the sidecar's shared-memory tables made in process (`tables`, and
their request `journal`),
of the module's `table_geometry`, `table_generation` and `tables_name` where it sets them
(`paths.shm_name("tables")`: the tables of a private instance, as its sidecar names them)."""
from __future__ import annotations

import os
import random

import pytest

from kvhold.protocol.layout import KvGeometry, TableGeometry
from kvhold.protocol.naming import InstancePaths
from kvhold.protocol.tables import Tables


@pytest.fixture
def table_geometry():
    """A small pool: 16 pages, 4 slots, 64 tokens a sequence, 4 leases."""
    return TableGeometry(kv=KvGeometry(2, 2, 8, "float32", 4), num_pages=16, num_slots=4, max_seq_len=64,
                         num_leases=4)


@pytest.fixture
def table_generation():
    return 1


@pytest.fixture
def paths(tmp_path):
    """A private instance's paths in this test's directory."""
    return InstancePaths.for_instance(f"t{os.getpid()}-{random.getrandbits(20)}", tmp_path)


@pytest.fixture
def tables_name():
    return f"/kvhold-test-{os.getpid()}-{random.getrandbits(30)}"


@pytest.fixture
def tables(tables_name, table_geometry, table_generation):
    t = Tables.create(tables_name, table_geometry, generation=table_generation)
    yield t
    t.unlink()


@pytest.fixture
def journal(tables):
    """The request journal of `tables`."""
    from kvhold.protocol.journal import Journal

    return Journal(tables)
