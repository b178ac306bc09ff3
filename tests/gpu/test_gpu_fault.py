"""A real CUDA fault in the active executor: illegal address after corrupting sealed KV pages."""
import json
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_an_illegal_address_fault_is_fenced_at_once_its_damage_recomputed_and_nothing_lost(tiny_model, tmp_path):
    out = tmp_path / "fault.json"
    run = subprocess.run([sys.executable, "-m", "tools.probe_cuda_fault", "--model", str(tiny_model),
                          "--trials", "2", "--requests", "6", "--max-tokens", "48", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    victims = set()
    for t in result["trials"]:
        assert t["fault_pid"] == t["victim_pid"]
        victims.add(t["victim_pid"])
        # Fenced by its own report, its exit, or the driver's Xid: never by the lease timing out.
        assert t["fence_reason"] in ("cuda_fault", "died", "health"), t
        assert t["fault_queued_to_fenced_ms"] < 2000
        assert t["pages_bad"] >= 1 and t["kv_damaged"] >= 1    # the scribbled pages were caught
        assert t["kv_resumable"] >= 1                         # and only those requests recompute
        assert t["streams_failed"] == 0 and t["identical"], t
    # A restart the driver's Xid asked for hit the faulting executor, never a healthy successor.
    restarted = {a.get("executor_pid") for a in result["health_actions_taken"] if a.get("action") == "restart_executor"}
    assert restarted <= victims, result["health_actions_taken"]
    assert run.returncode == 0
