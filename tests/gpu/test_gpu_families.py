"""Every model family the CUDA engine accepts gives the CPU reference's logits on the GPU.

The CPU engine (float64) equals transformers for each family (tests/unit/test_hf_parity.py,
on the same checkpoints kvhold.testing.families writes here, where transformers is not
installed). On the GPU the fused layers run the same model: in float32 they agree with the
reference to rounding; in bfloat16 within bf16's tolerance, through prefill chunks, decode
steps, CUDA graphs and eager decode alike.
"""
import pytest
import torch

from tests.gpu.helpers import plan as _plan

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


def _run(runner):
    a, b = list(range(3, 40)), list(range(100, 120))
    out1 = runner.run(_plan([(a, 0, 32, [1, 2]), (b, 0, 20, [5, 6])]))            # prefill chunks
    out2 = runner.run(_plan([(a, 32, 5, [1, 2, 3])]))                           # the rest of a
    out3 = runner.run(_plan([(a + [7], 37, 1, [1, 2, 3]), (b + [9], 20, 1, [5, 6])]))  # decode
    return torch.cat([out1, out2, out3])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_on_the_gpu_matches_the_cpu_reference(family, dtype, tmp_path):
    from safetensors.torch import load_file

    from kvhold.executor.cuda.runner import CudaRunner
    from kvhold.executor.kv_cache import KvCache
    from kvhold.executor.llama import LlamaModel
    from kvhold.executor.step_runner import CpuRunner
    from kvhold.protocol.layout import KvGeometry
    from kvhold.protocol.model_spec import ModelSpec
    from kvhold.testing.families import build_family
    from tools.bench_engine_setup import load_weights

    path = build_family(tmp_path / family, family, dtype=dtype)
    spec = ModelSpec.from_dir(path)
    assert spec.model_type == family and spec.cuda_refusal(512) is None
    torch_dtype = getattr(torch, dtype)
    gpu_model = LlamaModel(spec, load_weights(path, "cuda"), torch_dtype, torch.device("cuda"), 512)
    assert gpu_model.fused is not None and gpu_model.fused.fused_gemms
    results = {}
    for graph in (True, False):
        kv = KvCache.private(KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype, 16), 16, "cuda")
        runner = CudaRunner(gpu_model, kv, max_batch=8, prefill_chunk=32, max_pages_per_seq=8, use_graph=graph)
        runner.prepare()
        results[graph] = _run(runner)
    assert torch.equal(results[True], results[False])        # a graph replays what eager decode computes
    cpu_weights = {k: v.double() for k, v in load_file(str(path / "model.safetensors")).items()}
    cpu_model = LlamaModel(spec, cpu_weights, torch.float64, torch.device("cpu"), 512)
    want = _run(CpuRunner(cpu_model, KvCache.private(
        KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float64", 16), 16))).cuda()
    got = results[True].double()
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    if dtype == "float32":
        assert err < 2e-3 * max(1.0, scale), (family, err, scale)
    else:       # bf16 keeps 8 bits of mantissa: a few units in its last place after four layers
        assert err < 0.05 * max(1.0, scale), (family, err, scale)
        agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        assert agree >= 0.9, (family, agree)
    print(f"{family} {dtype}: max |gpu - cpu| = {err:.2e} (logits up to {scale:.2f})")
