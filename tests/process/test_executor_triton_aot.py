"""Ahead-of-time Triton kernels (kvhold.executor.cuda.triton_aot) and the shapes they are compiled for
(kvhold.executor.cuda.kernel_shapes), on a machine without a GPU: compiling for sm_90 needs Triton
only; arming the kernels and launching them needs a libcuda, here a stub
(tests/data/triton_aot) that records what reaches the driver. Launch times, results
bit-identical to the JIT's and CUDA graph capture are checked on the GPU by
tools/probe_first_kernels.py."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvhold.executor.cuda.kernel_shapes import KernelShapes
from kvhold.protocol.layout import KvGeometry, TableGeometry
from kvhold.protocol.settings import ExecutorSettings, KernelShapesRequest

SHAPES = dict(dtype="bfloat16", num_layers=3, num_heads=8, num_kv_heads=2, head_dim=64, hidden_size=512,
              intermediate_size=1024, vocab_size=1000, page_tokens=16, num_pages=40, max_seq_len=500,
              max_batch=8, prefill_chunk=64)


def test_kernel_shapes_come_from_the_sidecars_executor_settings(tiny_model):
    from kvhold.protocol.model_spec import ModelSpec

    spec = ModelSpec.from_dir(tiny_model)
    settings = ExecutorSettings(device="cuda:0", model=str(tiny_model), compute_dtype="bfloat16", max_batch=8,
                                max_batch_tokens=256)
    geometry = TableGeometry(KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "bfloat16", 16),
                             num_pages=100, max_seq_len=1000)

    def request(**changes) -> str:
        return KernelShapesRequest(dataclasses.replace(settings, **changes), geometry).to_json()

    shapes = KernelShapes.from_json(request())
    assert (shapes.num_layers, shapes.num_heads, shapes.num_kv_heads, shapes.head_dim) == \
        (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    assert (shapes.max_pages_per_seq, shapes.prefill_chunk, shapes.dtype) == (63, 248, "bfloat16")
    assert shapes.kv_pool_shape == (100, spec.num_layers, 2, 16, spec.num_kv_heads, spec.head_dim)
    assert KernelShapes.from_json(shapes.to_json()) == shapes
    assert KernelShapes.from_json(request(device="cpu")) is None
    assert KernelShapes.from_json(request(model=None)) is None
    with pytest.raises(ValueError):
        KernelShapes(**{**SHAPES, "num_kv_heads": 3})


def test_the_zygote_ignores_bad_kernel_shapes():
    from kvhold.executor.zygote import _kernel_shapes

    assert _kernel_shapes("") is None
    assert _kernel_shapes("{not json") is None
    assert _kernel_shapes(json.dumps({"device": "cuda:0", "model": "/nonexistent"})) is None
    assert _kernel_shapes(json.dumps(SHAPES)) == KernelShapes(**SHAPES)


def test_the_zygote_asks_for_the_gpu_architecture_in_a_child_and_stays_one_thread(monkeypatch):
    """NVML leaves a thread running in the process that initialised it (seen on an H200: the
    zygote had two threads after nvmlInit/nvmlShutdown), so the zygote asks a child."""
    from kvhold.executor.zygote import gpu_arch_in_a_child, threads

    before = threads()
    monkeypatch.setenv("KVHOLD_TRITON_AOT_ARCH", "sm_90")
    assert gpu_arch_in_a_child() == 90
    monkeypatch.setenv("KVHOLD_TRITON_AOT_ARCH", "")
    assert gpu_arch_in_a_child() in (None, *range(10, 200))     # None without NVML
    assert threads() == before


def test_prepare_can_be_switched_off(monkeypatch):
    from kvhold.executor.cuda import triton_aot

    monkeypatch.setenv("KVHOLD_TRITON_AOT", "0")
    assert triton_aot.prepare(KernelShapes(**SHAPES), arch=90) == {"enabled": False,
                                                                   "reason": "KVHOLD_TRITON_AOT=0"}


def test_compiles_the_executor_kernels_for_sm90_without_a_gpu(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    import kvhold.executor.cuda.attention  # noqa: F401  (registers its kernel and warm-up)
    import kvhold.executor.cuda.checksum  # noqa: F401
    from kvhold.executor.cuda import triton_aot

    cuda_before = torch.cuda.is_initialized()      # other GPU tests in this process may have
    compiled = triton_aot.compile_only(KernelShapes(**SHAPES), arch=90)
    attention = compiled["kvhold.executor.cuda.attention._paged_decode_kernel"]
    checksum = compiled["kvhold.executor.cuda.checksum._range_hash_kernel"]
    assert len(attention) == 1 and len(checksum) == 2       # checksum: ranges, and one slot each
    for kernel in attention + checksum:
        assert kernel.metadata.target.arch == 90 and kernel.kernel[:4] == b"\x7fELF"
        assert ".target sm_90a" in kernel.asm["ptx"]
    sig = attention[0].src.signature
    assert sig["q_ptr"] == "*bf16" and sig["scale"] == "fp32" and sig["GROUP"] == "constexpr"
    assert attention[0].src.constants[(sig_index(sig, "GROUP"),)] == 4
    # Triton's binder, not ours, picks the specialization: a page's K (or V) of one layer is
    # 16 tokens x 64 words, one block of 1024, and the JIT makes an int argument of 1 a constant
    assert checksum[0].src.signature["n_blocks"] == "constexpr"
    assert checksum[0].src.signature["row_words"] == "i32"
    assert torch.cuda.is_initialized() == cuda_before        # compiling needs no CUDA context


def test_wide_decode_tiles_compile_for_sm90_without_a_gpu(tmp_path, monkeypatch):
    """KVHOLD_WIDE_DECODE_TILES=1 at --max-batch 256: the decode buckets 128 and 256 compile the
    64-row tile with its row blocks grouped (GROUP_M 4), on wgmma as the 64-row step's tile."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("KVHOLD_WIDE_DECODE_TILES", "1")
    from kvhold.executor.cuda import gemm, triton_aot

    shapes = KernelShapes(**dict(SHAPES, max_batch=256, prefill_chunk=16))
    compiled = triton_aot.compile_only(shapes, arch=90)["kvhold.executor.cuda.gemm._skinny_kernel"]
    def constant(kernel, name):
        return kernel.src.constants.get((sig_index(kernel.src.signature, name),))

    grouped = [k for k in compiled if constant(k, "GROUP_M") == gemm.WIDE_GROUP_M]
    assert grouped and all(constant(k, "BLOCK_M") == gemm.MAX_ROWS for k in grouped)
    assert all("wgmma" in k.asm["ptx"] for k in grouped)


