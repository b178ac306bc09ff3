"""Re-adoption's checks on a dead sidecar's tables: the segment reopened by name with its
header validated, the adopting sidecar's pid claimed under a fresh CRC, and every reason a
pool is not adopted (kvhold.sidecar.adoption)."""
import os

import pytest

from kvhold.protocol.layout import KvGeometry, PoolState, Role, TableGeometry, WeightsState
from kvhold.protocol.settings import ExecutorSettings
from kvhold.protocol.tables import Tables, TableFormatError
from kvhold.sidecar import adoption
from kvhold.sidecar.adoption import LeaseHolder

SMALL = TableGeometry(kv=KvGeometry(2, 2, 8, "float32", 4), num_pages=16, num_slots=4,
                      max_seq_len=32, num_leases=4)
LIVE = [LeaseHolder(slot=0, pid=1, role=Role.ACTIVE, epoch=1)]


@pytest.fixture
def tables_name(paths):
    return paths.shm_name("tables")


@pytest.fixture
def table_geometry():
    return SMALL


@pytest.fixture
def table_generation():
    return 3


def test_adopt_reopens_the_segment_and_claim_keeps_the_header_valid(tables, paths):
    tables.leases["epoch"][1] = 9
    found = Tables.adopt(paths.shm_name("tables"))
    try:
        assert found.geometry == SMALL and found.generation == 3 and found.leases["epoch"][1] == 9
        found.claim(4242)
        assert Tables.attach(tables._mm).sidecar_pid == 4242      # the CRC covers the pid: still valid
        assert os.fstat(found.fd).st_size == SMALL.total_bytes    # it holds the object, like its creator
    finally:
        found.close()


def test_adopt_refuses_a_damaged_header(tables, paths):
    tables.header["num_pages"] += 1           # without a new CRC
    with pytest.raises(TableFormatError, match="CRC"):
        Tables.adopt(paths.shm_name("tables"))


def test_find_without_a_segment_adopts_nothing(paths):
    assert adoption.find(paths, SMALL, backend="host", generation=1, fingerprint="",
                         token_path=paths.token_file, region_sizes={}) is None


def test_a_pool_with_no_live_executor_is_not_adopted(tables, paths):
    tables.leases["role"][0] = Role.ACTIVE          # its holder never took the mutex: not ours
    tables.leases["pid"][0] = 2 ** 22 + 7
    assert adoption.find(paths, SMALL, backend="host", generation=3, fingerprint="",
                         token_path=paths.token_file, region_sizes={}) is None


def _refusal(tables, paths, **changes):
    args = dict(geometry=SMALL, backend="host", generation=3, fingerprint="", token_path=paths.token_file,
                live=LIVE)
    args.update(changes)
    return adoption._refusal(tables, args["geometry"], args["backend"], args["generation"],
                             args["fingerprint"], args["token_path"], args["live"])


def test_every_disagreement_is_a_reason_not_to_adopt(tables, paths):
    paths.runtime_dir.mkdir(parents=True)
    paths.token_file.write_text("t\n")
    assert _refusal(tables, paths) is None
    assert "no executor" in _refusal(tables, paths, live=[])
    assert _refusal(tables, paths, backend="cuda") is None    # its descriptors are handed back
    other = TableGeometry(kv=SMALL.kv, num_pages=32, num_slots=4, max_seq_len=32, num_leases=4)
    assert "geometry differs" in _refusal(tables, paths, geometry=other)
    assert "generation 3 is not the journal's 4" in _refusal(tables, paths, generation=4)
    assert "not sealed" in _refusal(tables, paths, fingerprint="ab" * 32)
    tables.header["weights_state"] = WeightsState.SEALED
    tables.header["weights_fingerprint"] = bytes.fromhex("cd" * 32)
    assert "another model" in _refusal(tables, paths, fingerprint="ab" * 32)
    assert _refusal(tables, paths, fingerprint="cd" * 32) is None
    tables.header["state"] = PoolState.DRAINING
    assert "DRAINING" in _refusal(tables, paths)
    tables.header["state"] = PoolState.READY
    paths.token_file.unlink()
    assert "token" in _refusal(tables, paths)


def test_regions_must_exist_with_this_pools_sizes(paths):
    assert "cannot be opened" in adoption._regions_refusal(paths, {"kv": 4096})
    from kvhold.protocol.memory import HostRegion
    region = HostRegion(paths.shm_name("kv"), "kv", 8192)
    try:
        assert adoption._regions_refusal(paths, {"kv": 8192}) is None
        assert "holds 8192 bytes, this pool needs 12288" in adoption._regions_refusal(paths, {"kv": 12288})
        with pytest.raises(ValueError, match="holds 8192 bytes"):
            HostRegion(paths.shm_name("kv"), "kv", 12288, adopt=True)
        again = HostRegion(paths.shm_name("kv"), "kv", 8192, adopt=True)   # the same memory
        again.map_local().numpy("u1", (1,))[0] = 7
        assert region.map_local().numpy("u1", (1,))[0] == 7
    finally:
        region.unlink()


def test_the_wait_for_a_sidecar_is_a_checked_setting():
    assert ExecutorSettings().sidecar_wait_ms == 30_000
    assert ExecutorSettings(sidecar_wait_ms=0).sidecar_wait_ms == 0
    with pytest.raises(ValueError, match="sidecar_wait_ms"):
        ExecutorSettings(sidecar_wait_ms=-1)
