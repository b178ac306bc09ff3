"""GPU tests: run on a CUDA machine (the H200 via the device tool), skipped elsewhere."""
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.gpu.helpers import plan as _plan

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_zygote_preload_leaves_cuda_uninitialised_and_children_can_use_it():
    code = ("import os, torch; from kvhold.executor.zygote import preload; preload('cuda:0');"
            "assert not torch.cuda.is_initialized();"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    x = torch.ones(1024, device='cuda'); os._exit(0 if float(x.sum()) == 1024 else 3)\n"
            "_, status = os.waitpid(pid, 0); raise SystemExit(os.waitstatus_to_exitcode(status))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_sidecar_keeps_memory_alive_without_a_context():
    out = subprocess.run([sys.executable, "-m", "tools.gpu_probe_vmm", "--size-mb", "256"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout[out.stdout.index("{"):])
    assert result["sidecar_has_no_context"] and result["memory_survived_importer_kill"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_checksum_is_bit_identical_to_the_cpu_definition(dtype):
    """One mix per 64-bit word (kvhold.protocol.checksum): the compiled kernels, torch on the GPU
    and on the CPU, and the numpy reference agree on pages, ranges and slots."""
    from kvhold.executor.cuda.checksum import TritonChecksum
    from kvhold.protocol.checksum import TorchChecksum, page_checksum_np, page_words_np, to_u64, words_checksum_np

    g = torch.Generator().manual_seed(0)
    pool_cpu = torch.randn(12, 3, 2, 16, 4, 64, generator=g).to(dtype)
    pool = pool_cpu.cuda()
    ids = torch.tensor([0, 3, 5, 11, 7])
    counts = torch.tensor([16, 1, 9, 0, 15])
    triton_sums = to_u64(TritonChecksum(pool).pages(ids, counts))
    torch_gpu = to_u64(TorchChecksum(pool).pages(ids.cuda(), counts.cuda()))
    torch_cpu = to_u64(TorchChecksum(pool_cpu).pages(ids, counts))
    words = page_words_np(pool_cpu.view(torch.uint8).numpy(), 12, 3, 16)
    ref = [page_checksum_np(words[i], int(n)) for i, n in zip(ids, counts)]
    assert list(triton_sums) == list(torch_gpu) == list(torch_cpu) == ref
    starts, ends = torch.tensor([2, 0, 4, 0, 14]), torch.tensor([5, 1, 9, 0, 15])
    a = to_u64(TritonChecksum(pool).ranges(ids, starts, ends))
    b = to_u64(TorchChecksum(pool_cpu).ranges(ids, starts, ends))
    index = np.arange(words[0].size, dtype=np.uint64).reshape(words[0].shape)
    ref = [words_checksum_np(words[i][:, :, s:e], index[:, :, s:e]) for i, s, e in zip(ids, starts, ends)]
    assert list(a) == list(b) == ref
    raw, at = pool.view(torch.uint8).view(12, -1), 4 * 64 * pool.element_size() + 5     # a byte of token 1
    raw[3, at] ^= 4                                           # page 3 holds 1 token: not covered
    raw[5, at] ^= 4                                           # page 5 holds 9: caught
    after = to_u64(TritonChecksum(pool).pages(ids, counts))
    assert list(after == triton_sums) == [True, True, False, True, True]
    raw[3, at] ^= 4
    raw[5, at] ^= 4
    slots = torch.tensor([2, 0, 4, 7, 15])          # one slot each: the decode commit's fast path
    for index_dtype in (torch.int64, torch.int32):
        fast = to_u64(TritonChecksum(pool).slots(ids.cuda(), slots.to(index_dtype).cuda()))
        assert list(fast) == list(to_u64(TorchChecksum(pool_cpu).ranges(ids, slots, slots + 1)))


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
def test_paged_decode_attention_matches_a_dense_reference(dtype, atol):
    from kvhold.executor.cuda.attention import paged_decode_attention

    g = torch.Generator(device="cuda").manual_seed(1)
    pages, layers, pt, kvh, d, heads = 40, 2, 16, 4, 64, 16
    pool = torch.randn(pages, layers, 2, pt, kvh, d, device="cuda", generator=g).to(dtype)
    ctx = torch.tensor([1, 17, 64, 100], dtype=torch.int32, device="cuda")
    table = torch.zeros(4, 8, dtype=torch.int32, device="cuda")
    perm = torch.randperm(39, device="cuda", generator=g) + 1
    for b in range(4):
        n = (int(ctx[b]) + pt - 1) // pt
        table[b, :n] = perm[b * 8:b * 8 + n]
    q = torch.randn(4, heads, d, device="cuda", generator=g).to(dtype)
    out = paged_decode_attention(q, pool, 1, table, ctx, d ** -0.5)
    for b in range(4):
        n = int(ctx[b])
        blocks = pool[table[b, :(n + pt - 1) // pt].long(), 1].float()
        k = blocks[:, 0].reshape(-1, kvh, d)[:n].repeat_interleave(heads // kvh, 1)
        v = blocks[:, 1].reshape(-1, kvh, d)[:n].repeat_interleave(heads // kvh, 1)
        p = torch.softmax(torch.einsum("hd,khd->hk", q[b].float(), k) * d ** -0.5, -1)
        want = torch.einsum("hk,khd->hd", p, v)
        torch.testing.assert_close(out[b].float(), want, atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
def test_rope_in_the_attention_kernel_stores_and_attends_as_the_two_kernels_do(dtype, atol):
    from kvhold.executor.cuda.attention import paged_decode_attention, rope_decode_attention
    from kvhold.executor.cuda.kernels import rope_and_store

    g = torch.Generator(device="cuda").manual_seed(2)
    pages, layers, pt, kvh, d, heads, batch = 40, 2, 16, 4, 64, 16, 4
    pool = torch.randn(pages, layers, 2, pt, kvh, d, device="cuda", generator=g).to(dtype)
    ctx = torch.tensor([1, 17, 64, 100], dtype=torch.int32, device="cuda")
    table = torch.zeros(batch, 8, dtype=torch.int32, device="cuda")
    perm = torch.randperm(39, device="cuda", generator=g) + 1
    for b in range(batch):
        n = (int(ctx[b]) + pt - 1) // pt
        table[b, :n] = perm[b * 8:b * 8 + n]
    positions = (ctx - 1).long()
    wpages = table[torch.arange(batch, device="cuda"), (positions // pt)].long()
    wslots = positions % pt
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    angles = torch.outer(torch.arange(128, device="cuda").float(), inv)
    cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
    qkv = torch.randn(batch, (heads + 2 * kvh) * d, device="cuda", generator=g).to(dtype)
    pool_two, qkv_two = pool.clone(), qkv.clone()
    rope_and_store(qkv_two, cos, sin, positions, wpages, wslots, pool_two, 1, heads, kvh, d)
    want = paged_decode_attention(qkv_two[:, :heads * d].view(batch, heads, d), pool_two, 1, table, ctx, d ** -0.5)
    got = rope_decode_attention(qkv, cos, sin, positions, wpages, wslots, pool, 1, table, ctx, d ** -0.5, heads, kvh)
    assert torch.equal(pool, pool_two)                 # the same k and v, to the bit, in the same slots
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


@pytest.fixture(scope="module")
def tiny_on_gpu(tiny_model):
    from safetensors.torch import load_file

    from kvhold.executor.llama import LlamaModel
    from kvhold.protocol.model_spec import ModelSpec

    from tools.bench_engine_setup import load_weights

    spec = ModelSpec.from_dir(tiny_model)
    w = load_weights(tiny_model, "cuda")          # region layout: q|k|v and gate|up adjacent
    return spec, LlamaModel(spec, w, torch.float32, torch.device("cuda"), 512), \
        LlamaModel(spec, load_file(str(tiny_model / "model.safetensors")), torch.float64,
                   torch.device("cpu"), 512)


def test_cuda_runner_matches_the_cpu_reference_and_graphs_match_eager(tiny_on_gpu):
    from kvhold.executor.cuda.runner import CudaRunner
    from kvhold.executor.kv_cache import KvCache
    from kvhold.executor.step_runner import CpuRunner
    from kvhold.protocol.layout import KvGeometry

    spec, gpu_model, cpu_model = tiny_on_gpu
    geom32 = KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float32", 16)
    geom64 = KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float64", 16)
    results = {}
    for graph in (True, False):
        kv = KvCache.private(geom32, 16, "cuda")
        runner = CudaRunner(gpu_model, kv, max_batch=8, prefill_chunk=32, max_pages_per_seq=8, use_graph=graph)
        runner.prepare()
        a, b = list(range(3, 40)), list(range(100, 120))
        out1 = runner.run(_plan([(a, 0, 32, [1, 2]), (b, 0, 20, [5, 6])]))       # prefill chunks
        out2 = runner.run(_plan([(a, 32, 5, [1, 2, 3])]))                      # the rest of a
        out3 = runner.run(_plan([(a + [7], 37, 1, [1, 2, 3]), (b + [9], 20, 1, [5, 6])]))  # decode
        results[graph] = torch.cat([out1, out2, out3])
    assert torch.equal(results[True], results[False])
    kv_cpu = KvCache.private(geom64, 16)
    cpu = CpuRunner(cpu_model, kv_cpu)
    r1 = cpu.run(_plan([(a, 0, 32, [1, 2]), (b, 0, 20, [5, 6])]))
    r2 = cpu.run(_plan([(a, 32, 5, [1, 2, 3])]))
    r3 = cpu.run(_plan([(a + [7], 37, 1, [1, 2, 3]), (b + [9], 20, 1, [5, 6])]))
    want = torch.cat([r1, r2, r3]).float().cuda()
    torch.testing.assert_close(results[True], want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("tier", ["standby", "zygote"])
def test_recovery_on_the_gpu_is_token_exact(tiny_model, tmp_path, tier):
    from kvhold.client.client import wait_all
    from kvhold.testing.sidecar_process import SidecarProcess

    flags = ["--model", str(tiny_model), "--device", "cuda:0", "--backend", "cuda",
             "--max-seq-len", "512", "--max-batch", "16", "--max-batch-tokens", "256",
             "--prefill-chunk", "64", "--log-level", "INFO", "--restart-backoff-ms", "0,0"]
    if tier == "zygote":     # no standby: a child forked from the zygote takes over, graph capture deferred
        flags += ["--standbys", "0", "--zygote"]
    standbys = 1 if tier == "standby" else 0
    requests = [dict(prompt_ids=list(range(2, 2 + 20 * (i + 1))), max_tokens=48, temperature=0.8 if i % 2 else 0.0,
                     seed=i, ignore_eos=True) for i in range(6)]
    with SidecarProcess(flags, log_path=tmp_path / "sidecar.log") as sc:
        sc.wait_steady(standbys=standbys, timeout=600)
        with sc.new_client(timeout=120) as client:
            reference = [r.token_ids for r in wait_all([client.generate(**r) for r in requests])]
            for trial in range(3):
                sc.wait_steady(standbys=standbys, timeout=600)
                if tier == "zygote":
                    sc.wait_for(lambda st: (st.get("zygote") or {}).get("ready"), timeout=600)
                seen = [0]
                threshold = 30 + 40 * trial

                def on_event(stream, event):
                    seen[0] += 1
                    if seen[0] == threshold:
                        os.kill(sc.wait_steady(standbys=0)["pid"], 9)

                got = [r.token_ids for r in wait_all([client.generate(**r) for r in requests], on_event)]
                assert got == reference, f"trial {trial}"
        st = sc.status()
        recs = st["recoveries"]
        assert len(recs) == 3 and all(r["requests_lost"] == 0 for r in recs)
        if tier == "zygote":
            assert sc.executors(st, "active")[0]["via"] == "zygote"
            assert st["zygote"]["threads_at_fork"] == 1           # no BLAS pool, no NVML thread
            assert "use of fork() may lead to deadlocks" not in (tmp_path / "sidecar.log").read_text()


def test_fused_layers_use_one_gemm_per_projection_group_and_match_the_eager_layers(tiny_on_gpu):
    from kvhold.executor.kv_cache import KvCache
    from kvhold.protocol.layout import KvGeometry

    spec, gpu_model, _ = tiny_on_gpu
    assert gpu_model.fused is not None and gpu_model.fused.fused_gemms
    geom = KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float32", 16)
    t = 20
    ids = torch.arange(3, 3 + t, device="cuda")
    pos = torch.arange(t, device="cuda")
    pages, slots = (pos // 16 + 1), pos % 16
    outs, pools = [], []
    fused = gpu_model.fused
    try:
        for use in (True, False):
            gpu_model.fused = fused if use else None
            kv = KvCache.private(geom, 4, "cuda")

            def attend(layer, q):
                k, v = kv.gather(layer, torch.tensor([1, 2], device="cuda"), t, q.dtype)
                group = spec.num_heads // spec.num_kv_heads
                k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
                s = torch.einsum("qhd,khd->hqk", q, k) * spec.head_dim ** -0.5
                mask = torch.arange(t, device="cuda")[None, :] <= torch.arange(t, device="cuda")[:, None]
                return torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v)

            outs.append(gpu_model.logits(gpu_model.layers(ids, pos, pages, slots, kv, attend)))
            pools.append(kv.pool)
    finally:
        gpu_model.fused = fused
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pools[0], pools[1], atol=1e-5, rtol=1e-5)


def test_decode_step_reads_back_greedy_tokens_and_slot_hashes_equal_to_the_general_path(tiny_on_gpu):
    from kvhold.executor.cuda.checksum import TritonChecksum
    from kvhold.executor.cuda.runner import CudaRunner
    from kvhold.executor.kv_cache import KvCache
    from kvhold.executor.sampler import sample
    from kvhold.protocol.layout import KvGeometry

    spec, gpu_model, _ = tiny_on_gpu
    geom = KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float32", 16)
    kv = KvCache.private(geom, 16, "cuda")
    runner = CudaRunner(gpu_model, kv, max_batch=8, prefill_chunk=32, max_pages_per_seq=8)
    runner.prepare()
    a, b = list(range(3, 40)), list(range(100, 120))
    runner.run(_plan([(a, 0, 32, [1, 2]), (b, 0, 20, [5, 6])]))
    runner.run(_plan([(a, 32, 5, [1, 2, 3])]))
    plan = _plan([(a + [7], 37, 1, [1, 2, 3]), (b + [9], 20, 1, [5, 6])])
    plan[1].seq.sampling = dataclasses.replace(plan[1].seq.sampling, temperature=0.7)   # one row through the sampler
    tokens, hashes = runner.run_and_sample(plan, [p.seq for p in plan])
    want = sample(runner.run(plan), [p.seq for p in plan])
    assert tokens == want
    check = TritonChecksum(kv.pool)
    expect = check.ranges(torch.tensor([3, 6], device="cuda"), torch.tensor([5, 4], device="cuda"),
                          torch.tensor([6, 5], device="cuda")).tolist()
    assert hashes == {3: expect[0], 6: expect[1]}
