"""TensorRT-LLM glue.

CPU part (runs everywhere): the connector's logic over a TensorRT-LLM-shaped block pool
([blocks, layers, 2, tokens*heads*dim], HND) against real kvhold tables, driven the way
TensorRT-LLM drives a connector (scheduler output with computed_position /
num_scheduled_tokens / new_block_ids; save after the pass; load on a resubmitted request);
the weights rebind; the LLM arguments. The engine part runs only where `tensorrt_llm`
imports and a CUDA GPU and a checkpoint (KVHOLD_TRTLLM_MODEL) are present.
"""
import inspect
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import ExecState, KvGeometry, TableGeometry
from kvhold.protocol.leases import Lease
from kvhold.protocol.naming import InstancePaths
from kvhold.protocol.recovery_report import RecoveryReport
from kvhold.protocol.settings import ExecutorSettings
from kvhold.testing.trtllm_contract import (
    ConnectorEngine,
    call_load_weights,
    fake_tensorrt_llm,
    next_token,
)
from kvhold.trtllm_bridge import launcher
from kvhold.trtllm_bridge.launcher import llm_kwargs, sampling_kwargs
from kvhold.trtllm_bridge.trtllm_connector import Bridge, MirrorExecutor, MirrorPlanner
from kvhold.trtllm_bridge.trtllm_weights import rebind_views
from kvhold.protocol.sampling import SamplingParams

KV = KvGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", page_tokens=4)
GEOM = TableGeometry(kv=KV, num_pages=64, num_slots=4, max_seq_len=64, num_leases=2)
BLOCKS = 50


@pytest.fixture
def pool_geometry():
    return GEOM


@pytest.fixture
def pool(pool):
    """The shared pool (tests/conftest.py) as this module's tests take it: (tables, KV pages)."""
    return pool.tables, pool.kv


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
    # a first pass mirrors the whole prefix; the loaded blocks' pages are already published
    assert [(c.index, c.block, c.num_tokens) for c in meta.save] == [(0, 40, 4), (1, 41, 4), (2, 42, 4), (3, 43, 4)]
    executor.load(meta)
    assert torch.equal(new[[40, 41, 42]], old[old_blocks[:3]])
    for pos in range(12, 16):                    # the engine recomputes the tail block
        write_token(new, 43, pos % 4, pos)
    assert executor.save(meta) == 1
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
                                     "enable_block_reuse": True}
    assert kw["kv_connector_config"]["connector_module"] == "kvhold.trtllm_bridge.trtllm_connector"
    assert kw["max_seq_len"] == 64 and kw["cuda_graph_config"] is None
    with pytest.raises(ValueError, match="checkpoint_loader"):
        llm_kwargs(settings, GEOM, {"checkpoint_loader": "x"})
    entry = SimpleNamespace(sampling=SamplingParams(max_tokens=40, temperature=0.0, top_p=1.0, top_k=0, seed=5,
                                                    stop_token_ids=(), ignore_eos=False))
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


# ------------------------------------------------------------------ contract with TensorRT-LLM 1.2
# The glue driven exactly as TensorRT-LLM calls it, by kvhold.testing.trtllm_contract (its
# docstring names each upstream file and commit of NVIDIA/TensorRT-LLM it follows).

SETTINGS = ExecutorSettings(model="/m", max_batch=8, max_batch_tokens=256)
PROMPT = list(range(100, 118))                       # 18 tokens: 4 full blocks of 4, and 2


def engine_for(bridge, kw, **opts):
    sys.modules["kvhold.trtllm_bridge.trtllm_connector"].install(bridge)   # as the launcher does
    return ConnectorEngine(kw, num_layers=KV.num_layers, num_kv_heads=KV.num_kv_heads,
                           head_dim=KV.head_dim, **opts)


def greedy(tokens, n):
    tokens = list(tokens)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens


