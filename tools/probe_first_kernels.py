"""Probe: where a zygote-forked executor's first GPU work spends its time, with and
without the Triton kernels compiled ahead of time in the zygote (kvhold.executor.cuda.triton_aot).

    python -m tools.probe_first_kernels [--out bench/results/first_kernels_cuda.json]
                                        [--triton-cache DIR]

A parent imports what the zygote imports (kvhold.executor.zygote.preload, no CUDA context)
and forks children; each child times, in order, the first and second call of every
kind of GPU work a decode step does, at Llama-3-8B shapes: CUDA context creation, the
cuBLAS GEMMs, elementwise kernels, every Triton kernel (paged attention, checksum, and
the decoder layer's fused RMSNorm, RoPE + KV store and SiLU-times-up where present), and
the sampler's sort/softmax. Children, in order:

* `jit_cold_cache`: plain JIT, Triton's on-disk cache empty (a fresh directory unless
  --triton-cache names one): the first launches compile.
* `jit_warm_cache`: plain JIT, the disk cache filled by the previous child.
* `aot`: the parent first runs triton_aot.prepare (compile for the GPU's architecture
  from NVML, build the launchers, install Triton's driver; checked not to initialise
  CUDA), then forks. This child also checks that every kernel's results are
  bit-identical to a JIT launch's, that AOT and JIT use the same cubin, and that AOT
  launches can be captured in a CUDA graph and replayed. (Kernels a module has not
  wrapped with triton_aot.aot take the JIT here too.)

Writes JSON (also printed); a child that fails or hangs is reported, not fatal.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

CHILD_TIMEOUT_S = 300
B, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, PAGE_TOKENS = 64, 4096, 14336, 32, 8, 128, 16
PAGES, LAYERS, TABLE_WIDTH = 64, 2, 8


def probe_shapes():
    from kvhold.executor.cuda.kernel_shapes import KernelShapes

    return KernelShapes(dtype="bfloat16", num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
                        head_dim=HEAD_DIM, hidden_size=HIDDEN, intermediate_size=INTER, vocab_size=128256,
                        page_tokens=PAGE_TOKENS, num_pages=PAGES, max_seq_len=TABLE_WIDTH * PAGE_TOKENS,
                        max_batch=B, prefill_chunk=512)


def _timed(r: dict, name: str, fn) -> None:
    import torch

    t0 = time.monotonic()
    fn()
    torch.cuda.synchronize()
    r[name] = round((time.monotonic() - t0) * 1e3, 2)


def triton_ops(dev) -> dict:
    """name -> a call of one Triton kernel at the probe's shapes, returning what it writes.
    Repeating a call gives the same result (rope rotates q in place, but only its pool
    writes are returned, from a zeroed pool), so AOT and JIT calls can be compared."""
    import torch

    from kvhold.executor.cuda.attention import paged_decode_attention
    from kvhold.executor.cuda.checksum import TritonChecksum

    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=dev, generator=g).bfloat16()

    pool = rand(PAGES, LAYERS, 2, PAGE_TOKENS, KV_HEADS, HEAD_DIM)
    q = rand(B, HEADS, HEAD_DIM)
    table = torch.randint(1, PAGES, (B, TABLE_WIDTH), device=dev, generator=g, dtype=torch.int32)
    ctx = torch.randint(1, TABLE_WIDTH * PAGE_TOKENS + 1, (B,), device=dev, generator=g, dtype=torch.int32)
    checksum = TritonChecksum(pool)
    ids = torch.arange(1, 9, device=dev)
    counts = torch.full((8,), PAGE_TOKENS, device=dev)
    slots = torch.arange(8, device=dev) % PAGE_TOKENS
    ops = {"triton_attention": lambda: paged_decode_attention(q, pool, 1, table, ctx, HEAD_DIM ** -0.5),
           # validation's and a tail's whole pages, and a decode commit's one slot a page
           "triton_checksum": lambda: checksum.pages(ids, counts),
           "triton_checksum_slots": lambda: checksum.slots(ids, slots)}
    try:            # the decoder layer's fused kernels, where this checkout has them
        from kvhold.executor.cuda import kernels as ck
    except ImportError:
        return ops
    x, w, gate_up = rand(B, HIDDEN), rand(HIDDEN), rand(B, 2 * INTER)
    qkv, cos, sin = rand(B, (HEADS + 2 * KV_HEADS) * HEAD_DIM), rand(TABLE_WIDTH * PAGE_TOKENS, HEAD_DIM), \
        rand(TABLE_WIDTH * PAGE_TOKENS, HEAD_DIM)
    staged = torch.stack([torch.randint(0, TABLE_WIDTH * PAGE_TOKENS, (B,), device=dev, generator=g),
                          torch.arange(B, device=dev) % (PAGES - 1) + 1,      # distinct (page, slot) per
                          torch.arange(B, device=dev) // (PAGES - 1)])        # row: no racing writes
    rope_pool = torch.zeros_like(pool)

    def rope():
        rope_pool.zero_()       # so that a launch that wrote nothing would show
        ck.rope_and_store(qkv, cos, sin, staged[0], staged[1], staged[2], rope_pool, 1, HEADS, KV_HEADS, HEAD_DIM)
        return rope_pool

    ops.update(triton_rmsnorm=lambda: ck.rmsnorm(x, w, 1e-5), triton_silu_mul=lambda: ck.silu_mul(gate_up),
               triton_rope_store=rope)
    return ops


def child_probe(r: dict, check_aot: bool) -> None:
    import torch
    import torch.nn.functional as F

    from kvhold.executor.cuda import triton_aot

    dev = torch.device("cuda:0")
    _timed(r, "context", lambda: torch.empty(1, device=dev))
    x = torch.randn(B, HIDDEN, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(HIDDEN, HIDDEN, device=dev, dtype=torch.bfloat16)
    w2 = torch.randn(INTER, HIDDEN, device=dev, dtype=torch.bfloat16)
    for i in (1, 2):
        _timed(r, f"gemm_4096x4096_{i}", lambda: F.linear(x, w1))
    for i in (1, 2):
        _timed(r, f"gemm_4096x14336_{i}", lambda: F.linear(x, w2))
    for i in (1, 2):
        _timed(r, f"elementwise_{i}",
               lambda: F.silu(x) * x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True)).to(x.dtype))
    ops, out = triton_ops(dev), {}
    for name, op in ops.items():
        for i in (1, 2):
            _timed(r, f"{name}_{i}", lambda: out.__setitem__(name, op()))
    logits = torch.randn(B, 128256, device=dev)
    for i in (1, 2):
        _timed(r, f"sampler_ops_{i}", lambda: torch.sort(torch.softmax(logits, -1), -1, descending=True))
    r["triton_aot_stats"] = triton_aot.stats()
    if check_aot:
        r["aot_checks"] = aot_checks(ops, {name: t.clone() for name, t in out.items()})


def aot_checks(ops: dict, out: dict) -> dict:
    """AOT results against JIT ones, cubins compared, and a CUDA graph of AOT launches."""
    import torch

    from kvhold.executor.cuda import triton_aot
    from kvhold.executor.cuda.attention import _paged_decode_kernel

    c: dict = {}
    with triton_aot.jit_only():
        jit = {name: op().clone() for name, op in ops.items()}
    torch.cuda.synchronize()
    c["bit_identical_to_jit"] = {name: bool(torch.equal(out[name], jit[name])) for name in ops}
    c["same_cubin_as_jit"] = _same_cubins()
    graphed = ("triton_attention", "triton_checksum")
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ops["triton_attention"]()
        torch.cuda.current_stream().wait_stream(side)
        launches = _paged_decode_kernel.launches
        graph, static = torch.cuda.CUDAGraph(), {}
        with torch.cuda.graph(graph):
            for name in graphed:
                static[name] = ops[name]()
        c["graph_captured_aot_launches"] = _paged_decode_kernel.launches > launches
        for name in graphed:
            static[name].zero_()
        graph.replay()
        torch.cuda.synchronize()
        c["graph_replay_equal"] = all(torch.equal(static[name], jit[name]) for name in graphed)
    except Exception as exc:
        c["graph_error"] = f"{type(exc).__name__}: {exc}"
    return c


def _same_cubins() -> dict:
    """Per kernel: does every AOT specialization the child loaded use the very cubin the
    JIT produced for the same cache key? (Reads the JIT's per-device cache: probe only.)"""
    import torch

    from kvhold.executor.cuda import triton_aot

    result = {}
    for kernel in triton_aot._KERNELS:
        try:
            jit_cache = kernel.fn.device_caches[torch.cuda.current_device()][0]
            pairs = [(p, jit_cache.get(key)) for key, p in kernel.prepared.items() if p.functions]
            if pairs:
                result[kernel.name] = [j is not None and p.compiled.kernel == j.kernel for p, j in pairs]
        except Exception as exc:
            result[kernel.name] = f"{type(exc).__name__}: {exc}"
    return result


def cuda_initialised_here() -> bool | None:
    from kvhold.executor.cuda.triton_aot import cuda_driver_initialised

    return cuda_driver_initialised()


def fork_and_probe(check_aot: bool = False) -> dict:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        result: dict = {}
        try:
            child_probe(result, check_aot)
        except BaseException:  # report, do not hang the parent
            result["error"] = traceback.format_exc(limit=8)
        os.write(w, json.dumps(result).encode())
        os._exit(0)
    os.close(w)
    data, deadline = b"", time.monotonic() + CHILD_TIMEOUT_S
    while True:
        if not select.select([r], [], [], max(0.0, deadline - time.monotonic()))[0]:
            os.kill(pid, signal.SIGKILL)
            data = json.dumps({"error": f"no answer within {CHILD_TIMEOUT_S} s; killed"}).encode()
            break
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    try:
        out = json.loads(data)
    except json.JSONDecodeError:
        out = {"error": f"unreadable answer; exit status {os.waitstatus_to_exitcode(status)}"}
    return out


def summary(result: dict) -> dict:
    """First-call times (ms) of the context and of every Triton kernel, per child."""
    children = ("jit_cold_cache", "jit_warm_cache", "aot")
    names = sorted({k for v in children for k in result.get(v, {})
                    if k == "context" or (k.startswith("triton_") and k.endswith("_1"))})
    return {name: {v: result.get(v, {}).get(name) for v in children} for name in names}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/first_kernels_cuda.json"))
    p.add_argument("--triton-cache", help="Triton's cache directory (default: a fresh, empty one)")
    args = p.parse_args(argv)
    cache = args.triton_cache or tempfile.mkdtemp(prefix="kvhold-triton-cache-")
    os.environ["TRITON_CACHE_DIR"] = cache          # before anything imports triton
    from kvhold.executor.zygote import preload

    command = " ".join(["python -m tools.probe_first_kernels", *(sys.argv[1:] if argv is None else argv)])
    result = {"command": command,
              "triton_cache_dir": cache, "preload_ms": round(preload("cuda:0"), 1),
              "cuda_initialised_after_preload": cuda_initialised_here()}
    import torch
    import triton

    result.update(torch=torch.__version__, triton=triton.__version__)
    result["jit_cold_cache"] = fork_and_probe()
    result["jit_warm_cache"] = fork_and_probe()
    from kvhold.executor.cuda import triton_aot

    t0 = time.monotonic()
    result["aot_prepare"] = triton_aot.prepare(probe_shapes())
    result["aot_prepare_wall_ms"] = round((time.monotonic() - t0) * 1e3, 1)
    result["cuda_initialised_after_aot_prepare"] = cuda_initialised_here() or torch.cuda.is_initialized()
    if result["cuda_initialised_after_aot_prepare"]:
        result["aot"] = {"error": "CUDA initialised in the parent: a forked child could not use it"}
    else:
        result["aot"] = fork_and_probe(check_aot=True)
    result["summary_ms"] = summary(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
