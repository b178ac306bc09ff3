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
from kvhold.testing.sidecar_process import SidecarProcess, clean_up_killed
from tests.process.helpers import FLAGS, KEY, REQUESTS, Server, ids, submit

_SIDECARS = pytest.StashKey[list]()     # the sidecars a test started with `start_sidecar`
LOG_TAIL_CHARS = 64_000                 # of each one's log, shown with a failure


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that started sidecars (`start_sidecar`) shows the end of each one's log:
    the sidecar's and its executors' (they write to the sidecar's stderr), so the failure says
    what the processes did even where its temporary directory is not kept."""
    report = (yield).get_result()
    if not report.failed:
        return
    for sc in item.stash.get(_SIDECARS, []):
        if sc.log_path is None or not sc.log_path.exists():
            continue
        text = sc.log_path.read_text(errors="replace")
        cut = len(text) > LOG_TAIL_CHARS
        title = f"log of sidecar {sc.instance} and its executors ({sc.log_path}{', its end' if cut else ''})"
        report.sections.append((title, text[-LOG_TAIL_CHARS:] if cut else text))


@pytest.fixture(autouse=True)
def _killed_sidecars_cleaned_up():
    """After each test (its own fixtures stopped): a sidecar it killed left its instance's shm
    objects for a successor; with none running, they are unlinked (kvhold.testing.sidecar_process)."""
    yield
    clean_up_killed()


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
def start_sidecar(runtime_root, tmp_path, request):
    """Factory: start_sidecar(flags, instance=None, env=None) -> running SidecarProcess. A
    failure of the test shows each one's log (pytest_runtest_makereport)."""
    started: list[SidecarProcess] = []
    request.node.stash[_SIDECARS] = started

    def start(flags, instance=None, env=None, wait=True):
        sc = SidecarProcess(list(flags), instance=instance, runtime_root=runtime_root, env=env,
                            log_path=tmp_path / f"sidecar-{len(started)}.log")
        started.append(sc)
        return sc.start() if wait else sc

    yield start
    for sc in started:
        sc.stop()


@pytest.fixture(scope="module")
def workload():
    """(flags, requests) of the module's recovery tests: helpers.FLAGS and helpers.REQUESTS
    unless the module sets its own."""
    return FLAGS, REQUESTS


@pytest.fixture(scope="session")
def _references() -> dict:
    """The references computed so far in this session, by workload."""
    return {}


@pytest.fixture(scope="module")
def reference(tiny_model, workload, _references):
    """The token ids of the workload's requests from a sidecar that never loses an executor:
    computed once per session for each workload (outputs are deterministic, and independent of
    the batch: test_recovery_e2e.test_reference_is_batch_independent), a copy per module."""
    flags, requests = workload
    key = (tuple(flags), repr(requests))
    if key not in _references:
        with SidecarProcess(["--model", str(tiny_model), *flags, "--standbys", "0"]) as sc:
            sc.wait_steady(standbys=0)
            with sc.new_client() as client:
                _references[key] = ids(wait_all(submit(client, requests)))
    return [list(tokens) for tokens in _references[key]]


@pytest.fixture(scope="module")
def sidecar_flags(tiny_model):
    """The flags of the module's `sidecar`: the demo model, 256-token sequences, no standby."""
    return ["--model", str(tiny_model), "--max-seq-len", "256", "--standbys", "0"]


@pytest.fixture(scope="module")
def sidecar_env():
    """The environment the module's `sidecar` adds to this one's."""
    return None


@pytest.fixture(scope="module")
def sidecar(sidecar_flags, sidecar_env):
    """One sidecar per module, of its sidecar_flags and sidecar_env, shared by its tests (which
    may kill its executors, never the sidecar); returned steady, with the standbys its flags
    ask for (one when they do not say)."""
    at = [i for i, flag in enumerate(sidecar_flags) if flag == "--standbys"]
    with SidecarProcess(list(sidecar_flags), env=sidecar_env) as sc:
        sc.wait_steady(standbys=int(sidecar_flags[at[-1] + 1]) if at else 1)
        yield sc


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """One `kvhold serve` (sidecar, active and standby executors, HTTP with KEY) per module."""
    root = tmp_path_factory.mktemp("rt")
    srv = Server(tiny_model, root, root / "serve.log", api_key=KEY)
    yield srv
    srv.stop()
