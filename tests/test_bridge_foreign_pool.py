"""Foreign-pool mode end to end (issue 7 item 1): the reference engine keeps its own private KV
pool and is protected only by the KV mirror. Real sidecar, real executors, real SIGKILLs; the
continuation must equal an uninterrupted run of the native engine."""
import os
import signal

import numpy as np
import posix_ipc
import pytest

from ipc.client import wait_all
from ipc.memory import Mapping, RegionInfo
from ipc.tables import Tables
from tools.sidecar_process import submit_requests

FLAGS = ["--kv-pages", "128", "--max-seq-len", "256", "--max-batch-tokens", "64", "--max-batch", "16",
         "--log-level", "INFO"]
FOREIGN = [*FLAGS, "--kv-mode", "foreign"]
REQUESTS = [
    dict(prompt="The sidecar keeps the memory", max_tokens=36, temperature=0.0),
    dict(prompt="Once upon a time", max_tokens=36, temperature=0.8, seed=7),
    dict(prompt_ids=list(range(2, 102)), max_tokens=24, temperature=1.0, top_p=0.9, seed=3),
    dict(prompt="Never lose a stream", max_tokens=32, temperature=1.1, seed=5),
]


def submit(client, requests=REQUESTS):
    return submit_requests(client, requests)


def ids(results):
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def reference(tiny_model):
    """The native engine, uninterrupted."""
    from tools.sidecar_process import SidecarProcess

    with SidecarProcess(["--model", str(tiny_model), *FLAGS, "--standbys", "0"]) as sc:
        sc.wait_steady(standbys=0)
        with sc.new_client() as client:
            return ids(wait_all(submit(client)))


def _attach(sc):
    uid = os.getuid()
    tables = Tables.attach_name(f"/kvhold-{uid}-{sc.instance}-tables")
    shm = posix_ipc.SharedMemory(f"/kvhold-{uid}-{sc.instance}-kv")
    g = tables.geometry
    kv = Mapping.from_fd(shm.fd, RegionInfo("kv", g.kv_pool_bytes, "host", False))
    shm.close_fd()
    words = kv.numpy(np.uint32, (g.num_pages, g.kv.num_layers, 2, g.kv.page_tokens, g.kv.row_bytes // 4))
    return tables, words


def test_sigkill_mid_stream_continues_identically(tiny_model, reference, start_sidecar):
    sc = start_sidecar(["--model", str(tiny_model), *FOREIGN])
    total = sum(len(r) for r in reference)
    with sc.new_client(timeout=60) as client:
        sc.wait_steady()
        assert ids(wait_all(submit(client))) == reference          # uninterrupted, foreign mode
        for threshold in (total // 3, (2 * total) // 3):
            sc.wait_steady()
            streams, seen = submit(client), [0]

            def on_event(stream, event):
                seen[0] += 1
                if seen[0] == threshold:
                    os.kill(sc.wait_steady()["pid"], signal.SIGKILL)

            assert ids(wait_all(streams, on_event)) == reference, threshold
    sc.wait_steady()             # a standby still starting up would slow the sidecar's stop
    recoveries = sc.status()["recoveries"]
    assert len(recoveries) == 2
    for rec in recoveries:
        assert rec["kv_mode"] == "foreign"
        assert rec["requests_lost"] + rec["requests_damaged"] == 0
        assert rec["tokens_recomputed"] == 0 and rec["tokens_kept"] > 0 and rec["pages_bad"] == 0


def test_damaged_mirror_page_recomputes_from_the_first_bad_block(tiny_model, reference, start_sidecar):
    sc = start_sidecar(["--model", str(tiny_model), *FOREIGN, "--lease-ms", "3000"])
    sc.wait_steady()
    tables, words = _attach(sc)
    with sc.new_client(timeout=60) as client:
        streams, seen, flipped = submit(client), [0], {}

        def on_event(stream, event):
            seen[0] += 1
            if seen[0] != 60 or flipped:
                return
            pid = sc.wait_steady()["pid"]
            os.kill(pid, signal.SIGSTOP)          # hold the tables still while we aim
            rids = tables.requests["request_id"]
            for s in streams:
                slot = int(np.nonzero(rids == s.request_id)[0][0])
                n = int(tables.requests["num_pages"][slot])
                pages = tables.page_lists[slot, :n]
                # the journal lists kvhold pages that the mirror assigned to this request, in order
                assert (tables.pages["owner"][pages] == s.request_id).all()
                assert (tables.pages["logical"][pages] == np.arange(n)).all()
            target = streams[2]                   # the 100-token prompt: blocks 0..5 are sealed
            slot = int(np.nonzero(rids == target.request_id)[0][0])
            page = int(tables.page_lists[slot, 2])
            assert tables.pages["num_tokens"][page] == 16
            words[page, 1, 1, 4, 3] ^= np.uint32(1 << 9)        # layer 1, values, token 4
            flipped[target.request_id] = 2
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)

        results = wait_all(streams, on_event)
    assert ids(results) == reference
    sc.wait_steady()
    rec = sc.status()["recoveries"][-1]
    assert rec["kv_mode"] == "foreign" and rec["pages_bad"] == 1
    assert rec["requests_damaged"] == 1 and rec["requests_lost"] == 0
    by_id = {r["request_id"]: r for r in rec["requests"]}
    for r in results:
        row = by_id[r.request_id]
        if r.request_id in flipped:
            assert row["class"] == "damaged" and row["first_bad_page"] == 2 and row["kv_kept"] == 32
            assert r.recomputed_tokens > 0
        else:
            assert row["class"] == "resumable" and r.recomputed_tokens == 0


def test_native_mode_is_untouched(tiny_model):
    """Without --kv-mode foreign, executors run the native workload (settings say so)."""
    from sidecar.config import SidecarConfig

    native = SidecarConfig(model=tiny_model).executor_settings()
    assert native["kv_mode"] == "native"
    with pytest.raises(ValueError, match="--kv-mode"):
        SidecarConfig(model=tiny_model, kv_mode="borrowed")
