"""The prefix cache across a real crash: eight requests run on the cached pages of one shared
prompt; the active executor is stopped mid-stream by a fault point, a bit is flipped in one of
the shared pages, and the executor is SIGKILLed. The replacement finds the damaged page once,
every request that listed it recomputes from its committed tokens, and all eight give the
tokens of a sidecar with no prefix cache; the cache, kept in the shared tables, serves the next
request its undamaged pages."""
import os
import signal

import numpy as np
import pytest

from kvhold.client.client import wait_all
from kvhold.protocol.layout import PageFlag
from tests.process.helpers import FLAGS, attach_pool, ids, submit, wait_stopped, wait_until

SYSTEM = [300 + (7 * j) % 200 for j in range(48)]        # three full 16-token pages
WARM = dict(prompt_ids=SYSTEM + [3, 4, 5], max_tokens=4, temperature=0.0, ignore_eos=True)
REQUESTS = [dict(prompt_ids=SYSTEM + [20 + i, 60 + i, 90 + i], max_tokens=120, temperature=(0.9, 0.0)[i % 2],
                 seed=i, ignore_eos=True) for i in range(8)]
LATER = dict(prompt_ids=SYSTEM + [9, 9, 9, 9], max_tokens=20, temperature=0.0, ignore_eos=True)


def test_a_damaged_shared_page_and_a_sigkill_lose_nothing(tiny_model, start_sidecar, tmp_path):
    plain = start_sidecar(["--model", str(tiny_model), *FLAGS, "--no-enable-prefix-caching", "--standbys", "0"])
    plain.wait_steady(standbys=0)
    with plain.new_client(timeout=60) as client:
        reference = [ids(wait_all(submit(client, requests))) for requests in ([WARM], REQUESTS, [LATER])]
    plain.stop()

    armed = tmp_path / "armed"
    env = {"KVHOLD_FAULT": "commit_pages:1:stop", "KVHOLD_FAULT_IF": str(armed),
           "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")}
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--enable-prefix-caching", "--lease-ms", "5000"],
                       env=env)
    pid = sc.wait_steady()["pid"]
    tables, words = attach_pool(sc)
    with sc.new_client(timeout=90) as client:
        warm = wait_all(submit(client, [WARM]))
        assert ids(warm) == reference[0] and warm[0].cached_tokens == 0   # its pages enter the cache
        streams = submit(client, REQUESTS)
        rids = [s.request_id for s in streams]
        req = tables.requests

        def slots_decoding():
            slots = [np.flatnonzero(req["request_id"] == rid) for rid in rids]
            if any(len(s) == 0 for s in slots):
                return None
            slots = [int(s[0]) for s in slots]        # the execution half is the request's own
            return slots if all(req["exec_request_id"][s] == rid and req["num_generated"][s] >= 2
                                for s, rid in zip(slots, rids)) else None
        slots = wait_until(slots_decoding, 60, what="the eight requests to decode")
        armed.touch()                               # the executor stops at its next publication
        wait_stopped(pid, 60)
        assert (req["num_generated"][slots] < 120).all()             # every one still runs
        lists = np.stack([tables.page_lists[s, :3] for s in slots])
        assert (lists == lists[0]).all()                              # the same three pages
        shared = lists[0].tolist()
        assert ((tables.pages["flags"][shared] & PageFlag.CACHED) != 0).all()
        words[shared[1], 0, 1, 5, 2] ^= np.uint32(1 << 11)            # the second page's values
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)
        results = wait_all(streams)
        assert ids(results) == reference[1]
        assert [r.cached_tokens for r in results] == [48] * 8             # usage's cached_tokens
        rec = sc.status()["recoveries"][-1]
        assert rec["pages_bad"] == 1 and rec["requests_damaged"] == 8 and rec["requests_lost"] == 0
        later = wait_all(submit(client, [LATER]))
        assert ids(later) == reference[2] and later[0].cached_tokens == 48


def test_a_reset_asked_of_a_stopped_executor_is_carried_out_by_its_successor(tiny_model, start_sidecar):
    """POST /reset_prefix_cache's path: the frontend asks in the tables' header and answers once
    the active executor has freed every idle cached page. Asked of an executor that is stopped,
    then SIGKILLed, the reset is its successor's: the reply comes, the idle pages are freed, and
    the next request finds nothing cached."""
    import threading

    from kvhold.protocol.errors import InvalidParams

    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--lease-ms", "5000"])
    pid = sc.wait_steady()["pid"]
    tables, _ = attach_pool(sc)
    with sc.new_client(timeout=90) as client:
        wait_all(submit(client, [WARM]))
        assert sc.status()["pages"]["cached"] >= 3            # the shared prompt's pages, idle
        os.kill(pid, signal.SIGSTOP)
        wait_stopped(pid, 60)
        done = {}
        asker = threading.Thread(target=lambda: done.update(ok=client.reset_prefix_cache()), daemon=True)
        asker.start()
        wait_until(lambda: int(tables.header["prefix_reset_asked"]) == 1, 60, what="the reset to be asked")
        assert int(tables.header["prefix_reset_done"]) == 0 and asker.is_alive()
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)
        asker.join(90)
        assert "ok" in done                                   # answered, by the successor
        assert int(tables.header["prefix_reset_done"]) == 1
        pages = sc.status()["pages"]
        assert pages["cached"] == 0 and pages["committed"] == 0
        later = wait_all(submit(client, [LATER]))
        assert later[0].cached_tokens == 0                    # nothing left to find
        again = wait_all(submit(client, [LATER]))
        assert again[0].cached_tokens == 48 and ids(again) == ids(later)    # the cache fills again
    plain = start_sidecar(["--model", str(tiny_model), *FLAGS, "--no-enable-prefix-caching", "--standbys", "0"])
    plain.wait_steady(standbys=0)
    with plain.new_client(timeout=30) as client:
        with pytest.raises(InvalidParams, match="no prefix cache"):
            client.reset_prefix_cache()
