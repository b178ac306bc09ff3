"""A spare sidecar (`kvhold sidecar --spare`) waits in the instance lock and takes over the
moment the running sidecar is SIGKILLed: the executors (same pids), the memory and the streams
are re-adopted as by a restarted sidecar, the streams finish as an uninterrupted run would,
nothing is recomputed and the weights are not reloaded. A clean stop does not wake it, and it
never starts a pool for an instance that nobody serves. Real processes, real signals."""
import contextlib
import os
import signal
import time

import pytest

from kvhold.client.client import wait_all
from kvhold.protocol.tables import Tables
from kvhold.sidecar.daemon import STOP_AT_ENV
from kvhold.testing.sidecar_process import SidecarProcess, submit_requests
from tests.process.helpers import (READOPT_FLAGS as FLAGS, READOPT_REQUESTS as REQUESTS, alive, roles,
                                   sidecar_log, wait_stopped, wait_until)

IDLE = ["--workload", "idle", "--lease-ms", "300", "--log-level", "INFO"]


def test_a_spare_takes_over_from_a_sigkilled_sidecar_mid_stream(tiny_model, runtime_root, tmp_path):
    flags = ["--model", str(tiny_model), *FLAGS, "--journal-dir", str(tmp_path / "journal")]
    first = SidecarProcess(flags, runtime_root=runtime_root, log_path=tmp_path / "first.log").start()
    spare, clients = None, contextlib.ExitStack()
    try:
        client = clients.enter_context(first.new_client(timeout=60))
        reference = [r.token_ids for r in wait_all(submit_requests(client, REQUESTS))]
        first.wait_steady(standbys=1)
        spare = first.spare(log_path=tmp_path / "spare.log")
        assert first.status()["spares"] == [spare.proc.pid]
        assert first.status()["spare"] is None
        streams = submit_requests(client, REQUESTS)
        for s in streams:                              # every request is streaming at the kill
            next(s)
        before = roles(first.status())
        os.kill(first.proc.pid, signal.SIGKILL)        # the sidecar alone
        first.proc.wait()
        spare.wait_serving(timeout=30)
        results = wait_all(streams)
        assert [r.token_ids for r in results] == reference
        assert [r.recomputed_tokens for r in results] == [0] * len(REQUESTS)
        wait_until(lambda: set(before) <= {e["pid"] for e in spare.events("attach")},
                   timeout_s=30, what="both executors to attach to the spare")
        status = spare.status()
        assert roles(status) == before                 # re-adopted, not replaced
        assert status["spare"]["previous_pid"] == first.proc.pid
        assert status["adoption"]["previous_pid"] == first.proc.pid
        assert status["spares"] == []                  # it waits no more
        assert status["weights"]["load_ms"] is None and status["recoveries"] == []
        assert not spare.events("spawn")
        assert not spare.paths.spare_file(spare.proc.pid).exists()
        assert "this spare takes over" in sidecar_log(spare)
    finally:
        clients.close()
        if spare is not None:
            spare.stop()
        first.stop(signal.SIGKILL)


def test_a_clean_stop_does_not_wake_a_spare_which_then_waits_on_the_next_sidecar(runtime_root, tmp_path):
    first = SidecarProcess(IDLE, runtime_root=runtime_root, log_path=tmp_path / "first.log").start()
    spare = second = None
    try:
        spare = first.spare(log_path=tmp_path / "spare.log")
        assert first.stop() == 0                        # SIGTERM: a clean stop
        time.sleep(1.0)
        assert spare.proc.poll() is None                # still waiting, serving nothing
        assert "takes over" not in sidecar_log(spare)
        second = SidecarProcess(IDLE, instance=first.instance, runtime_root=runtime_root,
                                log_path=tmp_path / "second.log").start()
        marker = spare.paths.spare_file(spare.proc.pid)
        wait_until(lambda: marker.exists() and marker.read_text().strip() == str(second.proc.pid),
                   timeout_s=10, what="the spare to wait on the next sidecar")
        assert second.status()["spares"] == [spare.proc.pid]
        spare.proc.send_signal(signal.SIGTERM)          # a waiting spare stops at once, cleanly
        assert spare.proc.wait(10) == 0
        assert not marker.exists() and second.status()["spares"] == []
        assert alive(second.proc.pid)
        killed = second.spare(log_path=tmp_path / "spare2.log")     # one SIGKILLed while it waits
        killed.proc.kill()
        killed.proc.wait()
        assert second.status()["spares"] == []          # not listed: its process is gone
        assert second.stop() == 0
        third = SidecarProcess(IDLE, instance=first.instance, runtime_root=runtime_root,
                               log_path=tmp_path / "third.log").start()
        assert not killed.paths.spare_file(killed.proc.pid).exists()   # its file removed as stale
        third.stop()
    finally:
        for sc in (spare, second, first):
            if sc is not None:
                sc.stop(signal.SIGKILL)


