"""TensorRT-LLM glue.

CPU part (runs everywhere): the connector's logic over a TensorRT-LLM-shaped block pool
([blocks, layers, 2, tokens*heads*dim], HND) against real kvhold tables, driven the way
TensorRT-LLM drives a connector (scheduler output with computed_position /
num_scheduled_tokens / new_block_ids; save after the pass; load on a resubmitted request);
the weights rebind; the LLM arguments. The engine part runs only where `tensorrt_llm`
imports and a CUDA GPU and a checkpoint (KVHOLD_TRTLLM_MODEL) are present.
"""
import math
import os
import random
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from kvhold.executor.kv_cache import KvCache
from kvhold.protocol.layout import KvGeometry, TableGeometry
from kvhold.protocol.leases import Lease
from kvhold.protocol.memory import HostRegion
from kvhold.protocol.naming import InstancePaths
from kvhold.protocol.settings import ExecutorSettings
from kvhold.protocol.tables import Tables
from kvhold.trtllm_bridge.launcher import llm_kwargs, sampling_kwargs
from kvhold.trtllm_bridge.trtllm_connector import Bridge, MirrorExecutor, MirrorPlanner
from kvhold.trtllm_bridge.trtllm_weights import rebind_views

KV = KvGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", page_tokens=4)
GEOM = TableGeometry(kv=KV, num_pages=64, num_slots=4, max_seq_len=64, num_leases=2)
BLOCKS = 50


@pytest.fixture
def pool():
    tag = f"{os.getpid()}-{random.getrandbits(30)}"
    tables = Tables.create(f"/kvhold-test-trt-{tag}", GEOM, 1)
    region = HostRegion(f"/kvhold-test-trtkv-{tag}", "kv", GEOM.kv_pool_bytes)
    yield tables, KvCache.from_mapping(region.map_local(), KV, GEOM.num_pages).pool
    tables.unlink()
    region.unlink()


def lease(tables, slot):
    tables.leases["epoch"][slot] = tables.next_epoch()
    return Lease(tables, slot, int(tables.leases["epoch"][slot]))


def trt_pool():
    return torch.zeros(BLOCKS, KV.num_layers, 2, KV.page_tokens * KV.num_kv_heads * KV.head_dim)


def write_token(pool, block, slot, pos):
    """What TensorRT-LLM's attention writes for one token: HND inside the block."""
    gen = torch.Generator().manual_seed(pos)
    kv = torch.randn(KV.num_layers, 2, KV.num_kv_heads, KV.head_dim, generator=gen)
    pool.view(BLOCKS, KV.num_layers, 2, KV.num_kv_heads, KV.page_tokens, KV.head_dim)[block, :, :, :, slot] = kv


def data(rid, blocks, computed, n):
    return SimpleNamespace(request_id=rid, new_tokens=[], new_block_ids=blocks,
                           computed_position=computed, num_scheduled_tokens=n)


