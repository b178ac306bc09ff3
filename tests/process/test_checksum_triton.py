"""The Triton checksum kernels (kvhold.executor.cuda.checksum) against TorchChecksum and the
numpy reference, bit for bit, on a machine without a GPU: Triton's interpreter runs them on CPU
tensors (TRITON_INTERPRET=1, in a child process, since it must be set before the kernels are
defined). On the GPU, tests/gpu/test_gpu.py checks the compiled kernels the same way."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "data" / "checksum" / "triton_interpret.py"


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_triton_kernels_equal_torch_and_the_reference(interpreted):
    assert len(interpreted["cases"]) == 6
    for case in interpreted["cases"]:
        triton_pages, torch_pages, ref_pages = case["pages"]
        assert triton_pages == torch_pages == ref_pages, case
        triton_ranges, torch_ranges, ref_ranges = case["ranges"]
        assert triton_ranges == torch_ranges == ref_ranges, case
        slots64, slots32, torch_slots, ref_slots = case["slots"]
        assert slots64 == slots32 == torch_slots == ref_slots, case
    # the cases cover a slot wider than a block and one a single 64-bit word wide
    assert max(c["n_blocks"] for c in interpreted["cases"]) >= 2
    assert min(c["row_words"] for c in interpreted["cases"]) == 1


def test_triton_catches_flips_in_committed_rows_only(interpreted):
    for case in interpreted["cases"]:
        for committed, pages_changed, ranges_changed in case["flips"]:
            assert pages_changed == ranges_changed == committed, case["flips"]


def test_triton_refuses_rows_that_are_not_whole_64_bit_words(interpreted):
    assert "whole number of 64-bit words" in interpreted["refused"]
