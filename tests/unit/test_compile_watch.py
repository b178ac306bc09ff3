"""A Triton kernel compiled inside a step of an active executor takes its lease off the steady
rate for that long (kvhold.executor.cuda.compile_watch): the sidecar then allows a first step's time
instead of fencing it as hung. Triton calls these hooks around every compile (its knobs); the
GPU path that reaches them cannot run here, so the hooks are called as Triton calls them."""
import os
import time
from types import SimpleNamespace

import pytest

from kvhold.executor.cuda.compile_watch import CompileWatch
from kvhold.protocol.layout import KvGeometry, TableGeometry
from kvhold.protocol.leases import Fenced, Lease, LeaseTable
from kvhold.protocol.tables import Tables

knobs = pytest.importorskip("triton").knobs

GEOMETRY = TableGeometry(kv=KvGeometry(2, 2, 8, "float32", 4), num_pages=16, num_slots=4, max_seq_len=32,
                         num_leases=4)


@pytest.fixture
def lease():
    tables = Tables.create(f"/kvhold-test-compile-watch-{os.getpid()}-{time.monotonic_ns()}", GEOMETRY, 1)
    leases = LeaseTable(tables)
    yield Lease(tables, 0, leases.grant(0, os.getpid())), leases
    tables.unlink()


def _compile(name="kvhold.executor.cuda.gemm._skinny_kernel"):
    return dict(key=("k",), repr=f"{name}[num_warps=4]", fn=SimpleNamespace(name=name), compile={},
                is_manual_warmup=False, already_compiled=False)


def test_a_compile_in_a_warm_executor_takes_its_lease_off_the_steady_rate_until_done(lease, caplog):
    lease, table = lease
    seen = []
    before = (lambda **kw: seen.append(("before-start", kw["repr"])), lambda **kw: seen.append(("before-done",)))
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before
    watch = CompileWatch(lease)
    try:
        assert watch.install()
        lease.mark_warm()
        beat0 = table.heartbeat_ns(0)
        assert knobs.runtime.jit_cache_hook(**_compile()) is None      # the compile goes ahead
        assert not table.is_warm(0) and table.heartbeat_ns(0) > beat0
        assert "compiling Triton kernel kvhold.executor.cuda.gemm._skinny_kernel in a step" in caplog.text
        beat1 = table.heartbeat_ns(0)
        knobs.runtime.jit_post_compile_hook(**_compile())
        assert table.is_warm(0) and table.heartbeat_ns(0) > beat1
        assert watch.compiles == 1 and [s[0] for s in seen] == ["before-start", "before-done"]
    finally:
        watch.uninstall()
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == before
    knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None


def test_an_executor_not_yet_warm_stays_so_and_a_fenced_one_stops_at_the_compile(lease):
    lease, table = lease
    watch = CompileWatch(lease)
    try:
        assert watch.install()
        knobs.runtime.jit_cache_hook(**_compile())
        knobs.runtime.jit_post_compile_hook(**_compile())
        assert not table.is_warm(0)                   # its first step's grace holds anyway
        table.fence(0)
        with pytest.raises(Fenced):
            knobs.runtime.jit_cache_hook(**_compile())
    finally:
        watch.uninstall()