def takeover(tables, kv, kw, steps=6, max_new=12, overlap=True, before=None, head_major=True,
             engine_head_major=None):
    """kvhold request 7 runs `steps` iterations in one engine, which then dies; a new engine
    takes over, as the launcher's promote does, and finishes it. Returns (bridge, plans, engine)."""
    with fake_tensorrt_llm("1.2"):
        return _takeover(tables, kv, kw, steps, max_new, overlap, before, head_major,
                         head_major if engine_head_major is None else engine_head_major)


def _takeover(tables, kv, kw, steps, max_new, overlap, before, head_major, engine_head_major):
    b1 = Bridge(tables, kv, lease(tables, 0), head_major=head_major)
    e1 = engine_for(b1, kw, overlap=overlap, head_major=engine_head_major)
    b1.client_ids[1] = 7
    e1.add_request(1001, PROMPT, max_new, client_id=1)
    for _ in range(steps):
        e1.step()
    committed = e1.requests[1001].tokens            # every sampled token reached the journal
    b2 = Bridge(tables, kv, lease(tables, 1), head_major=head_major)
    e2 = engine_for(b2, kw, overlap=overlap, head_major=engine_head_major)   # the warm standby
    if before:
        before(b2, e2)
    plans = b2.mirror.plan_restore({7: math.ceil((len(committed) - 1) / 4)}, full_blocks_only=True)
    b2.restorable = {7: plans[7].pages}
    b2.await_outcomes([7])
    b2.client_ids[2] = 7
    e2.add_request(2002, committed, max_new - (len(committed) - len(PROMPT)), client_id=2)
    out = e2.run()
    assert committed + out[2002] == greedy(PROMPT, max_new)    # attention checked every row it read
    return b2, plans, e2


def test_block_reuse_is_on_so_tensorrt_llm_asks_the_connector(pool):
    """kvCacheManager.cpp (b35ac1b6): only addSequence's block-reuse overload calls
    getNumNewMatchedTokens; with reuse off nothing is loaded after a takeover."""
    tables, kv = pool
    kw = llm_kwargs(SETTINGS, GEOM)
    assert kw["kv_cache_config"]["enable_block_reuse"] is True
    b2, plans, e2 = takeover(tables, kv, kw)
    assert e2.connector_asked == 1
    o = b2.outcomes[7]
    assert o.settled and o.loaded == plans[7].restored.tokens_restored > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_mirror_under_the_overlap_scheduler_never_claims_an_unwritten_row(pool, overlap):
    """With the overlap scheduler (TensorRT-LLM's default) computed_position lags one row: the
    mirror claims only rows an earlier pass wrote, so every loaded row is right."""
    tables, kv = pool
    b2, plans, _ = takeover(tables, kv, llm_kwargs(SETTINGS, GEOM), steps=9, max_new=14, overlap=overlap)
    assert b2.outcomes[7].loaded == plans[7].restored.tokens_restored >= 16


def test_radix_tree_hits_are_not_loaded_again_and_the_report_counts_loads(pool):
    """get_num_new_matched_tokens counts beyond num_computed_tokens (the radix-tree match): a
    prefix another request left in the new engine is reused, only the rest is loaded, and
    the report says what was loaded, not what the restore plan held."""
    tables, kv = pool

    def shared_prefix(b2, e2):                      # request 9 (same first 8 tokens) ran first
        b2.client_ids[3] = 9
        e2.add_request(3003, PROMPT[:8] + [1, 2, 3], 2, client_id=3)
        e2.run()

    b2, plans, _ = takeover(tables, kv, llm_kwargs(SETTINGS, GEOM), before=shared_prefix)
    o = b2.outcomes[7]
    assert o.covered == plans[7].restored.tokens_restored and o.loaded == o.covered - 8
    msg = SimpleNamespace(detect_ns=1, fenced_epoch=3, pending_epochs=())
    report = launcher.recovery_report(msg, b2.mirror.last_restore, plans, {7: 20}, {7: o},
                                      promoted_ns=2, validated_ns=3, resumed_ns=4)
    assert isinstance(report, RecoveryReport)
    assert report.tokens_kept == o.loaded < plans[7].restored.tokens_restored
    assert report.tokens_recomputed == 20 - o.covered and report.requests_resumable == 1


