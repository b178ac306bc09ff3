"""tools/bench_soak.py end to end, briefly: a real `kvhold serve`, streaming HTTP clients, three faults."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_soak_smoke_three_faults(tiny_model, tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "tools.bench_soak", "--model", str(tiny_model), "--faults", "3",
           "--max-seconds", "150", "--clients", "4", "--requests", "8", "--max-tokens", "24",
           "--chunks-between", "8", "--plans", "sigkill_with_standby,sigkill_during_takeover",
           "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert proc.returncode == 0, (proc.stderr[-3000:], {k: result.get(k) for k in ("soak", "requests")})
    summary = {k: result.get(k) for k in ("soak", "requests", "reference")}
    assert result["soak"]["faults"] >= 3 and result["soak"]["stopped_by"] == "faults", summary
    assert result["soak"]["faults"] == sum(result["soak"]["faults_by_kind"].values())
    assert result["soak"]["signalled_without_fence"] == []
    req = result["requests"]
    assert req["requests"] > 0 and req["lost"] == req["errored"] == req["differing"] == 0
    assert req["identical"] == req["completed"] == req["requests"]
    for when in ("resources_before", "resources_after"):
        assert result[when]["sidecar"]["open_fds"] > 0 and result[when]["shm_segments"] == 3
    assert result["shm_segments_after_stop"] == [] and result["serve_exit_code"] == 0
    assert result["command"].startswith("python -m tools.bench_soak") and result["commit"]


@pytest.mark.slow
def test_soak_smoke_owner_faults(tiny_model, tmp_path):
    """A SIGKILL of the memory owner, of the frontend and of the spare, and a pool restart,
    between executor faults: each observed, no request lost or differing."""
    out = tmp_path / "soak.json"
    plans = "sidecar_sigkill,sigkill_with_standby,frontend_sigkill,pool_restart,spare_sigkill"
    cmd = [sys.executable, "-m", "tools.bench_soak", "--model", str(tiny_model), "--faults", "5",
           "--max-seconds", "240", "--clients", "4", "--requests", "8", "--max-tokens", "24",
           "--chunks-between", "8", "--plans", plans, "--owner-uptime", "0", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    summary = {k: result.get(k) for k in ("soak", "requests")}
    assert proc.returncode == 0, (proc.stderr[-3000:], summary)
    assert result["soak"]["stopped_by"] == "faults", summary
    owner = result["soak"]["owner_faults"]
    assert all(owner[p]["observed"] == owner[p]["planned"] >= 1
               for p in ("sidecar_sigkill", "frontend_sigkill", "pool_restart")), owner
    assert result["soak"]["faults"] == sum(result["soak"]["faults_by_kind"].values()) >= 5
    req = result["requests"]
    assert req["requests"] > 0 and req["lost"] == req["errored"] == req["differing"] == 0, req
    assert result["shm_segments_after_stop"] == [] and result["serve_exit_code"] == 0
