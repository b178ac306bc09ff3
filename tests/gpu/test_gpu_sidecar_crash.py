"""A SIGKILLed sidecar on CUDA VMM memory: its executors hand the region descriptors back to
the restarted sidecar, which re-adopts the pool mid-stream. Real processes, real signals,
real device memory (skipped without a CUDA GPU)."""
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REQUESTS = [dict(prompt_ids=list(range(2, 2 + 16 * (i + 1))), max_tokens=420,
                 temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True) for i in range(4)]


def _roles(status) -> dict[int, str]:
    return {e["pid"]: e["role"] for e in status["executors"]}


def _compute_pids() -> set[int] | None:
    """The pids nvidia-smi lists with a CUDA context, or None if it cannot say."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return {int(x) for x in out.stdout.split() if x.strip().isdigit()}


@pytest.fixture
def short_root():
    root = Path(tempfile.mkdtemp(prefix="kvh-", dir="/tmp"))   # unix socket paths are short
    os.chmod(root, 0o700)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_sigkilled_sidecar_on_vmm_memory_is_readopted_mid_stream_from_handed_back_descriptors(
        tiny_model, tmp_path, short_root):
    from kvhold.client.client import wait_all
    from kvhold.testing.sidecar_process import SidecarProcess, submit_requests
    from tests.process.helpers import wait_until

    flags = ["--model", str(tiny_model), "--device", "cuda:0", "--backend", "cuda",
             "--max-seq-len", "512", "--max-batch", "16", "--max-batch-tokens", "256",
             "--prefill-chunk", "64", "--standbys", "1", "--log-level", "INFO",
             "--restart-backoff-ms", "0,0", "--journal-dir", str(tmp_path / "journal")]
    first = SidecarProcess(flags, runtime_root=short_root, log_path=tmp_path / "first.log").start(timeout=300)
    second, clients = None, contextlib.ExitStack()
    try:
        first.wait_steady(standbys=1, timeout=600)
        client = clients.enter_context(first.new_client(timeout=120))
        reference = [r.token_ids for r in wait_all(submit_requests(client, REQUESTS))]

        first.wait_steady(standbys=1, timeout=600)
        streams = submit_requests(client, REQUESTS)
        for s in streams:                          # every request is streaming at the kill
            next(s)
        status = first.status()
        before, generation = _roles(status), status["generation"]
        active = next(p for p, r in before.items() if r == "active")
        standby = next(p for p, r in before.items() if r == "standby")
        os.kill(first.proc.pid, signal.SIGKILL)    # the sidecar alone: its executors live on
        first.proc.wait()
        time.sleep(0.3)
        assert all(os.path.exists(f"/proc/{p}") for p in before)   # they outlive it, waiting

        second = SidecarProcess(flags, instance=first.instance, runtime_root=short_root,
                                log_path=tmp_path / "second.log").start(timeout=300)
        wait_until(lambda: {active, standby} <= {e["pid"] for e in second.events("attach")},
                   timeout_s=60, what="both executors to attach again")
        st = second.status()
        hand_back = st["adoption"]["hand_back"]
        assert hand_back["backend"] == "cuda" and hand_back["pid"] in before
        assert set(hand_back["regions"]) == {"kv", "weights"}
        assert all(r["check"].startswith("imported") for r in hand_back["regions"].values())
        assert _roles(st) == before and st["generation"] == generation
        assert {e["via"] for e in st["executors"]} == {"readopted"}

        results = wait_all(streams)
        assert [r.token_ids for r in results] == reference           # as an uninterrupted run
        assert [r.recomputed_tokens for r in results] == [0] * len(REQUESTS)
        st = second.status()
        assert st["pool_restart"]["restore"]["requests_adopted"] >= 1
        assert not second.events("spawn")                            # the same executors
        assert st["weights"]["state"] == "sealed" and st["weights"]["load_ms"] is None
        assert st["recoveries"] == []
        with_context = _compute_pids()
        if with_context and active in with_context:   # nvidia-smi sees this pid namespace
            assert second.proc.pid not in with_context                 # the sidecar made no context

        # a new executor maps the taken-back memory: the standby takes over from a killed active,
        # and the replacement standby imports a dup of the descriptor the sidecar took back
        client = clients.enter_context(second.new_client(timeout=120))
        streams = submit_requests(client, REQUESTS)
        for s in streams:
            next(s)
        os.kill(active, signal.SIGKILL)
        results = wait_all(streams)
        assert [r.token_ids for r in results] == reference
        after = second.wait_steady(standbys=1, timeout=600)
        assert after["pid"] == standby and second.events("spawn")
        (recovery,) = second.status()["recoveries"]
        assert recovery["requests_lost"] == 0
        fresh = next(e["pid"] for e in second.status()["executors"] if e["pid"] not in before)
        with second.new_client(timeout=120) as c:      # and it serves from that memory once active
            os.kill(standby, signal.SIGKILL)
            assert [r.token_ids for r in wait_all(submit_requests(c, REQUESTS))] == reference
        wait_until(lambda: second.wait_steady(standbys=0, timeout=600)["pid"] == fresh, timeout_s=60,
                   what="the new executor to become active")
    finally:
        clients.close()
        if second is not None:
            second.stop()
        first.stop(signal.SIGKILL)
