"""Tensor-parallel executor groups served by the real sidecar (`-tp 2`, gloo, real processes):
requests through the SDK give the TP=1 tokens (float64 CPU: greedy and sampled alike); a
SIGKILL of either rank, a SIGSTOP of one rank, a SIGKILL of rank 1 while rank 0 is stopped
(the sidecar's own watch of the ranks) or a crash (SIGSEGV) of rank 1 in the middle of the streams kills the whole active
group (no rank of it survives) and the hot-standby group resumes: every request
completes, 0 lost, every output equal to the uninterrupted TP=1 run's."""
from __future__ import annotations

import os
import signal

import pytest

from kvhold.client.client import wait_all
from kvhold.executor.tensor_parallel.ranks import group_pids
from kvhold.protocol.procfs import pid_alive
from tests.process.helpers import FLAGS, ids, sidecar_log, submit, wait_until

TP_FLAGS = [*FLAGS, "-tp", "2", "--cpu-threads", "1"]


def _steady_group(sc) -> tuple[list[int], int]:
    """The active group's pids (rank order) and epoch, once a hot-standby group is ready too."""
    active = sc.wait_steady(standbys=1, timeout=120)
    assert active["ranks"] == group_pids(active["pid"]), "the sidecar watches the ranks the leader started"
    assert len(active["ranks"]) == 2
    return active["ranks"], active["epoch"]


def _run_with_fault(sc, client, at_event: int, fault) -> list[list[int]]:
    seen = [0]

    def on_event(stream, event):
        seen[0] += 1
        if seen[0] == at_event:
            fault()

    return ids(wait_all(submit(client), on_event))


def _gone(pids: list[int]) -> None:
    wait_until(lambda: not any(pid_alive(p) for p in pids), 30, what=f"every rank of {pids} to be gone")


def test_group_serves_tp1_tokens_and_survives_each_rank_faulted(tiny_model, reference, start_sidecar):
    sc = start_sidecar(["--model", str(tiny_model), *TP_FLAGS])
    with sc.new_client(timeout=60) as client:
        _steady_group(sc)
        assert ids(wait_all(submit(client))) == reference, "TP=2 gives the TP=1 tokens"
        faults = [("SIGKILL rank 1", [(1, signal.SIGKILL)], "died"),
                  ("SIGKILL rank 0", [(0, signal.SIGKILL)], "died"),
                  ("SIGSTOP rank 1", [(1, signal.SIGSTOP)], "hang"),
                  # rank 0 cannot act on its watch: the sidecar's own watch of rank 1 fences the group
                  ("SIGSTOP rank 0, SIGKILL rank 1", [(0, signal.SIGSTOP), (1, signal.SIGKILL)], "died"),
                  # a crash of a rank (not a kill from outside) counts against the step's requests
                  ("SIGSEGV rank 1", [(1, signal.SIGSEGV)], "died")]
        for trial, (what, signals, reason) in enumerate(faults):
            group, epoch = _steady_group(sc)

            def fault(group=group, signals=signals):
                for rank, sig in signals:
                    os.kill(group[rank], sig)

            assert _run_with_fault(sc, client, 30 + 20 * trial, fault) == reference, what
            _gone(group)                     # the whole group: a stopped rank too
            fence = next(e for e in sc.events("fence") if e.get("fenced_epoch") == epoch)
            assert fence["reason"] == reason, (what, fence)
            if len(signals) == 2:
                assert "of its group died" in fence["detail"], fence
            wait_until(lambda: any(e["pid"] == group[0] for e in sc.events("exit")), 10,
                       what="the leader's exit, which settles the death")
            assert sc.status()["request_deaths"]["failed_total"] == 0, what
            # a death in a step counts against its requests unless the group was killed from
            # outside (SIGKILL of a rank): a crash of a rank (SIGSEGV) is not forgiven
            log = sidecar_log(sc)
            forgiven = f"executor of epoch {epoch} was killed from outside" in log
            if reason == "died" and f"dead executor (epoch {epoch}," in log:
                assert forgiven == (signals[-1][1] != signal.SIGSEGV), what
    recoveries = sc.status()["recoveries"]
    assert len(recoveries) >= len(faults)
    assert all(r["requests_lost"] == 0 for r in recoveries)


