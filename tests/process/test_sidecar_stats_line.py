"""The sidecar's periodic stats line, from a real sidecar serving real requests."""
import re
import time

import pytest

from kvhold.testing.sidecar_process import SidecarProcess


@pytest.mark.slow
def test_a_busy_sidecar_logs_throughput_running_waiting_and_kv_use(tiny_model, tmp_path):
    log = tmp_path / "sidecar.log"
    with SidecarProcess(["--model", str(tiny_model), "--max-seq-len", "256", "--standbys", "0",
                         "--stats-interval", "1"], log_path=log) as sc:
        sc.wait_steady(standbys=0)
        with sc.new_client(timeout=60) as client:
            streams = [client.generate(prompt_ids=[5, 6, 7 + i], max_tokens=120, temperature=0.0,
                                       ignore_eos=True) for i in range(3)]
            for s in streams:
                assert s.result().completion_tokens == 120
            # an interval may hold only the first prefill, and the one with the generated tokens
            # may end after the streams: its line comes then, while the sidecar runs
            deadline = time.monotonic() + 60
            while not any(float(m.group(2)) > 0 for m in _stats(log)) and time.monotonic() < deadline:
                time.sleep(0.2)
    found = _stats(log)
    assert found, log.read_text()[-2000:]
    # (a line can come after the streams ended: running and waiting 0; the unit test checks them)
    assert any(float(m.group(2)) > 0 for m in found), [m.group(0) for m in found]
    assert all(int(m.group(6)) >= 1 for m in found)


def _stats(log) -> list[re.Match]:
    """The stats lines logged so far, parsed; a line that names generation throughput and does not
    parse fails the test."""
    lines = [line for line in log.read_text().splitlines() if "generation throughput" in line]
    found = [re.search(r"prompt throughput ([\d.]+) tokens/s, generation throughput ([\d.]+) tokens/s, "
                       r"running (\d+), waiting (\d+), KV pages (\d+)/(\d+)", line) for line in lines]
    assert all(found), lines
    return found
