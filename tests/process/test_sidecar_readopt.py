"""A SIGKILLed sidecar loses no memory: its executors outlive it, a restarted sidecar of the
instance re-adopts the tables, regions, executors and in-flight requests, and the streams
finish as an uninterrupted run would, with nothing recomputed and the weights not reloaded.
Real processes, real signals, real shared memory."""
import contextlib
import os
import signal
import time

import pytest

from kvhold.client.client import wait_all
from kvhold.testing.sidecar_process import SidecarProcess, submit_requests
from tests.process.helpers import (READOPT_FLAGS as FLAGS, READOPT_REQUESTS as REQUESTS, alive, roles, sidecar_log,
                                   wait_until)

IDLE = ["--workload", "idle", "--lease-ms", "300", "--log-level", "INFO"]
def start(flags, runtime_root, log_path, instance=None) -> SidecarProcess:
    return SidecarProcess(flags, instance=instance, runtime_root=runtime_root, log_path=log_path).start()


def kill_sidecar_only(sc: SidecarProcess) -> None:
    os.kill(sc.proc.pid, signal.SIGKILL)       # not its process group: its executors live on
    sc.proc.wait()


def test_executors_wait_for_a_sidecar_then_exit_when_none_comes(runtime_root, tmp_path):
    sc = start(IDLE + ["--journal-dir", str(tmp_path / "j"), "--sidecar-wait-ms", "1500"],
               runtime_root, tmp_path / "a.log")
    try:
        sc.wait_steady()
        pids = list(roles(sc.status()))
        kill_sidecar_only(sc)
        time.sleep(0.5)
        assert all(alive(p) for p in pids)                    # waiting, with their mappings
        wait_until(lambda: not any(alive(p) for p in pids), timeout_s=10, what="the executors to give up")
        assert "no sidecar adopted this executor within 2 s; exiting" in sidecar_log(sc)
    finally:
        sc.stop(signal.SIGKILL)


def test_with_no_wait_executors_exit_with_their_sidecar(runtime_root, tmp_path):
    sc = start(IDLE + ["--journal-dir", str(tmp_path / "j"), "--sidecar-wait-ms", "0"],
               runtime_root, tmp_path / "a.log")
    try:
        sc.wait_steady()
        pids = list(roles(sc.status()))
        kill_sidecar_only(sc)
        wait_until(lambda: not any(alive(p) for p in pids), timeout_s=5, what="the executors to exit")
    finally:
        sc.stop(signal.SIGKILL)


def test_idle_pool_is_readopted_and_a_takeover_follows(runtime_root, tmp_path):
    flags = IDLE + ["--journal-dir", str(tmp_path / "j")]
    first = start(flags, runtime_root, tmp_path / "a.log")
    second, clients = None, contextlib.ExitStack()
    try:
        first.wait_steady()
        before = roles(first.status())
        generation = first.status()["generation"]
        kill_sidecar_only(first)
        second = start(flags, runtime_root, tmp_path / "b.log", instance=first.instance)
        wait_until(lambda: set(before) <= {e["pid"] for e in second.events("attach")},
                   timeout_s=20, what="both executors to attach again")
        status = second.status()
        assert roles(status) == before and status["generation"] == generation
        assert not second.events("spawn") and not second.events("fence")
        stale = [line for line in sidecar_log(second).splitlines() if "stale object" in line]
        assert stale and not any("/kvhold-" in line for line in stale)   # its sockets, none of its shm
        active = next(p for p, r in before.items() if r == "active")
        standby = next(p for p, r in before.items() if r == "standby")
        os.kill(active, signal.SIGKILL)
        new = second.wait_for(lambda st: next((e["pid"] for e in st["executors"]
                                               if e["role"] == "active" and e["pid"] != active), None))
        assert new == standby                                    # the standby took over
        assert [e["pid"] for e in second.events("fence")] == [active]
    finally:
        clients.close()
        if second is not None:
            second.stop()
        first.stop(signal.SIGKILL)


def test_an_executor_that_notices_the_death_after_the_new_sidecar_started_reattaches(runtime_root, tmp_path):
    """The standby is frozen across the kill and the new sidecar's start: when it looks, the
    header already names the new sidecar. It must wait for a sidecar other than the one that
    died (the pid it watched), not other than the header's, or it never re-attaches."""
    flags = IDLE[:1] + ["idle", "--lease-ms", "20000", "--log-level", "INFO",
                        "--journal-dir", str(tmp_path / "j")]
    first = start(flags, runtime_root, tmp_path / "a.log")
    second = None
    try:
        first.wait_steady()
        before = roles(first.status())
        standby = next(p for p, r in before.items() if r == "standby")
        os.kill(standby, signal.SIGSTOP)
        try:
            kill_sidecar_only(first)
            second = start(flags, runtime_root, tmp_path / "b.log", instance=first.instance)
            active = next(p for p, r in before.items() if r == "active")
            wait_until(lambda: active in {e["pid"] for e in second.events("attach")}, timeout_s=20,
                       what="the active executor to attach again")
        finally:
            os.kill(standby, signal.SIGCONT)
        wait_until(lambda: standby in {e["pid"] for e in second.events("attach")}, timeout_s=20,
                   what="the standby, woken after the new sidecar started, to attach again")
        assert roles(second.status()) == before
    finally:
        if second is not None:
            second.stop()
        first.stop(signal.SIGKILL)


