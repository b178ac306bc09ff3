"""Probe: where a zygote-forked executor's first GPU work spends its time.

    python -m tools.probe_first_kernels [--out bench/results/first_kernels_cuda.json]

A parent imports what the zygote imports (executor.zygote.preload, no CUDA context)
and forks children; each child times, in order, the first and second call of every
kind of GPU work a decode step does, at Llama-3-8B shapes: CUDA context creation,
the cuBLAS GEMMs, elementwise kernels, the Triton paged-attention and checksum
kernels, and the sampler's sort/softmax. Variant `triton_driver_in_parent` also
initialises Triton's driver object in the parent first (and checks that this did
not initialise CUDA there), to see whether that part of the first-call cost can
move into the zygote. Writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _timed(results: dict, name: str, fn) -> None:
    import torch

    t0 = time.monotonic()
    fn()
    torch.cuda.synchronize()
    results[name] = round((time.monotonic() - t0) * 1e3, 2)


def child_probe() -> dict:
    import torch
    import torch.nn.functional as F

    from executor.cuda_attention import paged_decode_attention
    from executor.cuda_checksum import TritonChecksum

    r: dict = {}
    dev = torch.device("cuda:0")
    _timed(r, "context", lambda: torch.empty(1, device=dev))
    b, hidden, inter, heads, kvh, d, pt = 64, 4096, 14336, 32, 8, 128, 16
    x = torch.randn(b, hidden, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(hidden, hidden, device=dev, dtype=torch.bfloat16)
    w2 = torch.randn(inter, hidden, device=dev, dtype=torch.bfloat16)
    for i in (1, 2):
        _timed(r, f"gemm_4096x4096_{i}", lambda: F.linear(x, w1))
    for i in (1, 2):
        _timed(r, f"gemm_4096x14336_{i}", lambda: F.linear(x, w2))
    for i in (1, 2):
        _timed(r, f"elementwise_{i}", lambda: F.silu(x) * x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True)).to(x.dtype))
    pages, layers = 64, 2
    pool = torch.zeros(pages, layers, 2, pt, kvh, d, device=dev, dtype=torch.bfloat16)
    q = torch.randn(b, heads, d, device=dev, dtype=torch.bfloat16)
    table = torch.zeros(b, 8, device=dev, dtype=torch.int32)
    ctx = torch.ones(b, device=dev, dtype=torch.int32)
    for i in (1, 2):
        _timed(r, f"triton_attention_{i}", lambda: paged_decode_attention(q, pool, 0, table, ctx, d ** -0.5))
    checksum = TritonChecksum(pool)
    ids = torch.arange(1, 9, device=dev)
    counts = torch.full((8,), pt, device=dev)
    for i in (1, 2):
        _timed(r, f"triton_checksum_{i}", lambda: checksum.pages(ids, counts))
    logits = torch.randn(b, 128256, device=dev)
    for i in (1, 2):
        _timed(r, f"sampler_ops_{i}", lambda: torch.sort(torch.softmax(logits, -1), -1, descending=True))
    return r


def cuda_initialised_here() -> bool | None:
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    err, _ = driver.cuCtxGetCurrent()
    return err != driver.CUresult.CUDA_ERROR_NOT_INITIALIZED


def fork_and_probe() -> dict:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = json.dumps(child_probe()).encode()
        except Exception as exc:  # report, do not hang the parent
            out = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
        os.write(w, out)
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.waitpid(pid, 0)
    return json.loads(data)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/first_kernels_cuda.json"))
    args = p.parse_args(argv)
    from executor.zygote import preload

    result = {"command": "python -m tools.probe_first_kernels", "preload_ms": preload("cuda:0"),
              "cuda_initialised_after_preload": cuda_initialised_here()}
    result["zygote_child"] = fork_and_probe()
    import triton

    t0 = time.monotonic()
    try:
        triton.runtime.driver.active.get_current_target()
        result["triton_driver_in_parent_ms"] = round((time.monotonic() - t0) * 1e3, 2)
    except Exception as exc:
        result["triton_driver_in_parent_error"] = f"{type(exc).__name__}: {exc}"
    result["cuda_initialised_after_triton_driver"] = cuda_initialised_here()
    if not result["cuda_initialised_after_triton_driver"]:
        result["zygote_child_with_triton_driver"] = fork_and_probe()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
