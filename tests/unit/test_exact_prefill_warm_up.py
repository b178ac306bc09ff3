"""A standby's exact-prefill warm-up launches every compiled kernel a chunk can: a kernel first
launched in a serving step compiles there for about a second, longer than the lease, and the
executor is fenced as a hang (kvhold.executor.cuda_runner.exact_warm_up_rows)."""
import pytest

pytest.importorskip("triton")

from kvhold.executor import cuda_gemm  # noqa: E402
from kvhold.executor.cuda_attention import prefill_launch_key  # noqa: E402
from kvhold.executor.cuda_runner import exact_warm_up_rows  # noqa: E402

LLAMA_8B = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
TINY = ((96, 64), (64, 64), (256, 64), (64, 128))


def _key(shapes, m):
    return tuple(cuda_gemm.exact_launch_key(n, k, m) for n, k in shapes), prefill_launch_key(m)


@pytest.mark.parametrize("shapes", [LLAMA_8B, TINY])
@pytest.mark.parametrize("chunk", [2048, 512, 248, 64, 17, 2])
def test_every_chunk_size_launches_only_kernels_the_warm_up_launched(shapes, chunk):
    rows = exact_warm_up_rows(chunk, shapes)
    warmed = {_key(shapes, m) for m in rows}
    assert all(2 <= m <= chunk for m in rows)
    assert len(warmed) == len(rows)                     # one chunk per combination of kernels
    missing = [m for m in range(2, chunk + 1) if _key(shapes, m) not in warmed]
    assert not missing, missing[:10]


def test_the_kinds_of_chunk_a_hand_picked_list_missed_are_warmed():
    rows = exact_warm_up_rows(2048, LLAMA_8B)
    assert rows[:3] == [2048, 2047, 2044]               # a full chunk, and the two kinds of shorter one
    warmed = {_key(LLAMA_8B, m) for m in rows}
    # 48 rows: the decode tiles of 64 rows at a multiple of 16; 1000 rows: not a multiple of 16,
    # its staged rows 16-byte aligned
    for m in (48, 32, 16, 1000, 20):
        assert _key(LLAMA_8B, m) in warmed, m
    for m in (48, 32, 16):
        assert _key(LLAMA_8B, m) not in {_key(LLAMA_8B, n) for n in (2048, 2047, 40, 17, 5)}