def test_a_spare_never_starts_a_pool_nobody_served(runtime_root, tmp_path):
    spare = SidecarProcess(IDLE, runtime_root=runtime_root, log_path=tmp_path / "spare.log")
    spare.spawn(["--spare"])
    try:
        time.sleep(1.5)
        assert spare.proc.poll() is None
        assert not spare.paths.state_file.exists() and not spare.paths.control_socket.exists()
        assert not spare.paths.lock_file.exists()
        first = SidecarProcess(IDLE, instance=spare.instance, runtime_root=runtime_root,
                               log_path=tmp_path / "first.log").start()
        try:                                            # the first sidecar starts as usual
            wait_until(lambda: first.status()["spares"] == [spare.proc.pid], timeout_s=10,
                       what="the spare to wait on it")
            first.wait_steady(standbys=1)
            os.kill(first.proc.pid, signal.SIGKILL)
            first.proc.wait()
            spare.wait_serving(timeout=30)              # and the spare takes over from its death
            assert spare.status()["spare"]["previous_pid"] == first.proc.pid
        finally:
            first.stop(signal.SIGKILL)
    finally:
        spare.stop(signal.SIGKILL)


@pytest.mark.slow
def test_a_spare_killed_while_it_readopts_leaves_the_pool_to_the_next_sidecar(tiny_model, runtime_root, tmp_path):
    """The spare dies in the middle of its takeover: it has claimed the tables and has the
    regions' descriptors back, and binds no socket yet (it stops itself there, KVHOLD_SIDECAR_STOP_AT,
    and is SIGKILLed while stopped). The executors go back to waiting and hand the pool to the
    next sidecar that claims the tables: the same executors, nothing recomputed, the streams
    as an uninterrupted run."""
    flags = ["--model", str(tiny_model), *FLAGS, "--journal-dir", str(tmp_path / "journal")]
    first = SidecarProcess(flags, runtime_root=runtime_root, log_path=tmp_path / "first.log").start()
    spare = third = None
    clients = contextlib.ExitStack()
    try:
        client = clients.enter_context(first.new_client(timeout=60))
        reference = [r.token_ids for r in wait_all(submit_requests(client, REQUESTS))]
        first.wait_steady(standbys=1)
        spare = first.spare(log_path=tmp_path / "spare.log", env={STOP_AT_ENV: "regions_back"})
        streams = submit_requests(client, REQUESTS)
        for s in streams:                              # every request is streaming at the kill
            next(s)
        before = roles(first.status())
        os.kill(first.proc.pid, signal.SIGKILL)        # the sidecar alone: the spare takes over ...
        first.proc.wait()
        wait_stopped(spare.proc.pid)                   # ... as far as the regions handed back
        assert "stopping at regions_back" in sidecar_log(spare)
        tables = Tables.attach_name(first.paths.shm_name("tables"))
        try:
            assert tables.sidecar_pid == spare.proc.pid                 # it claimed the tables
        finally:
            tables.close()
        spare.proc.kill()
        spare.proc.wait()
        third = SidecarProcess(flags, instance=first.instance, runtime_root=runtime_root,
                               log_path=tmp_path / "third.log").start()
        results = wait_all(streams)
        assert [r.token_ids for r in results] == reference
        assert [r.recomputed_tokens for r in results] == [0] * len(REQUESTS)
        wait_until(lambda: set(before) <= {e["pid"] for e in third.events("attach")},
                   timeout_s=30, what="both executors to attach to the third sidecar")
        status = third.status()
        assert roles(status) == before                 # re-adopted, not replaced
        assert status["adoption"]["previous_pid"] == spare.proc.pid
        assert status["weights"]["load_ms"] is None and not third.events("spawn")
        assert f"sidecar pid {spare.proc.pid} died while adopting this executor" in sidecar_log(first)
    finally:
        clients.close()
        for sc in (third, spare, first):
            if sc is not None:
                sc.stop(signal.SIGKILL)