def test_a_pool_that_cannot_be_adopted_is_replaced_and_its_executors_killed(runtime_root, tmp_path):
    flags = IDLE + ["--journal-dir", str(tmp_path / "j")]
    first = start(flags + ["--kv-pages", "160"], runtime_root, tmp_path / "a.log")
    second, clients = None, contextlib.ExitStack()
    try:
        first.wait_steady()
        old, generation = list(roles(first.status())), first.status()["generation"]
        kill_sidecar_only(first)
        second = start(flags + ["--kv-pages", "192"], runtime_root, tmp_path / "b.log",
                       instance=first.instance)
        assert not any(alive(p) for p in old)           # killed before the fresh pool was made
        second.wait_steady()
        status = second.status()
        assert status["adoption"] is None and status["generation"] == generation + 1
        assert not set(roles(status)) & set(old)
        log = sidecar_log(second)
        assert "not adopting the pool of sidecar pid" in log and "table geometry differs" in log
    finally:
        clients.close()
        if second is not None:
            second.stop()
        first.stop(signal.SIGKILL)


@pytest.mark.slow
def test_sigkilled_sidecar_is_readopted_with_its_executors_and_streams(tiny_model, runtime_root, tmp_path):
    flags = ["--model", str(tiny_model), *FLAGS, "--journal-dir", str(tmp_path / "journal")]
    first = start(flags, runtime_root, tmp_path / "first.log")
    second, clients = None, contextlib.ExitStack()
    try:
        client = clients.enter_context(first.new_client(timeout=60))
        uninterrupted = wait_all(submit_requests(client, REQUESTS))
        reference, texts = [r.token_ids for r in uninterrupted], [r.text for r in uninterrupted]

        first.wait_steady(standbys=1)
        streams = submit_requests(client, REQUESTS)
        for s in streams:                          # every request is streaming at the kill
            next(s)
        status = first.wait_steady(standbys=1) and first.status()
        before, generation = roles(status), status["generation"]
        active = next(pid for pid, role in before.items() if role == "active")
        standby = next(pid for pid, role in before.items() if role == "standby")
        os.kill(first.proc.pid, signal.SIGKILL)    # the sidecar alone: not its process group
        first.proc.wait()
        time.sleep(0.5)
        assert alive(active) and alive(standby)    # they outlive it, waiting

        second = start(flags, runtime_root, tmp_path / "second.log", instance=first.instance)
        wait_until(lambda: {active, standby} <= {e["pid"] for e in second.events("attach")},
                   timeout_s=30, what="both executors to attach again")
        status = second.status()
        assert roles(status) == before                         # same pids, same roles
        assert {e["via"] for e in status["executors"]} == {"readopted"}
        assert status["generation"] == generation                # the same pool, not a new one
        assert status["adoption"]["previous_pid"] == first.proc.pid
        assert sorted(e["pid"] for e in status["adoption"]["executors"]) == sorted(before)
        assert status["pool_restart"]["restore"]["requests_adopted"] == len(REQUESTS)
        assert status["pool_restart"]["restore"]["requests_restored"] == 0
        hand_back = status["adoption"]["hand_back"]     # the regions came back from an executor
        assert hand_back["pid"] in before and set(hand_back["regions"]) == {"kv", "weights"}
        assert all(r["check"].startswith("the same object as") for r in hand_back["regions"].values())

        # while the streams finish: one writer only; the standby runs no step
        seen_active, events = set(), [0]

        def check_writers(stream, event):
            events[0] += 1
            if events[0] % 25:
                return
            st = second.status()
            actives = [e for e in st["executors"] if e["role"] == "active"]
            assert len(actives) == 1
            seen_active.add(actives[0]["pid"])
            assert next(e for e in st["executors"] if e["pid"] == standby)["steps"] == 0

        results = wait_all(streams, on_event=check_writers)
        assert seen_active == {active} and events[0] > 100
        assert [r.token_ids for r in results] == reference      # as an uninterrupted run
        assert [r.text for r in results] == texts
        assert [r.recomputed_tokens for r in results] == [0] * len(REQUESTS)
        status = second.status()
        assert not second.events("spawn")                       # no executor started anew
        assert status["weights"]["state"] == "sealed" and status["weights"]["load_ms"] is None
        assert "loads the weights" not in sidecar_log(second)
        assert status["recoveries"] == []                       # no takeover was needed

        # the normal takeover still works after re-adoption
        streams = submit_requests(clients.enter_context(second.new_client(timeout=60)), REQUESTS)
        for s in streams:
            next(s)
        os.kill(active, signal.SIGKILL)
        results = wait_all(streams)
        assert [r.token_ids for r in results] == reference
        after = second.wait_steady(standbys=1)
        assert after["pid"] == standby
        assert len(second.status()["recoveries"]) == 1
        journal = tmp_path / "journal"                 # every record of both pools' requests removed
        wait_until(lambda: not list(journal.glob("seg-*")) and not list(journal.glob("req-*")),
                   timeout_s=10, what="the durable records to be removed")
    finally:
        clients.close()
        if second is not None:
            second.stop()
        first.stop(signal.SIGKILL)      # whatever is left of its process group



