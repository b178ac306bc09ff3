"""Fixtures of the process tests: short private runtime roots, real sidecar processes,
a throwaway etcd, a `kvhold serve` per module, and the reference outputs of an uninterrupted
run."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from kvhold.client.client import wait_all
from kvhold.testing.etcd_process import INSTALL_HINT, EtcdProcess, find_etcd
from kvhold.testing.sidecar_process import SidecarProcess
from tests.process.helpers import FLAGS, KEY, Server, ids, submit


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    """A throwaway etcd on loopback. Without the binary: skip with the install hint, or fail
    when KVHOLD_REQUIRE_ETCD=1 (.ci/run, which installs it), so CI cannot skip the registry."""
    if find_etcd() is None:
        if os.environ.get("KVHOLD_REQUIRE_ETCD") == "1":
            pytest.fail(INSTALL_HINT)
        pytest.skip(INSTALL_HINT)
    with EtcdProcess(tmp_path_factory.mktemp("etcd") / "data") as server:
        yield server


@pytest.fixture
def runtime_root():
    # Unix socket paths are limited to ~107 bytes: keep the root short.
    root = Path(tempfile.mkdtemp(prefix="kvh-", dir="/tmp"))
    os.chmod(root, 0o700)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def start_sidecar(runtime_root, tmp_path):
    """Factory: start_sidecar(flags, instance=None, env=None) -> running SidecarProcess."""
    started: list[SidecarProcess] = []

    def start(flags, instance=None, env=None, wait=True):
        sc = SidecarProcess(list(flags), instance=instance, runtime_root=runtime_root, env=env,
                            log_path=tmp_path / f"sidecar-{len(started)}.log")
        started.append(sc)
        return sc.start() if wait else sc

    yield start
    for sc in started:
        sc.stop()


@pytest.fixture(scope="module")
def reference(tiny_model):
    """The token ids of helpers.REQUESTS from a sidecar that never loses an executor."""
    with SidecarProcess(["--model", str(tiny_model), *FLAGS, "--standbys", "0"]) as sc:
        sc.wait_steady(standbys=0)
        with sc.new_client() as client:
            return ids(wait_all(submit(client)))


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """One `kvhold serve` (sidecar, active and standby executors, HTTP with KEY) per module."""
    root = tmp_path_factory.mktemp("rt")
    srv = Server(tiny_model, root, root / "serve.log", api_key=KEY)
    yield srv
    srv.stop()
