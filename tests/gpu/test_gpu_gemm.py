"""GPU tests of the small-batch GEMM kernel and the decode buckets built on it (skipped on CPU)."""
import pytest
import torch
import torch.nn.functional as F

from tests.gpu.helpers import plan as _plan

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1000, 384)])
@pytest.mark.parametrize("residual", [False, True])
def test_a_row_comes_out_bit_identical_at_every_row_count_and_close_to_cublas(n, k, residual):
    from kvhold.executor.cuda import gemm as cuda_gemm

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn((64, k), generator=gen, device="cuda", dtype=torch.bfloat16)
    w = torch.randn((n, k), generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
    h = torch.randn((64, n), generator=gen, device="cuda", dtype=torch.bfloat16)

    def run(m):
        if residual:
            out = h[:m].clone()
            return cuda_gemm.skinny(x[:m], w, residual=out, out=out)
        return cuda_gemm.skinny(x[:m], w)

    assert cuda_gemm.applies(x, w)
    full = run(64)
    for m in (1, 8, 16, 17, 32, 40):
        assert torch.equal(run(m), full[:m]), m
    want = h.float() + F.linear(x, w).float() if residual else F.linear(x, w).float()
    torch.testing.assert_close(full.float(), want, atol=0.05, rtol=0.02)


def _bf16_region(weights):
    """The tensors converted to bf16 in one buffer, in the same order: adjacent stays adjacent."""
    buf = torch.empty(sum(t.numel() for t in weights.values()), dtype=torch.bfloat16, device="cuda")
    out, offset = {}, 0
    for name, t in weights.items():
        out[name] = buf[offset:offset + t.numel()].view(t.shape)
        out[name].copy_(t)
        offset += t.numel()
    return out


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1000, 384)])
def test_wide_decode_tiles_give_a_row_the_bits_of_the_64_row_tile_and_of_the_prefill_tiles(n, k, monkeypatch):
    """KVHOLD_WIDE_DECODE_TILES=1: 65..256 rows on the 64-row decode tile over row blocks give each
    row the bits it has at 64 rows, and those the prefill tiles give it with the variable at 0."""
    from kvhold.executor.cuda import gemm as cuda_gemm

    gen = torch.Generator(device="cuda").manual_seed(n - k)
    x = torch.randn((256, k), generator=gen, device="cuda", dtype=torch.bfloat16)
    w = torch.randn((n, k), generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
    h = torch.randn((256, n), generator=gen, device="cuda", dtype=torch.bfloat16)

    def run(m):
        out = h[:m].clone()
        return cuda_gemm.exact_linear(x[:m], w, residual=out, out=out)

    monkeypatch.setenv("KVHOLD_WIDE_DECODE_TILES", "0")
    prefill_tiles = run(256)
    monkeypatch.setenv("KVHOLD_WIDE_DECODE_TILES", "1")
    at_64 = run(64)
    for m in (65, 96, 100, 128, 200, 256):
        got = run(m)
        assert torch.equal(got[:64], at_64), m
        assert torch.equal(got, prefill_tiles[:m]), m


@pytest.mark.parametrize("wide", ["0", "1", ""])
def test_a_decode_row_is_the_same_whichever_bucket_its_step_runs_in(tiny_model, wide, monkeypatch):
    monkeypatch.setenv("KVHOLD_WIDE_DECODE_TILES", wide)     # buckets 128 and 256: either tile
    from kvhold.executor.cuda.runner import CudaRunner
    from kvhold.executor.kv_cache import KvCache
    from kvhold.executor.llama import LlamaModel
    from kvhold.protocol.layout import KvGeometry
    from kvhold.protocol.model_spec import ModelSpec
    from tools.bench_engine_setup import load_weights

    spec = ModelSpec.from_dir(tiny_model)
    model = LlamaModel(spec, _bf16_region(load_weights(tiny_model, "cuda")), torch.bfloat16,
                       torch.device("cuda"), 512)
    kv = KvCache.private(KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "bfloat16", 16), 16, "cuda")
    runner = CudaRunner(model, kv, max_batch=256, prefill_chunk=32, max_pages_per_seq=8)
    assert runner.buckets == [16, 32, 64, 128, 256]
    runner.prepare()
    assert sorted(runner.graphs) == [16, 32, 64, 128, 256]
    a, b = list(range(3, 40)), list(range(100, 120))
    runner.run(_plan([(a, 0, 32, [1, 2]), (b, 0, 20, [5, 6])]))
    runner.run(_plan([(a, 32, 5, [1, 2, 3])]))
    decode = [(a + [7], 37, 1, [1, 2, 3]), (b + [9], 20, 1, [5, 6])]
    outs = {}
    for bucket in (16, 32, 64, 128, 256):    # past 64 rows on exact_linear's tiles: the same bits
        runner.buckets = [bucket]               # the same two rows, padded to each bucket
        outs[bucket] = runner.run(_plan(decode))
        outs[bucket, "eager"] = runner._decode_forward(bucket)[0][:2]
    assert all(torch.equal(outs[16], v) for v in outs.values())

