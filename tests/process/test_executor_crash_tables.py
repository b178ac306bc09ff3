"""Executors killed, stopped and exiting at random moments, also mid-update: the tables
are always classifiable afterwards, and no committed page ever fails its checksum."""
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import posix_ipc
import pytest

from kvhold.protocol.memory import Mapping, RegionInfo
from kvhold.protocol.tables import Tables
from kvhold.protocol.validation import PageClass, classify_host
from tests.process.helpers import wait_stopped

CHURN = ["--workload", "churn", "--no-spawn", "--lease-ms", "400", "--kv-pages", "48",
         "--page-tokens", "8", "--max-seq-len", "64", "--log-level", "WARNING"]


def _map_kv(sc, tables):
    g = tables.geometry
    shm = posix_ipc.SharedMemory(f"/kvhold-{os.getuid()}-{sc.instance}-kv", read_only=True)
    try:
        size = g.kv_pool_bytes
        mapping = Mapping.from_fd(shm.fd, RegionInfo("kv", size, "host", True))
    finally:
        shm.close_fd()
    shape = (g.num_pages, g.kv.num_layers, 2, g.kv.page_tokens, g.kv.row_bytes // 8)
    return mapping.numpy(np.uint64, shape)         # the checksum's 64-bit words


def _executor(sc, fault=None):
    env = dict(os.environ)
    env.pop("KVHOLD_FAULT", None)
    if fault:
        env["KVHOLD_FAULT"] = fault
    return subprocess.Popen([sys.executable, "-m", "kvhold.executor", "--instance", sc.instance,
                             "--runtime-root", str(sc.runtime_root), "--log-level", "WARNING"],
                            env=env, stderr=subprocess.DEVNULL)


def _wait_active(sc, pid):
    sc.wait_for(lambda st: any(e["pid"] == pid and e["role"] == "active" for e in st["executors"]),
                timeout=20)


def _wait_gone(sc, pid):
    sc.wait_for(lambda st: all(e["pid"] != pid for e in st["executors"]), timeout=20)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_random_signals_leave_classifiable_tables(start_sidecar, seed):
    rng = random.Random(seed)
    sc = start_sidecar(CHURN)
    tables = Tables.attach_name(f"/kvhold-{os.getuid()}-{sc.instance}-tables")
    kv = _map_kv(sc, tables)
    seen = {c: 0 for c in PageClass}
    for trial in range(8):
        proc = _executor(sc)
        _wait_active(sc, proc.pid)
        time.sleep(rng.uniform(0.02, 0.3))   # the point: a signal at a random moment of its work
        sig = rng.choice([signal.SIGKILL, signal.SIGKILL, signal.SIGSEGV, signal.SIGSTOP, signal.SIGTERM])
        os.kill(proc.pid, sig)
        if sig == signal.SIGSTOP:
            wait_stopped(proc.pid)           # frozen mid-whatever: classify while it is stopped
        else:
            proc.wait(10)
        classes = classify_host(tables, kv)
        for c in PageClass:
            seen[c] += int((classes == c).sum())
        assert not (classes == PageClass.CORRUPT).any(), f"trial {trial}: committed page fails checksum"
        assert not (classes == PageClass.MALFORMED).any()
        if sig == signal.SIGSTOP:
            proc.wait(10)                    # the sidecar fences the hang and kills it
            assert proc.returncode == -signal.SIGKILL
        _wait_gone(sc, proc.pid)
    assert seen[PageClass.VALID] > 0         # the churn really committed pages


@pytest.mark.parametrize("fault", ["churn_data:40:kill", "churn_published:25:kill",
                                   "churn_data:13:segv", "churn_published:7:spin"])
def test_faults_at_chosen_instructions(start_sidecar, fault):
    sc = start_sidecar(CHURN)
    tables = Tables.attach_name(f"/kvhold-{os.getuid()}-{sc.instance}-tables")
    kv = _map_kv(sc, tables)
    proc = _executor(sc, fault)
    proc.wait(30)                            # a spin is ended by the sidecar's hang fence
    classes = classify_host(tables, kv)
    assert not (classes == PageClass.CORRUPT).any()
    assert (classes == PageClass.VALID).any()
    _wait_gone(sc, proc.pid)
    follower = _executor(sc)                 # a new executor takes over the table cleanly
    _wait_active(sc, follower.pid)
    report = sc.wait_for(lambda st: st["events"] and next(
        (e for e in st["events"] if e["kind"] == "promote" and e["pid"] == follower.pid), None))
    assert report
    follower.send_signal(signal.SIGTERM)
    assert follower.wait(10) == 0
