"""A lost pool loses no stream, with real processes: the sidecar and every executor are
SIGKILLed together mid-stream (nothing is left to hand the pool back), the next sidecar of the
instance builds a fresh pool and re-runs the requests from their durable records, and each
client, which holds more tokens than those records, continues from its own index: the texts
are those of an uninterrupted run, nothing streamed twice, nothing missing."""
import os
import signal

import pytest

from kvhold.client.client import wait_all
from kvhold.testing.sidecar_process import SidecarProcess, submit_requests
from tests.process.helpers import READOPT_FLAGS, READOPT_REQUESTS, alive, wait_until

pytestmark = pytest.mark.slow     # two sidecars and a long workload: `pytest -m slow` (CI runs it)


def test_requests_rerun_after_the_pool_is_lost_continue_from_their_clients_index(tiny_model, runtime_root,
                                                                                  tmp_path):
    flags = ["--model", str(tiny_model), *READOPT_FLAGS, "--journal-dir", str(tmp_path / "journal")]
    first = SidecarProcess(flags, runtime_root=runtime_root, log_path=tmp_path / "first.log").start()
    second = None
    try:
        first.wait_steady(standbys=1)
        with first.new_client(timeout=60) as c:
            uninterrupted = wait_all(submit_requests(c, READOPT_REQUESTS))
        client = first.new_client(timeout=60)
        streams = submit_requests(client, READOPT_REQUESTS)
        received = [0] * len(streams)
        for k, s in enumerate(streams):           # every client holds tokens the records do not
            while received[k] < 8:
                received[k] = next(s).index + 1
        pids = [e["pid"] for e in first.status()["executors"]]
        os.killpg(first.proc.pid, signal.SIGKILL)  # the sidecar and its executors at once
        first.proc.wait()
        wait_until(lambda: not any(alive(p) for p in pids), what="the executors to be gone")

        second = SidecarProcess(flags, instance=first.instance, runtime_root=runtime_root,
                                log_path=tmp_path / "second.log").start()
        results = wait_all(streams)
        status = second.status()["pool_restart"]["restore"]
        assert status["requests_restored"] == len(READOPT_REQUESTS)     # re-run from the records
        assert [r.token_ids for r in results] == [r.token_ids for r in uninterrupted]
        assert [r.text for r in results] == [r.text for r in uninterrupted]
        client.close()
    finally:
        if second is not None:
            second.stop()
        first.stop(signal.SIGKILL)
