"""Crash recovery end to end with real processes: every request completes exactly as an
uninterrupted run would, whatever instruction the executor dies at."""
import os
import random
import re
import signal

import numpy as np
import pytest

from kvhold.client.client import wait_all
from tests.process.helpers import FLAGS, REQUESTS, attach_pool as _attach, ids, run_with_fault, sidecar_log, submit

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


def test_bit_flips_recompute_exactly_the_damaged_requests(tiny_model, reference, start_sidecar):
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--lease-ms", "3000"])
    sc.wait_steady()
    tables, words = _attach(sc)
    targets = {0: 1, 2: 5}                 # request index -> logical page to corrupt
    with sc.new_client(timeout=60) as client:
        streams = submit(client)
        seen = [0]
        flipped = {}

        def aim() -> dict | None:
            """The target pages, once each is sealed (read from the tables), else None."""
            rids = tables.requests["request_id"]
            aims = {}
            for index, logical in targets.items():
                hit = np.nonzero(rids == streams[index].request_id)[0]
                if not len(hit):
                    return None
                slot = int(hit[0])
                page = int(tables.page_lists[slot, logical])
                if int(tables.requests["num_pages"][slot]) <= logical or tables.pages["num_tokens"][page] != 16:
                    return None                # not sealed yet: aim again at a later token
                aims[index] = page
            return aims

        def on_event(stream, event):
            seen[0] += 1
            # as soon as both target pages are sealed (a busy client lags the engine: waiting
            # for a token count could find a target already finished)
            if flipped or aim() is None:
                return
            pid = sc.wait_steady()["pid"]
            os.kill(pid, signal.SIGSTOP)       # freeze it: the tables hold still while we aim
            aims = aim()
            if aims is None:
                os.kill(pid, signal.SIGCONT)
                return
            for index, page in aims.items():
                words[page, 1, 0, 3, 5] ^= np.uint32(1 << 17)    # layer 1, keys, token 3
                flipped[streams[index].request_id] = targets[index]
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)

        results = wait_all(streams, on_event)
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
        if not damaged:
            assert by_id[r.request_id]["class"] == "resumable"
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