def test_matched_tokens_are_counted_from_an_unaligned_computed_position(pool):
    """A partial radix match leaves num_computed_tokens inside a block (private to the
    request): the connector loads from that block on and reports tokens from that point."""
    tables, kv = pool
    bridge = Bridge(tables, kv, lease(tables, 0))
    bridge.restorable = {7: (11, 12, 13)}
    planner = MirrorPlanner(bridge, 4)
    assert planner.matched_tokens(1, 7, num_prompt=16, num_computed=6) == 6   # tokens 6..11
    meta = planner.build([data(1, [5, 6, 7, 8], 0 + 6, 4)], [])
    assert (meta.load_pages, meta.load_blocks) == ([12, 13], [6, 7])


def test_load_then_rebind_keeps_the_signature_tensorrt_llm_inspects():
    """model_loader.py (004b733e): _call_load_weights passes weight_mapper /
    allow_partial_loading only if getfullargspec(load_method).args names them."""
    region = {"w.weight": torch.randn(4, 4)}

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(4, 4, bias=False)
            self.got = None

        def load_weights(self, weights, weight_mapper=None, allow_partial_loading=False):
            self.got = (weight_mapper, allow_partial_loading)
            with torch.no_grad():
                self.w.weight.copy_(weights["w.weight"])

    with fake_tensorrt_llm("1.2") as glue:
        loader = glue["kvhold.trtllm_bridge.trtllm_weights"].KvholdCheckpointLoader(region)
        model = Model()
        weights = loader.load_weights("/ckpt")
        mapper = loader.get_initialized_weight_mapper(model, config=None)
        assert inspect.getfullargspec(model.load_weights).args == ["weights", "weight_mapper",
                                                                   "allow_partial_loading"]
        call_load_weights(model.load_weights, weights, mapper)
        assert model.got == (mapper, False)
        assert loader.rebound == ["w.weight"] and model.w.weight.data_ptr() == region["w.weight"].data_ptr()
        with pytest.raises(TypeError):                   # keywords the model lacks are not invented
            glue["kvhold.trtllm_bridge.trtllm_weights"].explicit_signature(lambda weights: None, lambda: None)(
                {}, weight_mapper=mapper)


@pytest.mark.parametrize("layout", ["1.2", "connectors"])
def test_connector_classes_subclass_the_api_at_either_path(layout):
    from kvhold.testing import trtllm_contract

    with fake_tensorrt_llm(layout) as glue:
        mod = glue["kvhold.trtllm_bridge.trtllm_connector"]
        assert issubclass(mod.KvholdConnectorWorker, trtllm_contract.KvCacheConnectorWorker)
        assert issubclass(mod.KvholdConnectorScheduler, trtllm_contract.KvCacheConnectorScheduler)


def test_a_tensorrt_llm_without_the_connector_api_fails_at_import():
    with pytest.raises(ImportError, match="kv_cache_connector"), fake_tensorrt_llm(None):
        pass
    mod = sys.modules["kvhold.trtllm_bridge.trtllm_connector"]     # without TensorRT-LLM: named
    with pytest.raises(ImportError, match="needs TensorRT-LLM"):
        _ = mod.KvholdConnectorWorker


@pytest.mark.parametrize("options, match", [
    ({"checkpoint_format": "HF"}, "checkpoint_format"),
    ({"connector_config": {}}, "connector_config"),
    ({"speculative_config": {"decoding_type": "MTP"}}, "speculative"),
    ({"scheduler_config": {"capacity_scheduler_policy": "MAX_UTILIZATION"}}, "GUARANTEED_NO_EVICT"),
    ({"kv_cache_config": {"enable_block_reuse": False}}, "enable_block_reuse"),
    ({"kv_cache_config": {"tokens_per_block": 64}}, "tokens_per_block"),
])
def test_llm_options_that_would_defeat_the_bridge_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        llm_kwargs(SETTINGS, GEOM, options)


