"""A SIGKILLed sidecar loses no memory: its executors outlive it, a restarted sidecar of the
instance re-adopts the tables, regions, executors and in-flight requests, and the streams
finish as an uninterrupted run would, with nothing recomputed and the weights not reloaded.
Real processes, real signals, real shared memory."""
import os
import signal
import time

import pytest

from kvhold.client.client import wait_all
from kvhold.testing.sidecar_process import SidecarProcess, submit_requests
from tests.process.helpers import sidecar_log, wait_until

pytestmark = pytest.mark.slow

FLAGS = ["--kv-pages", "256", "--max-seq-len", "512", "--max-batch-tokens", "64", "--max-batch", "16",
         "--standbys", "1", "--log-level", "INFO"]
REQUESTS = [   # long enough to be mid-stream at the kill; greedy and seeded sampling
    dict(prompt="The sidecar keeps the memory", max_tokens=300, temperature=0.0, ignore_eos=True),
    dict(prompt="Once upon a time", max_tokens=320, temperature=0.0, ignore_eos=True),
    dict(prompt_ids=list(range(2, 90)), max_tokens=280, temperature=0.9, seed=3, ignore_eos=True),
]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] != "Z"


def roles(status) -> dict[int, str]:
    return {e["pid"]: e["role"] for e in status["executors"]}


def start(flags, runtime_root, log_path, instance=None) -> SidecarProcess:
    return SidecarProcess(flags, instance=instance, runtime_root=runtime_root, log_path=log_path).start()


def test_sigkilled_sidecar_is_readopted_with_its_executors_and_streams(tiny_model, runtime_root, tmp_path):
    flags = ["--model", str(tiny_model), *FLAGS, "--journal-dir", str(tmp_path / "journal")]
    first = start(flags, runtime_root, tmp_path / "first.log")
    second = None
    try:
        client = first.new_client(timeout=60)
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
        assert status["generation"] == generation                # the same pool, not a new one
        assert status["adoption"]["previous_pid"] == first.proc.pid
        assert sorted(e["pid"] for e in status["adoption"]["executors"]) == sorted(before)
        assert status["pool_restart"]["restore"]["requests_adopted"] == len(REQUESTS)
        assert status["pool_restart"]["restore"]["requests_restored"] == 0

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
        streams = submit_requests(second.new_client(timeout=60), REQUESTS)
        for s in streams:
            next(s)
        os.kill(active, signal.SIGKILL)
        results = wait_all(streams)
        assert [r.token_ids for r in results] == reference
        after = second.wait_steady(standbys=1)
        assert after["pid"] == standby
        assert len(second.status()["recoveries"]) == 1
    finally:
        if second is not None:
            second.stop()
        first.stop(signal.SIGKILL)      # whatever is left of its process group

