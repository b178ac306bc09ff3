"""Shared fixtures: short private runtime roots and real sidecar processes."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from kvhold.testing.etcd_process import INSTALL_HINT, EtcdProcess, find_etcd
from kvhold.testing.sidecar_process import SidecarProcess


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


def sidecar_log(sc: SidecarProcess) -> str:
    return sc.log_path.read_text() if sc.log_path and sc.log_path.exists() else ""


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The demo checkpoint, built once per test session (no download)."""
    from kvhold.testing.make_model import ensure_demo_model

    path, _ = ensure_demo_model(tmp_path_factory.mktemp("models"))
    return path
