"""vLLM's GPU KV caches under the KV mirror, on a CUDA GPU, with no vLLM build.

vLLM 0.32's GPU model runner hands the connector each layer's cache as a logical [blocks,
kv_heads, tokens, key and value] view of one allocation, strided by the resolved KVCacheLayout
(six of them). `vllm_views` builds those views the same way; tests/vllm_bridge checks the same
adapter against vLLM's own create_kv_cache_views in each layout. Here, per layout:
* the step's KV is written on a side stream behind a delay (vLLM's compute stream) and mirrored
  with that stream current, as vLLM calls `wait_for_save`: the mirror must see the step's rows;
* kvhold's pool is a host mapping (device-to-host copies) or on the GPU (device-to-device);
* a writer process is SIGKILLed mid-stream; every page it published restores bit for bit into
  fresh caches of another layout."""
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
# vLLM's KVCacheLayout: each member's stride permutation of the logical [L, B, H, N, C]
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
ENGINE_BLOCKS = 96
RIDS = (31, 32, 33)


def geometry():
    from kvhold.protocol.layout import KvGeometry, TableGeometry

    kv = KvGeometry(num_layers=3, num_kv_heads=4, head_dim=64, dtype="bfloat16", page_tokens=16)
    return TableGeometry(kv=kv, num_pages=192, num_slots=4, max_seq_len=1024, num_leases=2)


def vllm_views(layout: str, blocks: int = ENGINE_BLOCKS):
    """One allocation and each layer's [B, H, N, 2D] view of it, strided as `layout` says."""
    kv = geometry().kv
    shape = (kv.num_layers, blocks, kv.num_kv_heads, kv.page_tokens, 2 * kv.head_dim)
    strides, size = [0] * 5, 1
    for dim in reversed(LAYOUTS[layout]):
        strides[dim], size = size, size * shape[dim]
    raw = torch.zeros(size, dtype=torch.bfloat16, device="cuda")
    view = raw.as_strided(shape, strides)
    return raw, [view[i] for i in range(kv.num_layers)]


def adapter(views):
    from kvhold.vllm_bridge.connector import vllm_blocks

    kv = geometry().kv
    return vllm_blocks(views, kv.num_kv_heads, kv.head_dim, kv.page_tokens)


def token_kv(rid: int, pos: int) -> torch.Tensor:
    """Deterministic K/V of one token of one request, [L, 2, H, D] in bf16 on the GPU."""
    kv = geometry().kv
    gen = torch.Generator().manual_seed(rid * 100_003 + pos)
    return torch.randn(kv.num_layers, 2, kv.num_kv_heads, kv.head_dim, generator=gen).to("cuda", torch.bfloat16)


