"""The vLLM connector's logic without vLLM: what it mirrors per step from vLLM's scheduler
output, and what it reports and loads for a resubmitted request after a takeover. Real
shared-memory tables and KV region (tests.unit.helpers.ShmPool); vLLM's CPU
cache layout (`VllmCpuBlocks`) over private tensors; scheduler outputs as vLLM 0.32 shapes them."""
from types import SimpleNamespace

import pytest
import torch

from kvhold.executor.kv_mirror import Committed
from kvhold.vllm_bridge.connector import (Bridge, MirrorPlanner, MirrorWorker, external_id, kvhold_id)
from tests.unit.helpers import mirror_geometry

KV = mirror_geometry().kv
BLOCKS = 12
BT = KV.page_tokens


@pytest.fixture
def pool_geometry():
    return mirror_geometry()


def caches(fill=True):
    shape = (BLOCKS, KV.num_kv_heads, BT, 2 * KV.head_dim)
    return {f"model.layers.{i}.self_attn.attn": (torch.randn(shape) if fill else torch.zeros(shape))
            for i in reversed(range(KV.num_layers))}          # any order: sorted by layer index


def no_cached():
    return SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())


def test_request_ids_round_trip_through_vllms_suffix():
    ext = external_id(1099511627779, 3)
    assert kvhold_id(f"{ext}-1a2b3c4d") == 1099511627779 and kvhold_id(ext) == 1099511627779
    assert kvhold_id("warmup") is None and kvhold_id("0-b0a5e9b2") is None


def test_steps_are_mirrored_and_the_intact_prefix_is_loaded_after_a_takeover(pool):  # noqa: F811
    rid, vid = 7, "kvh7-e1-0000abcd"
    b = Bridge(pool.tables, pool.kv, pool.lease(0), active=True)
    planner, worker = MirrorPlanner(b, BT), MirrorWorker(b, BT, KV.num_kv_heads, KV.head_dim)
    first = caches()
    worker.register(first)
    assert planner.matched_tokens(vid, num_tokens=10, num_computed=0) == 0
    prefill = SimpleNamespace(req_id=vid, block_ids=([3, 5, 8],), num_computed_tokens=0)
    meta = planner.build([prefill], no_cached(), {vid: 10})         # a 10-token prompt: 4 + 4 + 2
    assert meta.saves == [Committed(rid, 0, 3, 4), Committed(rid, 1, 5, 4), Committed(rid, 2, 8, 2)]
    assert worker.save(meta) == 3
    decode = SimpleNamespace(req_ids=[vid], new_block_ids=[None], num_computed_tokens=[10], resumed_req_ids=set())
    assert worker.save(planner.build([], decode, {vid: 1})) == 1     # position 10: row 2 of block 8
    recorded = [b.mirror.page_of(rid, i) for i in range(3)]

    # the executor dies; a new one (new lease) validates and resubmits prompt + 1 generated token
    b2 = Bridge(pool.tables, pool.kv, pool.lease(1), active=True)
    planner2, worker2 = MirrorPlanner(b2, BT), MirrorWorker(b2, BT, KV.num_kv_heads, KV.head_dim)
    second = caches(fill=False)
    worker2.register(second)
    plans = b2.mirror.plan_restore({rid: 3}, pending_epochs=[])
    b2.restorable = {rid: (plans[rid].pages, tuple(int(b2.mirror.counts[p]) for p in plans[rid].pages))}
    assert list(plans[rid].pages) == recorded
    vid2 = "kvh7-e2-0000beef"
    # 12 tokens journaled: 11 have mirrored KV, all of it is offered (the last token is computed)
    assert planner2.matched_tokens(vid2, num_tokens=12, num_computed=0) == 11
    resumed = SimpleNamespace(req_id=vid2, block_ids=([9, 1, 4],), num_computed_tokens=11)
    meta = planner2.build([resumed], no_cached(), {vid2: 1})
    assert meta.loads == [(rid, recorded, [9, 1, 4], 11)]
    worker2.load(meta)
    assert b2.loaded[rid] == 11 and b2.pages_loaded == 3
    old, new = worker.layout.read(torch.tensor([3, 5, 8])), worker2.layout.read(torch.tensor([9, 1, 4]))
    flat_old, flat_new = old.transpose(1, 3).flatten(0, 1)[:11], new.transpose(1, 3).flatten(0, 1)[:11]
    assert torch.equal(flat_old, flat_new)                 # every mirrored token's K and V, bit for bit
    assert meta.saves == [Committed(rid, 2, 4, 4)]         # the one computed token continues block 2
    assert worker2.save(meta) == 1


def test_a_standby_mirrors_nothing(pool):  # noqa: F811
    b = Bridge(pool.tables, pool.kv, pool.lease(0), active=False)
    planner, worker = MirrorPlanner(b, BT), MirrorWorker(b, BT, KV.num_kv_heads, KV.head_dim)
    worker.register(caches())
    vid = "kvh9-e1-00000000"
    planner.matched_tokens(vid, 6, 0)
    meta = planner.build([SimpleNamespace(req_id=vid, block_ids=([2, 3],), num_computed_tokens=0)], no_cached(),
                         {vid: 6})
    assert meta.saves and worker.save(meta) == 0
    assert (pool.tables.pages["owner"] == 0).all()
