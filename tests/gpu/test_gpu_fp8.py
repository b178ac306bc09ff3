"""FP8 checkpoints on the GPU: the fused layers' two FP8 paths against the CPU reference.

The CPU engine (float64, each FP8 weight dequantized on use) equals a float64 forward of the
dequantized model (tests/unit/test_fp8_checkpoints.py). On the GPU, in bfloat16:

* the default path (each FP8 weight dequantized in registers by kvhold.executor.cuda.fp8_gemm,
  a row's bits the same at every row count, which a test here checks from 1 to 600 rows, and
  within bf16 rounding of dequantizing to bf16 first; dequantized per call where the kernel
  cannot take the weight) agrees with the reference within bf16's tolerance, graphs and eager
  alike, and keeps decode batch-invariant, so exact prefill applies; a real sidecar serving an
  FP8 checkpoint continues each stream token for token across executor SIGKILLs;
* KVHOLD_FP8_SCALED_MM=1 (torch._scaled_mm, activations quantized per row) agrees within FP8
  activation error, and exact prefill is refused with its reason.
"""
import pytest
import torch

from tests.gpu.helpers import plan as _plan

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

QUANTS = ("fp8-dynamic", "fp8-tensor", "fp8-block")


def _run(runner):
    a, b = list(range(3, 40)), list(range(100, 120))
    out1 = runner.run(_plan([(a, 0, 32, [1, 2]), (b, 0, 20, [5, 6])]))            # prefill chunks
    out2 = runner.run(_plan([(a, 32, 5, [1, 2, 3])]))                           # the rest of a
    out3 = runner.run(_plan([(a + [7], 37, 1, [1, 2, 3]), (b + [9], 20, 1, [5, 6])]))  # decode
    return torch.cat([out1, out2, out3])


