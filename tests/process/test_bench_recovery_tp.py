"""The tensor-parallel recovery benchmark runs end to end: one kill, 0 lost, identical outputs."""
import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_recovery_tp_one_kill(tiny_model, tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "tools.bench_recovery_tp", "--model", str(tiny_model),
                           "--kills", "1", "--requests", "2", "--max-tokens", "60", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["takeovers"] == 1 and r["lost_tokens"] == 0 and r["identical_to_uninterrupted_tp"]
    assert r["kill_to_first_resumed_token_ms"]["p50"] > 0


@pytest.mark.slow
def test_bench_recovery_tp_through_the_sidecar_one_kill(tiny_model, tmp_path):
    out = tmp_path / "s.json"
    proc = subprocess.run([sys.executable, "-m", "tools.bench_recovery_tp", "--sidecar", "--model", str(tiny_model),
                           "--kills", "1", "--requests", "2", "--max-tokens", "60", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert len(r["kills"]) == 1 and r["requests_lost"] == 0 and r["identical_to_uninterrupted_tp1"]
    assert r["kill_to_first_resumed_token_ms"]["p50"] > 0
