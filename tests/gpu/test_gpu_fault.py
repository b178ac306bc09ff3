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
    for t in result["trials"]:
        assert t["fault_pid"] == t["victim_pid"]
        assert t["fence_reason"] == "cuda_fault"          # it said so itself; not a timeout, not a lease
        assert t["fault_queued_to_fenced_ms"] < 2000
        assert t["pages_bad"] >= 1 and t["requests_damaged"] >= 1    # the scribbled pages were caught
        assert t["requests_lost"] == 0 and t["identical"], t
    # The driver's Xid for the fault, if one arrives, is attributed to the dead executor.
    restarts = [a for a in result["health_actions_taken"] if a.get("action") == "restart_executor"]
    assert not restarts, result["health_actions_taken"]
    assert run.returncode == 0