def _models(quant, tmp_path):
    from safetensors.torch import load_file

    from kvhold.executor.kv_cache import KvCache
    from kvhold.executor.llama import LlamaModel
    from kvhold.executor.step_runner import CpuRunner
    from kvhold.protocol.layout import KvGeometry
    from kvhold.protocol.model_spec import ModelSpec
    from kvhold.testing.make_model import build
    from tools.bench_engine_setup import load_weights

    path = build(tmp_path / quant, "tiny", quant=quant, overrides={"torch_dtype": "bfloat16"}, progress=False)
    spec = ModelSpec.from_dir(path)
    gpu = LlamaModel(spec, load_weights(path, "cuda"), torch.bfloat16, torch.device("cuda"), 512)
    cpu = LlamaModel(spec, load_file(str(path / "model.safetensors")), torch.float64, torch.device("cpu"), 512)
    want = _run(CpuRunner(cpu, KvCache.private(
        KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float64", 16), 16))).cuda()
    return spec, gpu, want


def _gpu_logits(spec, model, graph):
    from kvhold.executor.cuda.runner import CudaRunner
    from kvhold.executor.kv_cache import KvCache
    from kvhold.protocol.layout import KvGeometry

    kv = KvCache.private(KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "bfloat16", 16), 16, "cuda")
    runner = CudaRunner(model, kv, max_batch=8, prefill_chunk=32, max_pages_per_seq=8, use_graph=graph)
    runner.prepare()
    return _run(runner)


@pytest.mark.parametrize("quant", QUANTS)
def test_dequantized_fp8_on_the_gpu_matches_the_cpu_reference_and_stays_batch_invariant(quant, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.delenv("KVHOLD_FP8_SCALED_MM", raising=False)
    spec, gpu, want = _models(quant, tmp_path)
    assert gpu.fp8 and gpu.fused is not None and gpu.fused.fused_gemms
    # the FP8 kernel takes o_proj, gate|up and down_proj of every layer (q|k|v too but for
    # block scales: the tiny model's k and v have 64 rows, half a 128-row scale block)
    for _, qkv, o, _, gate_up, down in gpu.fused.layers_w:
        assert all(p.fp8 is not None for p in (o, gate_up, down))
        assert (qkv.fp8 is None) == (quant == "fp8-block")
    assert gpu.fused.batch_invariant(8) and gpu.fused.exact_prefill(8) is None
    graph, eager = _gpu_logits(spec, gpu, True), _gpu_logits(spec, gpu, False)
    assert torch.equal(graph, eager)
    got = graph.double()
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err < 0.05 * max(1.0, scale), (quant, err, scale)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("quant", ("fp8-dynamic", "fp8-tensor"))
def test_scaled_mm_fp8_on_the_gpu_is_near_the_reference_and_refuses_exact_prefill(quant, tmp_path, monkeypatch):
    monkeypatch.setenv("KVHOLD_FP8_SCALED_MM", "1")
    spec, gpu, want = _models(quant, tmp_path)
    assert not gpu.fused.batch_invariant(8)
    assert "KVHOLD_FP8_SCALED_MM" in gpu.fused.exact_prefill(8)
    got = _gpu_logits(spec, gpu, True).double()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 0.1, (quant, rel)
    print(f"{quant} scaled_mm: relative error {rel:.3e} against the float64 reference")


@pytest.mark.parametrize("strategy", ("rows", "block"))
def test_the_fp8_kernel_gives_a_row_the_same_bits_at_every_row_count_and_is_near_the_dequantized_path(strategy):
    """fp8_linear(x, w, scales): a row's bits are the same at every row count, on the decode tiles
    (1..64 rows), at the decode buckets past them and in exact prefill chunks of any size (600 rows
    here), with and without a residual, at shapes whose N is not a multiple of the tile; and the
    result is within bf16 rounding of the dequantizing path (exact_linear on the dequantized weight)."""
    from kvhold.executor.cuda import fp8_gemm, gemm
    from kvhold.executor.cuda.fp8_gemm import fp8_linear
    from kvhold.executor.fp8 import Fp8Weight

    torch.manual_seed(0)
    for n, k in ((1536, 512), (1000, 1024), (512, 1536)):
        w = (torch.randn(n, k, device="cuda") * 0.3).to(torch.float8_e4m3fn)
        if strategy == "block":
            block = (128, 128)
            scale = torch.rand(-(-n // 128), k // 128, device="cuda") * 0.02 + 0.001
            fw = Fp8Weight("w", w, scale, "block", block)
        else:
            block = None
            scale = torch.rand(n, 1, device="cuda") * 0.02 + 0.001
            fw = Fp8Weight("w", w, scale, "channel")
            scale = fw.row_scales().reshape(-1)
        dense = fw.dequantize(torch.bfloat16)
        x = torch.randn(600, k, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(600, n, device="cuda", dtype=torch.bfloat16)
        full = fp8_linear(x, w, scale, block)
        full_res = fp8_linear(x, w, scale, block, residual=res.clone(), out=res.clone())
        want = gemm.exact_linear(x, dense).float()
        err = (full.float() - want).abs().max().item()
        assert err <= 0.02 * want.abs().max().item(), (n, k, err)
        print(f"{strategy} {n}x{k}: {(full.float() != want).float().mean().item():.2%} of elements differ from "
              f"the dequantizing path, by at most {err:.3g}")
        for rows in (1, 2, 7, 16, 17, 31, 32, 33, 48, 64, 65, 100, 128, 200, 256, 300):
            xs = x[:rows]
            assert fp8_gemm.applies(xs, n, k, block)
            assert torch.equal(fp8_linear(xs, w, scale, block), full[:rows]), (n, k, rows)
            h = res[:rows].clone()
            assert torch.equal(fp8_linear(xs, w, scale, block, residual=h, out=h), full_res[:rows]), \
                (n, k, rows)


@pytest.mark.parametrize("quant", ("fp8-dynamic", "fp8-block"))
def test_an_fp8_checkpoint_served_on_the_gpu_continues_token_for_token_across_sigkills(quant, tmp_path):
    """A real sidecar serving an FP8 checkpoint on CUDA (bf16 compute, the weights FP8 in the
    region, projections on the in-register kernel, exact prefill on): six greedy streams, and the
    active executor SIGKILLed mid-stream twice; the standby that maps the same FP8 bytes continues
    each stream to the uninterrupted run's tokens."""
    from kvhold.client.client import wait_all
    from kvhold.testing.make_model import build
    from kvhold.testing.sidecar_process import SidecarProcess
    from tests.gpu.helpers import kill_active_at

    model = build(tmp_path / quant, "tiny", quant=quant, overrides={"torch_dtype": "bfloat16"}, progress=False)
    requests = [dict(prompt_ids=[1 + i, 37, 250, 11 * i + 2, 402, 98, 7, 301] * (2 + 5 * i), max_tokens=150,
                     temperature=0.0, ignore_eos=True) for i in range(6)]
    flags = ["--model", str(model), "--device", "cuda:0", "--backend", "cuda", "--compute-dtype", "bfloat16",
             "--max-seq-len", "512", "--log-level", "INFO", "--restart-backoff-ms", "0,0"]
    with SidecarProcess(flags, log_path=tmp_path / "sidecar.log") as sc:
        sc.wait_steady(timeout=600)
        with sc.new_client(timeout=300) as client:
            want = [r.token_ids for r in wait_all([client.generate(**r) for r in requests])]
            assert all(len(t) == 150 for t in want) and len({tuple(t) for t in want}) > 1
            for threshold in (40, 400):
                sc.wait_steady(timeout=600)
                got = [r.token_ids for r in wait_all([client.generate(**r) for r in requests],
                                                     kill_active_at(sc, threshold))]
                assert got == want, threshold
        recoveries = sc.status()["recoveries"]
    assert len(recoveries) == 2 and all(r["requests_lost"] + r["requests_damaged"] == 0 for r in recoveries)