def test_scheduler_policy_is_the_one_tensorrt_llm_accepts_with_a_connector():
    kw = llm_kwargs(SETTINGS, GEOM, {"scheduler_config": {"context_chunking_policy": "EQUAL_PROGRESS"}})
    assert kw["scheduler_config"] == {"context_chunking_policy": "EQUAL_PROGRESS",
                                      "capacity_scheduler_policy": "GUARANTEED_NO_EVICT"}


def test_build_llm_refuses_a_tensorrt_llm_without_kv_connector_config(monkeypatch):
    """TensorRT-LLM 1.0 named it connector_config, with classes built from an ExecutorConfig."""
    import types as t

    llm_args = t.ModuleType("tensorrt_llm.llmapi.llm_args")
    llm_args.TorchLlmArgs = SimpleNamespace(model_fields={"connector_config": None})
    for name in ("KvCacheConfig", "KvCacheConnectorConfig", "SchedulerConfig"):
        setattr(llm_args, name, dict)
    llm_args.CapacitySchedulerPolicy = SimpleNamespace(GUARANTEED_NO_EVICT="GUARANTEED_NO_EVICT")
    trt = t.ModuleType("tensorrt_llm")
    trt.LLM = lambda **kw: kw
    weights = t.ModuleType("kvhold.trtllm_bridge.trtllm_weights")
    weights.KvholdCheckpointLoader = lambda region: region
    for name, mod in {"tensorrt_llm": trt, "tensorrt_llm.llmapi": t.ModuleType("tensorrt_llm.llmapi"),
                      "tensorrt_llm.llmapi.llm_args": llm_args,
                      "kvhold.trtllm_bridge.trtllm_weights": weights}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    with pytest.raises(RuntimeError, match="kv_connector_config"):
        launcher.build_llm(llm_kwargs(SETTINGS, GEOM), weights={})


def test_block_layout_follows_the_attention_backend(pool):
    """resource_manager.py get_buffers: "different attention backend/implementation can have
    different KV layouts"; a wrong guess corrupts mirrored rows, which attention then reads."""
    assert launcher.kv_layout({}) == "hnd" and launcher.kv_layout({"attn_backend": "FLASHINFER"}) == "nhd"
    assert launcher.kv_layout({"attn_backend": "FLASHINFER"}, "hnd") == "hnd"
    with pytest.raises(ValueError, match="--kv-layout"):
        launcher.kv_layout({"attn_backend": "SOMETHING"})
    tables, kv = pool
    takeover(tables, kv, llm_kwargs(SETTINGS, GEOM), head_major=False)       # NHD engine, NHD mirror


def test_a_wrong_block_layout_is_caught_by_the_harness(pool):
    """The same run with the mirror reading NHD blocks as HND: rows are copied before the
    engine wrote them, and the new engine's attention reads a wrong row."""
    tables, kv = pool
    with pytest.raises(AssertionError, match="KV row"):
        takeover(tables, kv, llm_kwargs(SETTINGS, GEOM), head_major=True, engine_head_major=False)


class HarnessLLM:
    """`tensorrt_llm.LLM` over a ConnectorEngine stepping on its own thread, as the LLM API's
    PyExecutor does: generate_async(tokens, sampling_params, streaming=True) -> output whose
    iteration ends with the finished request."""

    def __init__(self, engine):
        self.engine, self.lock, self.next_id, self.stop = engine, threading.Lock(), 100, False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while not self.stop:
            with self.lock:
                self.engine.step()
            time.sleep(0.001)

    def generate_async(self, tokens, sampling_params, streaming=True):
        with self.lock:
            self.next_id += 1
            cid = self.next_id
            self.engine.add_request(cid + 5000, tokens, sampling_params["max_tokens"], client_id=cid)
        return HarnessOutput(self, cid)


