"""Crash recovery end to end with real processes: every request completes exactly as an
uninterrupted run would, whatever instruction the executor dies at."""
import os
import random
import re
import signal

import numpy as np
import pytest

from kvhold.client.client import wait_all
from kvhold.protocol.layout import AdmitState
from tests.process.helpers import (FLAGS, REQUESTS, attach_pool as _attach, ids, run_with_fault, sidecar_log,
                                   submit, unique_prompt_token, wait_stopped, wait_until)

def _kill_active(sc, sig=signal.SIGKILL):
    pid = sc.wait_steady(standbys=0)["pid"]
    os.kill(pid, sig)
    return pid


def test_reference_is_batch_independent(tiny_model, reference, start_sidecar):
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS])
    sc.wait_steady()
    with sc.new_client() as client:
        alone = [ids(wait_all(submit(client, [r])))[0] for r in REQUESTS]
    assert alone == reference


@pytest.mark.slow
def test_kills_at_random_moments(tiny_model, reference, start_sidecar):
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS])
    rng = random.Random(42)
    total = sum(len(r) for r in reference)
    kills = 0
    with sc.new_client(timeout=60) as client:
        for trial in range(8):
            sc.wait_steady()
            threshold = rng.randrange(0, total - 20)
            streams = submit(client)
            if threshold == 0 or trial == 0:     # before any token: during prefill
                _kill_active(sc)
                kills += 1
                threshold = -1
            seen = [0]

            def on_event(stream, event):
                seen[0] += 1
                if seen[0] == threshold:
                    _kill_active(sc)

            assert ids(wait_all(streams, on_event)) == reference, f"trial {trial}"
            kills += threshold > 0
    recoveries = sc.status()["recoveries"]
    assert len(recoveries) >= kills == 8
    assert all(r["requests_lost"] + r["requests_damaged"] == 0 for r in recoveries)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["commit_begin:6:kill", "commit_pages:2:kill", "commit_pages:9:kill",
                                   "commit_journal:8:kill", "commit_finish:20:kill",
                                   "commit_journal:4:segv"])
def test_death_between_commit_stages(tiny_model, reference, start_sidecar, tmp_path, fault):
    got, rec = run_with_fault(start_sidecar, ["--model", str(tiny_model), *FLAGS], tmp_path, fault)
    assert got == reference
    assert len(rec) == 1 and rec[0]["requests_lost"] == 0


def test_bit_flips_recompute_exactly_the_damaged_requests(tiny_model, reference, start_sidecar, tmp_path):
    # The requests are admitted while the executor is held (SIGSTOP), so it takes them all in one
    # step however slowly this test's client submits them. It then stops itself at the 24th step
    # that holds request 0 (before its forward): its second page (tokens 16..31) is published then,
    # request 2's sixth page (its 200-token prompt is computed in its first steps) too, and request
    # 0 has 17 tokens still to come. The replacement runs clean. (The long lease keeps the sidecar
    # from fencing the held executor; the kill is seen through its pidfd.)
    token = unique_prompt_token(tiny_model, REQUESTS, 0)
    env = {"KVHOLD_FAULT": f"step:token={token}@24:stop", "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")}
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--lease-ms", "30000"], env=env)
    pid = sc.wait_steady()["pid"]
    tables, words = _attach(sc)
    targets = {0: 1, 2: 5}                 # request index -> logical page to corrupt
    flipped = {}
    with sc.new_client(timeout=60) as client:
        os.kill(pid, signal.SIGSTOP)
        wait_stopped(pid, 60)
        streams = submit(client)
        rids = tables.requests["request_id"]
        wait_until(lambda: all(np.any((rids == s.request_id) & (tables.requests["admit_state"] == AdmitState.ADMITTED))
                               for s in streams), 60, what="every request admitted to the journal")
        os.kill(pid, signal.SIGCONT)
        wait_until((tmp_path / "fired").exists, 60, what="the fault to fire")
        wait_stopped(pid, 60)              # by the fault: the tables hold still while we aim
        for index, logical in targets.items():
            slot = int(np.nonzero(rids == streams[index].request_id)[0][0])
            assert int(tables.requests["num_pages"][slot]) > logical
            page = int(tables.page_lists[slot, logical])
            assert tables.pages["num_tokens"][page] == 16           # sealed
            words[page, 1, 0, 3, 5] ^= np.uint32(1 << 17)             # layer 1, keys, token 3
            flipped[streams[index].request_id] = logical
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)
        results = wait_all(streams)
    assert ids(results) == reference
    rec = sc.status()["recoveries"][-1]
    assert rec["requests_damaged"] == 2 and rec["requests_lost"] == 0 and rec["pages_bad"] == 2
    by_id = {r["request_id"]: r for r in rec["requests"]}
    for rid, logical in flipped.items():
        assert by_id[rid]["class"] == "damaged" and by_id[rid]["first_bad_page"] == logical
        assert by_id[rid]["kv_kept"] == 16 * logical
    for i, r in enumerate(results):
        damaged = r.request_id in flipped
        assert (r.recomputed_tokens > 0) == damaged, i
        if not damaged:              # (one that reached the executor after the kill is in no class)
            assert by_id.get(r.request_id, {"class": "resumable"})["class"] == "resumable"
    # the takeover's host timing marks, in order: the prefetched checksum pass was the one used
    marks = re.findall(r"takeover host marks \(ms from its start\): (.*)", sidecar_log(sc))
    assert marks, "no takeover host marks logged"
    parts = [part.rsplit(" ", 1) for part in marks[-1].split(", ")]
    assert [label for label, _ in parts] == ["prefetched", "plans", "records", "sums_prefetched", "sums", "verdicts"]
    times = [float(t) for _, t in parts]
    assert times == sorted(times) and times[0] >= 0


def test_pool_too_small_preempts_and_resumes(tiny_model, start_sidecar):
    requests = [dict(prompt=f"Request number {i} starts here", max_tokens=60, temperature=0.8, seed=i)
                for i in range(6)]
    big = start_sidecar(["--model", str(tiny_model), "--max-seq-len", "192", "--standbys", "0"])
    big.wait_steady(standbys=0)
    with big.new_client() as client:
        want = ids(wait_all(submit(client, requests)))
    big.stop()
    small = start_sidecar(["--model", str(tiny_model), "--kv-pages", "13", "--max-seq-len", "192"])
    small.wait_steady()
    with small.new_client(timeout=60) as client:
        got = wait_all(submit(client, requests))
    assert ids(got) == want
    assert sum(r.preemptions for r in got) > 0
    assert small.status()["recoveries"] == []      # nothing crashed