@pytest.mark.parametrize("fp8", ["rows", "128x128"])
def test_compiles_the_fp8_kernel_for_an_fp8_checkpoints_shapes_for_sm90_without_a_gpu(tmp_path, monkeypatch, fp8):
    """An FP8 checkpoint's projections (kvhold.executor.cuda.fp8_gemm: FP8 weights, float32 scales
    per row or per 128x128 block) compile for sm_90 ahead of time, each within the H100's and H200's
    shared memory per block; a bf16 checkpoint's shapes compile none of them."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    import kvhold.executor.cuda.fp8_gemm  # noqa: F401
    from kvhold.executor.cuda import triton_aot

    name = "kvhold.executor.cuda.fp8_gemm._fp8_kernel"
    assert KernelShapes(**SHAPES, fp8=fp8).fp8_scale_block == (None if fp8 == "rows" else (128, 128))
    compiled = triton_aot.compile_only(KernelShapes(**SHAPES, fp8=fp8), arch=90)[name]
    assert compiled and all(k.metadata.target.arch == 90 for k in compiled)
    sig = compiled[0].src.signature
    assert sig["w_ptr"] == "*fp8e4nv" and sig["s_ptr"] == "*fp32" and sig["x_ptr"] == "*bf16"
    # mma.sync tiles (16 and 32 rows a program) on the bf16 kernel's K packing, kWidth 2, never the
    # FP8 load's kWidth 4 (another K order in each k16 step, whose sums differ in last bits from
    # wgmma's, 64+ rows, on the H200: a row's bits then depended on its row count)
    mma_sync = [k for k in compiled if "mma.sync" in k.asm["ptx"]]
    assert mma_sync and all("kWidth = 2" in k.asm["ttgir"] and "kWidth = 4" not in k.asm["ttgir"]
                            for k in mma_sync)
    assert all(k.metadata.shared <= 232448 for k in compiled), [k.metadata.shared for k in compiled]
    assert not triton_aot.compile_only(KernelShapes(**SHAPES), arch=90)[name]
    with pytest.raises(ValueError, match="fp8"):
        KernelShapes(**SHAPES, fp8="128")


def sig_index(signature: dict, name: str) -> int:
    return list(signature).index(name)


DATA = Path(__file__).parents[1] / "data" / "triton_aot"


@pytest.mark.skipif(shutil.which("gcc") is None, reason="builds a stub libcuda and Triton's stubs with gcc")
@pytest.mark.skipif(torch.version.cuda is not None, reason="a CPU build of torch: the stub libcuda would "
                    "confuse a CUDA one (the GPU path is measured by tools/probe_first_kernels.py)")
def test_a_forked_child_launches_the_prepared_kernel_through_the_driver_exactly_as_the_jit_would(tmp_path):
    triton = pytest.importorskip("triton")
    include = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", f"-I{include}",
                    "-o", str(tmp_path / "libcuda.so.1"), str(DATA / "stub_libcuda.c")], check=True)
    env = {**os.environ, "TRITON_LIBCUDA_PATH": str(tmp_path), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "KVHOLD_TRITON_AOT_ARCH": "sm_90", "PYTHONPATH": str(Path(__file__).parents[2])}
    env.pop("KVHOLD_TRITON_AOT", None)
    proc = subprocess.run([sys.executable, str(DATA / "zygote_child.py"), json.dumps(SHAPES)],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {k: v["prepared"] for k, v in out["stats"].items()} == {
        "kvhold.executor.cuda.attention._paged_decode_kernel": 1, "kvhold.executor.cuda.checksum._range_hash_kernel": 2,
        "kvhold.executor.cuda.kernels._rmsnorm_kernel": 1, "kvhold.executor.cuda.kernels._rope_store_kernel": 1,
        # an exact prefill chunk of each launch key (kvhold.executor.cuda.runner.exact_warm_up_rows):
        # the GEMM's row tiles and 16-divisibility, the attention's and its staged rows' alignment;
        # and the logits at each launch key of 2..64 rows (prompt log-prob rows), 5 beyond decode's
        "kvhold.executor.cuda.kernels._silu_mul_kernel": 1, "kvhold.executor.cuda.gemm._skinny_kernel": 20,
        # the decode's layout, and an exact prefill chunk's with its block table aligned or not
        "kvhold.executor.cuda.attention._rope_decode_kernel": 3, "kvhold.executor.cuda.attention._rope_prefill_kernel": 3,
        "kvhold.executor.cuda.checksum._pages_hash_kernel": 1,
        "kvhold.executor.cuda.fp8_gemm._fp8_kernel": 0}      # a bf16 checkpoint: no FP8 projection
    assert out["torch_cuda_initialised"] is False and out["driver_initialised"] is False
    assert out["miss"]["jit_fallbacks"] == 1 and out["miss"]["broken"] is None and out["miss_raised"]
    child = out["child"]
    assert "error" not in child, child
    assert child["stub_launches"] == child["aot_launches"] == 1
    assert child["dims"] == child["want_dims"]            # grid, 32 x num_warps threads, shared memory
    assert (child["stream"], child["function"]) == (0x5157, 0xF00)
    assert child["pointers"] == child["want_pointers"] and child["ints"] == child["want_ints"]
    assert child["scale"] == 0.125 and child["scratch"] == [0, 0]
    # a launch that fails (here: the cubin does not load) is not retried: the JIT takes over
    assert "stub libcuda" in (out["child_failed_load"]["broken"] or "")
    assert out["child_failed_load"]["raised"]
    assert any("wrap the kernel" in e for e in out["second_prepare"]["warm_up_errors"])
    assert out["torch_cuda_initialised_at_end"] is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_a_zygote_child_launches_the_aot_kernels_bit_identical_to_the_jit(tmp_path):
    out_path = tmp_path / "first_kernels.json"
    proc = subprocess.run([sys.executable, "-m", "tools.probe_first_kernels", "--out", str(out_path)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out_path.read_text())
    assert result["aot_prepare"]["enabled"], result["aot_prepare"]
    assert result["cuda_initialised_after_aot_prepare"] is False
    aot = result["aot"]
    assert "error" not in aot, aot["error"]
    for name in ("kvhold.executor.cuda.attention._paged_decode_kernel", "kvhold.executor.cuda.checksum._pages_hash_kernel",
                 "kvhold.executor.cuda.checksum._range_hash_kernel"):
        stats = aot["triton_aot_stats"][name]        # the probe launches these three, twice each
        assert stats["aot_launches"] >= 2 and stats["jit_fallbacks"] == 0 and stats["broken"] is None, (name, stats)
    checks = aot["aot_checks"]
    assert checks["bit_identical_to_jit"] and all(checks["bit_identical_to_jit"].values()), checks
    assert len(checks["same_cubin_as_jit"]) >= 2
    for name, same in checks["same_cubin_as_jit"].items():
        assert isinstance(same, list) and all(same), (name, same)
    assert checks.get("graph_captured_aot_launches") and checks.get("graph_replay_equal"), checks