class HarnessOutput:
    def __init__(self, llm, cid):
        self.llm, self.request_id = llm, cid

    def __iter__(self):
        while (tokens := self.llm.engine.finished.get(self.request_id + 5000)) is None:
            time.sleep(0.002)
        yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, finish_reason="length")], finished=True)


def test_promote_reports_what_the_connector_loaded(pool):
    """The launcher's promote, over a real journal and mirror, with the engine on its own
    thread: tokens_kept counts the blocks start_load_kv copied, tokens_recomputed the mirrored
    KV the new engine computes again; a prefix the new engine's radix tree already had is
    neither kept from kvhold nor recomputed."""
    tables, kv = pool
    journal = Journal(tables)
    max_new = 12
    with fake_tensorrt_llm("1.2"):
        sys.modules["tensorrt_llm"].SamplingParams = lambda **kw: kw
        kw = llm_kwargs(SETTINGS, GEOM)
        rid = journal.new_request_id()
        b1 = Bridge(tables, kv, lease(tables, 0))
        e1 = engine_for(b1, kw)
        b1.client_ids[1] = rid
        e1.add_request(1001, PROMPT, max_new, client_id=1)
        for _ in range(6):
            e1.step()
        generated = e1.requests[1001].tokens[len(PROMPT):]
        journal.admit(0, rid, PROMPT, SamplingParams(max_tokens=max_new, seed=0, temperature=0.0, top_p=1.0, top_k=0))
        journal.take(0, rid, int(tables.leases["epoch"][0]))
        for i, token in enumerate(generated):
            journal.commit_tokens(np.array([0]), np.array([len(PROMPT) + i]), np.array([token], dtype=np.int32),
                                  np.array([i + 1], dtype=np.uint32))
        pages = []
        while (page := b1.mirror.page_of(rid, len(pages))) is not None:
            pages.append(page)
        journal.set_pages(0, pages)
        mirrored = min(len(PROMPT) + len(generated) - 1, sum(min(int(b1.mirror.counts[p]), 4) for p in pages))

        b2 = Bridge(tables, kv, lease(tables, 1))
        e2 = engine_for(b2, kw)                      # the standby, warm
        e2.add_request(3003, PROMPT[:8] + [1, 2, 3], 2)       # another request sharing 2 blocks
        e2.run()
        w = launcher.TrtllmWorkload.__new__(launcher.TrtllmWorkload)
        w.ctx = SimpleNamespace(tables=tables, lease=b2.lease, beat=lambda: None)
        w.bridge, w.journal, w.llm = b2, journal, HarnessLLM(e2)
        w.events, w.live, w.offsets, w.marks = queue.Queue(), {}, {}, {}
        try:
            report = w.promote(SimpleNamespace(detect_ns=1, fenced_epoch=1, pending_epochs=()))
        finally:
            w.llm.stop = True
            w.llm.thread.join(10)            # before the fixture unmaps the tables it steps on
    full = 4 * ((len(PROMPT) + len(generated) - 1) // 4)       # intact full blocks, prompt -1 token
    assert report.kv_mode == "foreign-trtllm" and report.requests_resumable == 1
    assert report.tokens_kept == full - 8                    # the first 8 came from the radix tree
    assert report.tokens_recomputed == mirrored - full
    assert journal.recompute_counts(0)[1] == mirrored - full


def test_with_block_reuse_off_the_connector_is_never_asked_and_says_so(pool, caplog):
    """What the bridge avoids by pinning reuse on: kvCacheManager.cpp's addSequence without
    reuse ignores the connector, so no request is resolved to kvhold and nothing is mirrored."""
    tables, kv = pool
    kw = llm_kwargs(SETTINGS, GEOM)
    kw["kv_cache_config"] = {**kw["kv_cache_config"], "enable_block_reuse": False}
    with fake_tensorrt_llm("1.2"):
        bridge = Bridge(tables, kv, lease(tables, 0))
        engine = engine_for(bridge, kw)
        bridge.client_ids[1] = 7
        engine.add_request(1001, PROMPT, 4, client_id=1)
        engine.run()
    assert engine.connector_asked == 0 and bridge.mirror.page_of(7, 0) is None
    assert "enable_block_reuse off" in caplog.text


def test_a_late_output_of_an_aborted_submission_is_not_journaled_for_the_slots_next_request(pool):
    """A cancelled request's engine output can still be on its way (the drain thread) when the
    slot is released and admitted again: it belongs to the old submission, not to the new
    request in that slot, and is dropped."""
    tables, kv = pool
    journal = Journal(tables)
    w = launcher.TrtllmWorkload(SimpleNamespace(tables=tables, lease=lease(tables, 0), epoch=1))
    w.bridge, w.journal = Bridge(tables, kv, w.ctx.lease), journal
    MirrorExecutor(w.bridge, KV.page_tokens, KV.num_kv_heads, KV.head_dim).register(trt_pool())
    step = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7, 7, 7], finish_reason="length")], finished=True)
    old, new = _Output([step]), _Output([])
    rid = journal.new_request_id()
    journal.admit(0, rid, PROMPT, SamplingParams(max_tokens=8, seed=0, temperature=0.0, top_p=1.0, top_k=0))
    journal.take(0, rid, 1)
    w._track(journal.entry(0), old)
    journal.cancel(0)
    assert w.step() == [0] and old.aborted and journal.entry(0).exec_state == ExecState.FINISHED
    journal.release(0)
    rid2 = journal.new_request_id()
    journal.admit(0, rid2, PROMPT, SamplingParams(max_tokens=8, seed=0, temperature=0.0, top_p=1.0, top_k=0))
    journal.take(0, rid2, 1)
    w._track(journal.entry(0), new)
    w._drain(0, old)                                  # the old submission's last output arrives now
    w.step()
    e = journal.entry(0)
    assert e.request_id == rid2 and e.num_generated == 0 and e.exec_state != ExecState.FINISHED