class Engine:
    """Decodes token by token into its vLLM-shaped cache on `stream`, each step's writes
    delayed on that stream, blocks from a shuffled free list."""

    def __init__(self, layout, stream, seed=0):
        from kvhold.executor.kv_mirror import Committed

        self.layout, self.stream, self.committed = layout, stream, Committed
        self.free = list(range(ENGINE_BLOCKS))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[int, list[int]] = {}
        self.length: dict[int, int] = {}

    def step(self, rids):
        out, t = [], self.layout.block_tokens
        torch.cuda._sleep(5_000_000)              # a few ms: the rows land long after the host moved on
        for rid in rids:
            pos = self.length.get(rid, 0)
            blocks = self.blocks.setdefault(rid, [])
            if pos % t == 0:
                blocks.append(self.free.pop())
            block = torch.tensor([blocks[pos // t]], device="cuda")
            data = self.layout.read(block)
            data[0, :, :, pos % t] = token_kv(rid, pos)
            self.layout.write(block, data)
            self.length[rid] = pos + 1
            out.append(self.committed(rid, pos // t, blocks[pos // t], pos % t + 1))
        return out


def restored(layout, blocks, tokens: int) -> torch.Tensor:
    data = layout.read(torch.tensor(blocks, dtype=torch.long, device="cuda"))      # [B, L, 2, T, H, D]
    return data.permute(0, 3, 1, 2, 4, 5).reshape(-1, *data.shape[1:3], *data.shape[4:])[:tokens]


def expected(rid: int, tokens: int) -> torch.Tensor:
    return torch.stack([token_kv(rid, p) for p in range(tokens)])


def fresh_blocks(counts: dict[int, int]) -> dict[int, list[int]]:
    out, nxt = {}, 3
    for rid, n in counts.items():
        out[rid] = list(range(nxt, nxt + n))
        nxt += n
    return out


@pytest.fixture
def pool_geometry():
    return geometry()


NAMES = list(LAYOUTS)


@pytest.mark.parametrize("pool_on", ["host", "cuda"])
@pytest.mark.parametrize("layout", NAMES)
def test_mirror_on_a_side_stream_then_restore_into_another_layout_is_exact(pool, layout, pool_on):
    from kvhold.executor.kv_mirror import KvMirror

    kv_pool = pool.kv if pool_on == "host" else torch.zeros_like(pool.kv, device="cuda")
    side = torch.cuda.Stream()
    engine = Engine(adapter(vllm_views(layout)[1]), side)
    assert engine.layout.layers is not None              # one view of every layer: one gather a step
    mirror = KvMirror(pool.tables, kv_pool, engine.layout, pool.lease(0))
    lengths = {31: 40, 32: 17, 33: 5}
    with torch.cuda.stream(side):             # as vLLM calls wait_for_save: its compute stream current
        for step in range(max(lengths.values())):
            assert mirror.mirror_committed(engine.step([r for r, n in lengths.items() if step < n]))
    other = NAMES[(NAMES.index(layout) + 1) % len(NAMES)]
    views = vllm_views(other)[1]
    target = adapter(views)
    blocks = fresh_blocks({31: 3, 32: 2, 33: 1})
    result = KvMirror(pool.tables, kv_pool, target, pool.lease(1)).restore(blocks, target)
    torch.cuda.synchronize()
    for rid, n in lengths.items():
        assert (result[rid].tokens_restored, result[rid].first_bad) == (n, None)
        assert torch.equal(restored(target, blocks[rid], n), expected(rid, n))
    used = {b for bs in blocks.values() for b in bs}
    untouched = torch.tensor([b for b in range(ENGINE_BLOCKS) if b not in used], device="cuda")
    assert not target.read(untouched).any()                  # a restore writes its blocks only


def writer(tables_name: str, kv_name: str, slot: int, epoch: int, layout: str) -> None:
    """Child process: decode and mirror on a side stream forever, printing each mirrored step."""
    import posix_ipc

    from kvhold.executor.kv_cache import KvCache
    from kvhold.executor.kv_mirror import KvMirror
    from kvhold.protocol.leases import Lease
    from kvhold.protocol.memory import Mapping, RegionInfo
    from kvhold.protocol.tables import Tables

    geom = geometry()
    tables = Tables.attach_name(tables_name)
    shm = posix_ipc.SharedMemory(kv_name)
    kv = KvCache.from_mapping(Mapping.from_fd(shm.fd, RegionInfo("kv", geom.kv_pool_bytes, "host", False)),
                              geom.kv, geom.num_pages).pool
    side = torch.cuda.Stream()
    engine = Engine(adapter(vllm_views(layout)[1]), side, seed=slot)
    mirror = KvMirror(tables, kv, engine.layout, Lease(tables, slot, epoch))
    with torch.cuda.stream(side):
        for step in range(1, 10**6):
            if mirror.allocator.num_free < len(RIDS) or len(engine.free) < len(RIDS):
                signal.pause()
            mirror.mirror_committed(engine.step(RIDS))
            print(step, flush=True)


@pytest.mark.parametrize("layout,kill_after", [("LBNHC", 3), ("BLHNC", 17), ("BHLNC", 40), ("LHBNC", 70)])
def test_sigkilled_writer_loses_no_published_page(pool, layout, kill_after):
    from kvhold.executor.kv_mirror import KvMirror

    lease = pool.lease(0)
    code = (f"from tests.gpu.test_gpu_vllm_blocks import writer; "
            f"writer({pool.tables_name!r}, {pool.kv_name!r}, 0, {lease.epoch}, {layout!r})")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=ROOT, env=env)
    try:
        reported = 0
        while reported < kill_after:
            line = proc.stdout.readline()
            assert line, f"the writer died on its own (exit {proc.wait()})"
            reported = int(line)
        os.kill(proc.pid, signal.SIGKILL)      # somewhere inside a later step, its copies in flight
        assert proc.wait() == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    target = adapter(vllm_views("LBHNC" if layout != "LBHNC" else "BLNHC")[1])
    blocks = fresh_blocks({rid: ENGINE_BLOCKS // 4 for rid in RIDS})
    result = KvMirror(pool.tables, pool.kv, target, pool.lease(1)).restore(blocks, target)
    for rid in RIDS:
        n = result[rid].tokens_restored
        assert n >= reported and result[rid].first_bad is None
        assert torch.equal(restored(target, blocks[rid], n), expected(rid, n))