@pytest.mark.slow
def test_an_active_executor_that_dies_while_no_sidecar_runs_is_taken_over_after_readoption(
        tiny_model, runtime_root, tmp_path):
    flags = ["--model", str(tiny_model), *FLAGS, "--journal-dir", str(tmp_path / "journal")]
    first = start(flags, runtime_root, tmp_path / "first.log")
    second, clients = None, contextlib.ExitStack()
    try:
        client = clients.enter_context(first.new_client(timeout=60))
        reference = [r.token_ids for r in wait_all(submit_requests(client, REQUESTS))]
        first.wait_steady(standbys=1)
        streams = submit_requests(client, REQUESTS)
        for s in streams:
            next(s)
        before = roles(first.wait_steady(standbys=1) and first.status())
        active = next(p for p, r in before.items() if r == "active")
        standby = next(p for p, r in before.items() if r == "standby")
        kill_sidecar_only(first)
        os.kill(active, signal.SIGKILL)            # and its active executor, while no sidecar runs
        wait_until(lambda: not alive(active), timeout_s=10, what="the active executor to exit")

        second = start(flags, runtime_root, tmp_path / "second.log", instance=first.instance)
        results = wait_all(streams)
        assert [r.token_ids for r in results] == reference
        status = second.wait_steady(standbys=1)
        assert status["pid"] == standby                          # the re-adopted standby took over
        st = second.status()
        assert [e["pid"] for e in st["adoption"]["executors"]] == [standby]
        assert st["adoption"]["dead"] == [active]
        assert [e["pid"] for e in second.events("fence")] == [active]
        (recovery,) = st["recoveries"]
        assert recovery["requests_resumable"] == len(REQUESTS)
        assert recovery["tokens_recomputed"] == 0
    finally:
        clients.close()
        if second is not None:
            second.stop()
        first.stop(signal.SIGKILL)


@pytest.mark.slow
def test_a_fenced_writer_left_alive_is_killed_at_readoption_and_its_quarantine_released(
        tiny_model, runtime_root, tmp_path):
    flags = ["--model", str(tiny_model), *FLAGS, "--no-kill-fenced", "--journal-dir", str(tmp_path / "journal")]
    first = start(flags, runtime_root, tmp_path / "first.log")
    second, clients = None, contextlib.ExitStack()
    try:
        client = clients.enter_context(first.new_client(timeout=60))
        reference = [r.token_ids for r in wait_all(submit_requests(client, REQUESTS))]
        first.wait_steady(standbys=1)
        streams = submit_requests(client, REQUESTS)
        for s in streams:
            next(s)
        before = roles(first.wait_steady(standbys=1) and first.status())
        active = next(p for p, r in before.items() if r == "active")
        standby = next(p for p, r in before.items() if r == "standby")
        os.kill(active, signal.SIGSTOP)      # fenced as hung, not killed: a writer left alive
        (recovery,) = first.wait_for(lambda st: st["recoveries"], timeout=30)
        assert recovery["pid"] == standby and recovery["pages_quarantined"] > 0
        kill_sidecar_only(first)             # before the stopped writer's exit releases its pages

        second = start(flags, runtime_root, tmp_path / "second.log", instance=first.instance)
        assert active in second.status()["adoption"]["killed"] and not alive(active)
        results = wait_all(streams)
        assert [r.token_ids for r in results] == reference
        wait_until(lambda: any(f"[active pid={standby} " in x and "quarantined pages of exited epochs" in x
                               for x in sidecar_log(first).splitlines()),      # the executors' output
                   timeout_s=10, what="the quarantined pages to be released")
    finally:
        clients.close()
        if second is not None:
            second.stop()
        first.stop(signal.SIGKILL)
        try:
            os.kill(active, signal.SIGKILL)
        except (ProcessLookupError, NameError, UnboundLocalError):
            pass