class _Output(list):
    """A streaming `RequestOutput` stand-in: iterates its steps; `abort` is recorded."""

    aborted = False

    def abort(self):
        self.aborted = True


def _llm_options_examples():
    """Every YAML block of the TensorRT-LLM deploy and bridge docs: `--llm-options` files."""
    root = Path(__file__).resolve().parents[2]
    for doc in ("deploy/trtllm.md", "docs/TRTLLM_BRIDGE.md", "kvhold/trtllm_bridge/README.md"):
        for block in re.findall(r"```yaml\n(.*?)```", (root / doc).read_text(), re.S):
            yield doc, yaml.safe_load(block)


def test_the_documented_llm_options_are_what_the_launcher_accepts():
    examples = list(_llm_options_examples())
    assert examples, "the deploy docs lost their --llm-options example"
    for doc, options in examples:
        kw = llm_kwargs(SETTINGS, GEOM, options)
        assert kw["cuda_graph_config"] is None, doc


def test_cuda_graphs_stay_off_with_the_connector():
    """TensorRT-LLM turns CUDA graphs on by default (TorchLlmArgs.cuda_graph_config); some of its
    versions refuse them with a KV connector at start, and its own connector tests run without
    them: the launcher turns them off and refuses an options file that turns them on."""
    assert llm_kwargs(SETTINGS, GEOM)["cuda_graph_config"] is None
    assert llm_kwargs(SETTINGS, GEOM, {"cuda_graph_config": None})["cuda_graph_config"] is None
    with pytest.raises(ValueError, match="cuda_graph_config"):
        llm_kwargs(SETTINGS, GEOM, {"cuda_graph_config": {"max_batch_size": 64}})
