"""Helpers shared by the process tests: the recovery workload (flags, requests, how to
submit them and compare outputs), a bounded poll, a free port and a sidecar's log."""
from __future__ import annotations

import time
from pathlib import Path

from kvhold.testing.etcd_process import free_port  # noqa: F401 (re-exported for the tests)
from kvhold.testing.sidecar_process import SidecarProcess, submit_requests

DATA = Path(__file__).resolve().parents[1] / "data"     # tests/data: recordings, AOT fixtures

FLAGS = ["--kv-pages", "256", "--max-seq-len", "512", "--max-batch-tokens", "64", "--max-batch", "16",
         "--log-level", "INFO"]
LONG_PROMPT = list(range(2, 202))       # 200 tokens: a prefill of several 64-token chunks
REQUESTS = [
    dict(prompt="The sidecar keeps the memory", max_tokens=40, temperature=0.0),
    dict(prompt="Once upon a time", max_tokens=40, temperature=0.8, seed=7),
    dict(prompt_ids=LONG_PROMPT, max_tokens=30, temperature=1.0, top_p=0.9, seed=3),
    dict(prompt="One two three four", max_tokens=40, temperature=0.7, top_k=20, seed=11),
    dict(prompt="Never lose a stream", max_tokens=35, temperature=1.1, seed=5),
]


def submit(client, requests=REQUESTS):
    return submit_requests(client, requests)


def ids(results):
    return [r.token_ids for r in results]


def run_with_fault(start_sidecar, flags, tmp_path: Path, fault: str, requests=REQUESTS, outcome=ids):
    """`requests` on a sidecar started with `flags` whose executor dies once at `fault` (a
    kvhold.executor.faults spec): (`outcome` of their results, the sidecar's recoveries)."""
    from kvhold.client.client import wait_all

    env = {"KVHOLD_FAULT": fault, "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")}
    sc = start_sidecar(list(flags), env=env)
    sc.wait_steady()
    with sc.new_client(timeout=60) as client:
        got = outcome(wait_all(submit(client, requests)))
    assert (tmp_path / "fired").exists()
    return got, sc.status()["recoveries"]


def wait_until(cond, timeout_s: float = 10.0, interval_s: float = 0.01, what: str = "condition"):
    """Poll `cond()` until it returns something truthy (returned), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(interval_s)
    return value


def wait_stopped(pid: int, timeout_s: float = 20.0) -> None:
    """Until `pid` is in the stopped state (after SIGSTOP), as /proc shows it."""
    wait_until(lambda: open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] == "T",
               timeout_s, what=f"pid {pid} to stop")


def sidecar_log(sc: SidecarProcess) -> str:
    return sc.log_path.read_text() if sc.log_path and sc.log_path.exists() else ""
