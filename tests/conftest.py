"""Fixtures every test may use, unit tests included: private state directories, the
demo checkpoint and the sidecar's shared memory made in process (`pool`, of the module's
`pool_geometry`). Nothing here starts or imports a process harness (those fixtures live
in tests/process/conftest.py), so unit tests run without ZeroMQ or sidecar processes."""
from __future__ import annotations

import os

import pytest

from kvhold.executor import host_compute

# Torch in the test processes computes on one thread: the tests' tensors are small, and a second
# OpenMP thread only spins (it doubled the in-process engine tests' CPU time), taking a core from
# the sidecars and executors the process tests start. Executors set their own thread count.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# and, as an executor does, keeps large blocks in malloc's heap (kvhold.executor.host_compute)
host_compute.keep_large_blocks()

MAX_WORKERS = 4     # the process tests start sidecars and executors of their own: a worker needs a core


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity, bounded by a cgroup CPU quota (a container's
    `cpu.max`), which os.cpu_count() does not see."""
    cpus = len(os.sched_getaffinity(0))
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cpus


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the default, pyproject.toml): a worker per usable CPU, at most MAX_WORKERS."""
    return min(MAX_WORKERS, usable_cpus())


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_in_dev_shm():
    """The suite leaves nothing in /dev/shm: every object this process's tests made (named with
    its pid: kvhold.testing.shm.made_by; under pytest-xdist each worker checks its own) and
    that was not there before is gone at the end, or the session fails with their names."""
    from kvhold.testing.shm import made_by

    pid = os.getpid()
    before = made_by(pid)
    yield
    left = sorted(made_by(pid) - before)
    if left:
        pytest.fail(f"the tests left {len(left)} shared-memory objects in /dev/shm: {', '.join(left)}",
                    pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def _session_state_dir(tmp_path_factory):
    """Durable request journals (kvhold.sidecar.durable_journal) of test sidecars go to a temporary
    directory, never to /var/lib/kvhold or ~/.local/state."""
    os.environ["KVHOLD_STATE_DIR"] = str(tmp_path_factory.mktemp("state"))


@pytest.fixture(autouse=True)
def _state_dir(tmp_path, monkeypatch):
    """Per test: a sidecar killed with requests in flight keeps them for the next start of
    its instance name; another test reusing the name must not inherit them."""
    monkeypatch.setenv("KVHOLD_STATE_DIR", str(tmp_path / "state"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The demo checkpoint, built once per test session (no download)."""
    from kvhold.testing.make_model import ensure_demo_model

    path, _ = ensure_demo_model(tmp_path_factory.mktemp("models"))
    return path


@pytest.fixture
def pool(pool_geometry):
    """Tables and a host KV region of the module's `pool_geometry` (tests.unit.helpers.ShmPool),
    removed after the test."""
    from tests.unit.helpers import ShmPool

    p = ShmPool(pool_geometry)
    yield p
    p.close()