@pytest.mark.slow
def test_double_fault_a_follower_then_the_promoted_leader(tiny_model, reference, start_sidecar):
    """A rank of the active group dies; the standby group is promoted and its leader dies before
    a new standby is ready: a group started cold takes over, and nothing is lost."""
    sc = start_sidecar(["--model", str(tiny_model), *TP_FLAGS])
    with sc.new_client(timeout=120) as client:
        first, _ = _steady_group(sc)
        standby = sc.executors(sc.status(), "standby")[0]["pid"]
        second: list[int] = []

        def double():
            os.kill(first[1], signal.SIGKILL)
            wait_until(lambda: any(e["pid"] == standby for e in sc.executors(sc.status(), "active")), 30,
                       what="the standby group's promotion")
            second.extend(group_pids(standby))
            os.kill(standby, signal.SIGKILL)

        assert _run_with_fault(sc, client, 25, double) == reference
        _gone(first + second)
    assert all(r["requests_lost"] == 0 for r in sc.status()["recoveries"])


@pytest.mark.slow
def test_serve_streams_over_http_across_a_rank_kill(tiny_model, tmp_path, runtime_root):
    """`kvhold serve -tp 2`: an OpenAI stream crosses a SIGKILL of rank 1 with the same text as
    the uninterrupted completion."""
    from tests.process.helpers import KEY, Server

    srv = Server(tiny_model, runtime_root, tmp_path / "serve.log", "-tp", "2", "--cpu-threads", "1",
                 api_key=KEY)
    try:
        kw = dict(model="tiny-v1", prompt="Never lose a stream", max_tokens=80, temperature=0.9, seed=11)
        reference = srv.openai().completions.create(**kw).choices[0].text
        active = next(e for e in srv.sidecar_status()["executors"] if e["role"] == "active")
        assert len(active["ranks"]) == 2
        parts = []
        for i, chunk in enumerate(srv.openai().completions.create(stream=True, **kw)):
            parts.append(chunk.choices[0].text)
            if i == 10:
                os.kill(active["ranks"][1], signal.SIGKILL)
        assert "".join(parts) == reference
        assert srv.wait_healthy()["active_pid"] != active["pid"]
        _gone(active["ranks"])
    finally:
        srv.stop()


def test_a_takeover_validates_every_ranks_kv(tiny_model, reference, start_sidecar):
    """A bit flipped in rank 1's heads of a sealed page (the group frozen, then killed) is found
    by the standby group's validation: that request is recomputed from that page on, the others
    resume, and every output equals the TP=1 run's."""
    import numpy as np

    from tests.process.helpers import attach_pool as _attach

    sc = start_sidecar(["--model", str(tiny_model), *TP_FLAGS, "--lease-ms", "3000"])
    group, _ = _steady_group(sc)
    tables, words = _attach(sc)
    row_words = words.shape[-1]                # [kv_head][head_dim] of a token row; rank 1 holds the back half
    with sc.new_client(timeout=60) as client:
        streams = submit(client)
        flipped = {}

        def sealed_page():
            rid = streams[0].request_id
            hit = np.nonzero(tables.requests["request_id"] == rid)[0]
            if not len(hit) or int(tables.requests["num_pages"][hit[0]]) < 3:
                return None
            page = int(tables.page_lists[hit[0], 1])
            return page if tables.pages["num_tokens"][page] == 16 else None

        def on_event(stream, event):
            if flipped or sealed_page() is None:
                return
            for pid in group:
                os.kill(pid, signal.SIGSTOP)   # the tables and the pool hold still
            page = sealed_page()
            words[page, 1, 0, 3, row_words - 1] ^= np.uint32(1 << 17)   # layer 1, keys, token 3, rank 1
            flipped[streams[0].request_id] = page
            for pid in group:
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)

        results = wait_all(streams, on_event)
    assert flipped and ids(results) == reference
    rec = sc.status()["recoveries"][-1]
    assert rec["pages_bad"] == 1 and rec["requests_damaged"] == 1 and rec["requests_lost"] == 0
    by_id = {r["request_id"]: r for r in rec["requests"]}
    assert by_id[streams[0].request_id]["class"] == "damaged"
    assert by_id[streams[0].request_id]["first_bad_page"] == 1
    assert by_id[streams[0].request_id]["kv_kept"] == 16


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["commit_pages:9:kill", "commit_journal:8:kill"])
def test_leader_death_between_commit_stages(tiny_model, reference, start_sidecar, tmp_path, fault):
    env = {"KVHOLD_FAULT": fault, "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")}
    sc = start_sidecar(["--model", str(tiny_model), *TP_FLAGS], env=env)
    _steady_group(sc)
    with sc.new_client(timeout=60) as client:
        assert ids(wait_all(submit(client))) == reference
    assert (tmp_path / "fired").exists()
    rec = sc.status()["recoveries"]
    assert len(rec) == 1 and rec[0]["requests_lost"] == 0
