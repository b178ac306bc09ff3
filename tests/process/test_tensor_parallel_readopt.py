"""Tensor-parallel executor groups (`-tp 2`, gloo, real processes) outlive a SIGKILLed sidecar:
a restarted sidecar, or a spare waiting in the instance lock, re-adopts both groups (active and
hot standby, the same pids in the same roles), watches every rank of each as the sidecar that
spawned them did, and the streams go on with the tokens of an uninterrupted TP=1 run. After the
re-adoption a rank's death still ends its whole group and the standby group resumes, 0 lost;
with rank 0 stopped (it cannot act on its own watch) only the re-adopting sidecar's watch of
rank 1 can fence the group at once rather than after a lease of silence. A follower killed while
no sidecar runs ends its group (the leader's watch), and one killed while its leader is stopped
leaves a group short of a rank, which the re-adopting sidecar fences at once. A pool restart of
a `-tp 2` sidecar brings every request back on new groups, outputs unchanged."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import types

import pytest

from kvhold.client.client import wait_all
from kvhold.executor.tensor_parallel.ranks import group_pids
from kvhold.protocol.procfs import pid_alive
from kvhold.testing.sidecar_process import SidecarProcess
from tests.process.helpers import (FLAGS, POOL_RESTART_REQUESTS as LONG_REQUESTS, REQUESTS, ids, pool_restart_cli,
                                   sidecar_log, submit, wait_stopped, wait_until)

# a lease long enough that a hang fence (a stopped rank 0) cannot pass for the rank watch's
TP_FLAGS = [*FLAGS, "-tp", "2", "--cpu-threads", "1", "--standbys", "1", "--lease-ms", "8000"]


def _groups(sc: SidecarProcess) -> dict[str, list[int]]:
    """{"active": ranks, "standby": ranks} once both groups are ready; each as /proc shows it and
    as the sidecar watches it (the status's `ranks`)."""
    sc.wait_steady(standbys=1, timeout=120)
    out = {}
    for e in sc.status()["executors"]:
        assert e.get("ranks") == group_pids(e["pid"]), ("the sidecar watches the group's ranks", e)
        assert len(e["ranks"]) == 2
        out[e["role"]] = e["ranks"]
    return out


def _gone(pids: list[int]) -> None:
    wait_until(lambda: not any(pid_alive(p) for p in pids), 30, what=f"every rank of {pids} to be gone")


def _kill_sidecar_mid_stream(first: SidecarProcess, streams) -> dict[str, list[int]]:
    for s in streams:                                   # every request is streaming at the kill
        next(s)
    groups = _groups(first)
    os.kill(first.proc.pid, signal.SIGKILL)             # the sidecar alone: its groups live on
    first.proc.wait()
    return groups


@contextlib.contextmanager
def _sidecar_killed_mid_stream(tiny_model, runtime_root, tmp_path, spare: bool = False):
    """A `-tp 2` sidecar streaming REQUESTS, SIGKILLed once every stream has a token (its groups
    live on), with a spare waiting if `spare` (`run.successor`). Yields the run: `streams`,
    `before` (the groups' ranks at the kill), `restart()` to start a successor sidecar. Every
    sidecar and the client are stopped at the end."""
    flags = ["--model", str(tiny_model), *TP_FLAGS, "--journal-dir", str(tmp_path / "journal")]
    with contextlib.ExitStack() as stack:
        first = SidecarProcess(flags, runtime_root=runtime_root, log_path=tmp_path / "first.log").start()
        stack.callback(first.stop, signal.SIGKILL)
        run = types.SimpleNamespace(first=first, successor=None)
        _groups(first)              # both groups ready before the streams start: they end after the kill
        if spare:
            run.successor = first.spare(log_path=tmp_path / "spare.log")
            stack.callback(run.successor.stop)
        client = stack.enter_context(first.new_client(timeout=120))
        run.streams = submit(client)
        run.before = _kill_sidecar_mid_stream(first, run.streams)

        def restart() -> SidecarProcess:
            run.successor = SidecarProcess(flags, instance=first.instance, runtime_root=runtime_root,
                                           log_path=tmp_path / "second.log").start()
            stack.callback(run.successor.stop)
            return run.successor
        run.restart = restart
        yield run


def _readopted(second: SidecarProcess, before: dict[str, list[int]]) -> None:
    leaders = {ranks[0] for ranks in before.values()}
    wait_until(lambda: leaders <= {e["pid"] for e in second.events("attach")}, timeout_s=60,
               what="both group leaders to attach again")
    assert all(pid_alive(p) for ranks in before.values() for p in ranks)   # no rank was replaced
    status = second.status()
    assert {e["role"]: e["ranks"] for e in status["executors"]} == before   # watched, same roles
    assert {e["via"] for e in status["executors"]} == {"readopted"}
    assert status["pool_restart"]["restore"]["requests_adopted"] == len(REQUESTS)   # all mid-stream
    assert not second.events("spawn") and not second.events("fence")


def test_restarted_sidecar_readopts_both_groups_and_watches_their_ranks(tiny_model, reference, runtime_root,
                                                                        tmp_path):
    with _sidecar_killed_mid_stream(tiny_model, runtime_root, tmp_path) as run:
        streams, before = run.streams, run.before
        second = run.restart()
        _readopted(second, before)
        active_epoch = next(e["epoch"] for e in second.status()["executors"] if e["role"] == "active")

        # rank 0 stopped, rank 1 killed: rank 0 cannot act on its own watch and, stopped, keeps its
        # liveness mutex; only the sidecar's watch of rank 1 fences the group before the lease ends
        seen = [0]

        def on_event(stream, event):
            seen[0] += 1
            if seen[0] == 10:
                os.kill(before["active"][0], signal.SIGSTOP)
                wait_stopped(before["active"][0])
                os.kill(before["active"][1], signal.SIGKILL)

        results = wait_all(streams, on_event)
        assert ids(results) == reference                # as an uninterrupted TP=1 run
        _gone(before["active"])                         # the whole group, its stopped leader too
        fence = next(e for e in second.events("fence") if e.get("fenced_epoch") == active_epoch)
        assert fence["reason"] == "died" and "of its group died" in fence["detail"], fence
        new = second.wait_steady(standbys=1, timeout=120)
        assert new["pid"] == before["standby"][0]       # the re-adopted standby group took over
        (recovery,) = second.status()["recoveries"]
        assert recovery["requests_lost"] == 0
        assert second.status()["request_deaths"]["failed_total"] == 0


@pytest.mark.slow
def test_a_follower_killed_while_no_sidecar_runs_ends_its_group_and_the_standby_group_resumes(
        tiny_model, reference, runtime_root, tmp_path):
    """The leader's own watch ends the group while no sidecar runs; the restarted sidecar finds the
    ACTIVE lease dead, re-adopts the standby group alone and promotes it once it attached again."""
    with _sidecar_killed_mid_stream(tiny_model, runtime_root, tmp_path) as run:
        streams, before = run.streams, run.before
        os.kill(before["active"][1], signal.SIGKILL)
        _gone(before["active"])                         # the leader exits on its watch, rank 1 is gone
        assert all(pid_alive(p) for p in before["standby"])
        second = run.restart()
        assert ids(wait_all(streams)) == reference
        new = second.wait_steady(standbys=1, timeout=120)
        assert new["pid"] == before["standby"][0] and new["ranks"] == before["standby"]
        status = second.status()
        assert status["adoption"]["dead"] == [before["active"][0]]
        (recovery,) = status["recoveries"]
        assert recovery["requests_lost"] == 0 and recovery["tokens_recomputed"] == 0


@pytest.mark.slow
def test_a_group_short_of_a_rank_at_readoption_is_fenced_and_killed_at_once(tiny_model, reference, runtime_root,
                                                                             tmp_path):
    """Rank 0 stopped, then rank 1 killed, while no sidecar runs: the leader holds its liveness
    mutex but its group cannot step. The re-adopting sidecar finds one rank running of two and
    fences the group at once (not after a lease of silence); the standby group resumes."""
    with _sidecar_killed_mid_stream(tiny_model, runtime_root, tmp_path) as run:
        streams, before = run.streams, run.before
        leader, follower = before["active"]
        os.kill(leader, signal.SIGSTOP)
        wait_stopped(leader)
        os.kill(follower, signal.SIGKILL)
        second = run.restart()
        assert ids(wait_all(streams)) == reference
        _gone(before["active"])                         # the stopped leader is killed too
        (fence,) = second.events("fence")
        assert fence["pid"] == leader and fence["reason"] == "died", fence
        assert "1 of its group's 2 ranks are running" in fence["detail"], fence
        new = second.wait_steady(standbys=1, timeout=120)
        assert new["pid"] == before["standby"][0]
        (recovery,) = second.status()["recoveries"]
        assert recovery["requests_lost"] == 0


@pytest.mark.slow
def test_spare_takes_over_two_groups_and_a_follower_kill_after_it(tiny_model, reference, runtime_root, tmp_path):
    with _sidecar_killed_mid_stream(tiny_model, runtime_root, tmp_path, spare=True) as run:
        streams, before, spare = run.streams, run.before, run.successor
        spare.wait_serving(timeout=60)
        _readopted(spare, before)
        assert spare.status()["spare"]["previous_pid"] == run.first.proc.pid

        seen = [0]

        def on_event(stream, event):
            seen[0] += 1
            if seen[0] == 10:
                os.kill(before["active"][1], signal.SIGKILL)   # a follower of the re-adopted group

        results = wait_all(streams, on_event)
        assert ids(results) == reference
        _gone(before["active"])
        new = spare.wait_steady(standbys=1, timeout=120)
        assert new["pid"] == before["standby"][0]
        (recovery,) = spare.status()["recoveries"]
        assert recovery["requests_lost"] == 0
        assert "this spare takes over" in sidecar_log(spare)


@pytest.mark.slow
def test_pool_restart_of_a_tp2_sidecar(tiny_model, runtime_root, tmp_path):
    """`kvhold pool-restart --continue` mid-stream: both groups stop (no rank left over), the
    re-executed sidecar starts new groups and every request continues, 0 lost, TP=1 tokens."""
    with SidecarProcess(["--model", str(tiny_model), *FLAGS, "--standbys", "0"],
                        runtime_root=runtime_root, log_path=tmp_path / "tp1.log") as tp1:
        tp1.wait_steady(standbys=0)
        with tp1.new_client(timeout=60) as client:
            reference = ids(wait_all(submit(client, LONG_REQUESTS)))
    journal = tmp_path / "journal"
    flags = ["--model", str(tiny_model), *TP_FLAGS, "--journal-dir", str(journal)]
    sc = SidecarProcess(flags, runtime_root=runtime_root, log_path=tmp_path / "sidecar.log").start()
    try:
        old = _groups(sc)
        generation = sc.status()["generation"]
        with sc.new_client(timeout=120) as client:
            streams = submit(client, LONG_REQUESTS)
            for s in streams:
                next(s)
            cli = pool_restart_cli(sc.instance, runtime_root, "--continue", "--timeout", "120", "--json",
                                   timeout=180)
            assert cli.returncode == 0, cli.stderr
            results = wait_all(streams)
        assert ids(results) == reference                # 0 lost, the TP=1 tokens
        figures = json.loads(cli.stdout[cli.stdout.index("{"):])
        assert figures["requests_restored"] == len(LONG_REQUESTS) and not figures["failed"]   # all mid-stream
        new = _groups(sc)
        assert not {p for r in old.values() for p in r} & {p for r in new.values() for p in r}
        _gone([p for r in old.values() for p in r])
        status = sc.status()
        assert status["pid"] == sc.proc.pid and status["generation"] == generation + 1
        assert status["pool_restart"]["previous_drain"]["requests_journaled"] == len(LONG_REQUESTS)
    finally:
        sc.stop()