def run_engine(pool, tables, kv, num_tokens=15):
    """One request (kvhold id 7, engine id 1001): a 10-token prefill, then decode to num_tokens."""
    bridge = Bridge(tables, kv, lease(tables, 0))
    executor, planner = MirrorExecutor(bridge, 4, 2, 8), MirrorPlanner(bridge, 4)
    executor.register(pool)
    assert planner.matched_tokens(1001, 7, 10, 0) == 0
    blocks = [5, 9, 2]
    meta = planner.build([data(1001, blocks, 0, 10)], [])
    for pos in range(10):
        write_token(pool, blocks[pos // 4], pos % 4, pos)
    executor.save(meta)
    for pos in range(10, num_tokens):
        new = [11] if pos == 12 else []
        blocks += new
        meta = planner.build([], [data(1001, new, pos, 1)])
        write_token(pool, blocks[pos // 4], pos % 4, pos)
        executor.save(meta)
    return bridge, blocks


def test_mirrored_blocks_load_into_a_new_engine(pool):
    tables, kv = pool
    old, old_blocks = trt_pool(), None
    bridge, old_blocks = run_engine(old, tables, kv)
    assert [bridge.mirror.page_of(7, i) is not None for i in range(4)] == [True] * 4
    # the executor died; the new one validates, then TensorRT-LLM re-admits the request
    new = trt_pool()
    bridge2 = Bridge(tables, kv, lease(tables, 1))
    executor, planner = MirrorExecutor(bridge2, 4, 2, 8), MirrorPlanner(bridge2, 4)
    executor.register(new)
    plans = bridge2.mirror.plan_restore({7: math.ceil((16 - 1) / 4)}, full_blocks_only=True)
    assert plans[7].restored.blocks_restored == 3 and plans[7].restored.tokens_restored == 12
    bridge2.restorable = {7: plans[7].pages}
    assert planner.matched_tokens(2002, 7, num_prompt=16, num_computed=0) == 12
    meta = planner.build([data(2002, [40, 41, 42, 43], 0, 4)], [])
    assert meta.load_blocks == [40, 41, 42]
    assert [(c.index, c.block, c.num_tokens) for c in meta.save] == [(3, 43, 4)]
    executor.load(meta)
    assert torch.equal(new[[40, 41, 42]], old[old_blocks[:3]])
    for pos in range(12, 16):                    # the engine recomputes the tail block
        write_token(new, 43, pos % 4, pos)
    executor.save(meta)
    page = bridge2.mirror.page_of(7, 3)            # mirrored again, into a fresh page
    assert page not in plans[7].pages
    assert torch.equal(kv[page], bridge2.mirror.layout.read(torch.tensor([43]))[0])


def test_a_damaged_block_is_not_loaded(pool):
    tables, kv = pool
    bridge, _ = run_engine(trt_pool(), tables, kv)
    kv[bridge.mirror.page_of(7, 1), 2, 1, 0, 0, 3] += 1.0          # a bit flip in block 1
    bridge2 = Bridge(tables, kv, lease(tables, 1))
    MirrorExecutor(bridge2, 4, 2, 8).register(trt_pool())
    plans = bridge2.mirror.plan_restore({7: 3}, full_blocks_only=True)
    assert plans[7].restored.first_bad == 1 and len(plans[7].pages) == 1
    bridge2.restorable = {7: plans[7].pages}
    assert MirrorPlanner(bridge2, 4).matched_tokens(3003, 7, 16, 0) == 4


def test_requests_resolve_by_client_id_or_unique_tokens():
    bridge = Bridge(None, None, None)
    req = SimpleNamespace(py_client_id=3, get_tokens=lambda beam: [1, 2, 3])
    assert bridge.kvhold_id(req) is None
    bridge.expect([1, 2, 3], 70)
    assert bridge.kvhold_id(req) == 70
    bridge.expect([1, 2, 3], 71)                 # ambiguous: wait for the client id
    assert bridge.kvhold_id(req) is None
    bridge.client_ids[3] = 71
    assert bridge.kvhold_id(req) == 71


def test_unfused_parameters_become_views_of_the_region():
    torch.manual_seed(0)
    region = {"embed.weight": torch.randn(10, 8), "o_proj.weight": torch.randn(8, 8),
              "o_proj.bias": torch.randn(8), "q.weight": torch.randn(8, 8),
              "k.weight": torch.randn(8, 8), "v.weight": torch.randn(8, 8)}
    model = nn.Module()
    model.embed, model.o_proj, model.qkv = nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 24, bias=False)
    with torch.no_grad():                        # what TensorRT-LLM's load_weights does: copies
        model.embed.weight.copy_(region["embed.weight"])
        model.o_proj.weight.copy_(region["o_proj.weight"])
        model.o_proj.bias.copy_(region["o_proj.bias"] * 2)               # transformed: stays
        model.qkv.weight.copy_(torch.cat([region[k] for k in ("q.weight", "k.weight", "v.weight")]))
    assert rebind_views(model, region) == ["embed.weight", "o_proj.weight"]
    assert model.embed.weight.data_ptr() == region["embed.weight"].data_ptr()
    assert model.o_proj.weight.data_ptr() == region["o_proj.weight"].data_ptr()
    assert model.o_proj.bias.data_ptr() != region["o_proj.bias"].data_ptr()


def test_llm_arguments_pin_what_the_bridge_owns():
    settings = ExecutorSettings(model="/m", max_batch=8, max_batch_tokens=256)
    kw = llm_kwargs(settings, GEOM, {"kv_cache_config": {"free_gpu_memory_fraction": 0.5},
                                     "cuda_graph_config": None})
    assert kw["kv_cache_config"] == {"free_gpu_memory_fraction": 0.5, "tokens_per_block": 4,
                                     "enable_block_reuse": False}
    assert kw["kv_connector_config"]["connector_module"] == "kvhold.trtllm_bridge.trtllm_connector"
    assert kw["max_seq_len"] == 64 and kw["cuda_graph_config"] is None
    with pytest.raises(ValueError, match="checkpoint_loader"):
        llm_kwargs(settings, GEOM, {"checkpoint_loader": "x"})
    entry = SimpleNamespace(max_tokens=40, temperature=0.0, top_p=1.0, top_k=0, seed=5,
                            stop_ids=(), ignore_eos=False)
    assert sampling_kwargs(entry, 12)["max_tokens"] == 28 and sampling_kwargs(entry, 0)["top_k"] is None


# ------------------------------------------------------------------ with TensorRT-LLM itself
@pytest.mark.gpu
def test_trtllm_executor_killed_mid_stream_continues(start_sidecar):
    """Needs tensorrt_llm 1.2, a CUDA GPU and KVHOLD_TRTLLM_MODEL (a small HF Llama directory)."""
    pytest.importorskip("tensorrt_llm")
    model = os.environ.get("KVHOLD_TRTLLM_MODEL")
    if not torch.cuda.is_available() or not model:
        pytest.skip("needs a CUDA GPU and KVHOLD_TRTLLM_MODEL")
    from kvhold.client.client import wait_all

    flags = ["--model", model, "--backend", "cuda", "--device", "cuda:0", "--kv-mode", "foreign",
             "--no-spawn", "--page-tokens", "32", "--max-seq-len", "1024", "--lease-ms", "5000"]
    prompts = [dict(prompt_ids=list(range(100 + i, 400 + i)), max_tokens=64, temperature=0.0)
               for i in range(4)]

    def launch(sc):
        token = InstancePaths.for_instance(sc.instance, sc.runtime_root).token_file
        return subprocess.Popen([sys.executable, "-m", "kvhold.trtllm_bridge.launcher", "--instance",
                                 sc.instance, "--runtime-root", str(sc.runtime_root),
                                 "--token-file", str(token)])

    sc = start_sidecar(flags)
    procs = [launch(sc), launch(sc)]
    try:
        sc.wait_steady(timeout=600)
        with sc.new_client(timeout=300) as client:
            reference = [r.token_ids for r in wait_all([client.generate(**p) for p in prompts])]
            seen = [0]

            def on_event(stream, event):
                seen[0] += 1
                if seen[0] == 100:
                    os.kill(sc.wait_steady()["pid"], signal.SIGKILL)

            got = [r.token_ids for r in wait_all([client.generate(**p) for p in prompts], on_event)]
        assert got == reference
        rec = sc.status()["recoveries"][-1]
        assert rec["kv_mode"] == "foreign-trtllm" and rec["tokens_kept"] > 0 and rec["pages_bad"] == 0
    finally:
        for p in procs:
            p.kill()
