"""Where a decode step's GPU time goes: kernels of one step, by time, eager and graph.

    python -m tools.profile_decode --model DIR [--batches 8,64] [--layers fused,eager]

Builds the benchmark engine (tools.bench_engine_setup), decodes until every request
is in decode, then records a few steps with torch.profiler (CUPTI also sees the
kernels inside a replayed CUDA graph). Reports per step: kernel count, summed
kernel time, wall time, and the top kernels. Writes JSON (default
bench/results/decode_profile_cuda.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from tools.bench_decode import LAYERS
from tools.bench_engine_setup import admit, build_engine, load_weights


def profile_steps(args, weights, batch: int, layers: str, use_graph: bool, steps: int = 5) -> dict:
    os.environ.update(LAYERS[layers])
    engine, tables = build_engine(args.model, args.device, args.kv_pages, args.max_seq_len, max(64, batch),
                                  8192, 512, weights=weights, use_graph=use_graph)
    try:
        admit(tables, [dict(prompt_ids=list(range(3, 3 + args.prompt_len)), max_tokens=200) for _ in range(batch)])
        while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
            engine.step()
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) / steps
    finally:
        tables.unlink()
    per_name: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name].append(e.device_time if hasattr(e, "device_time") else e.cuda_time)
    total = sum(sum(v) for v in per_name.values()) / steps / 1e3
    count = sum(len(v) for v in per_name.values()) / steps
    top = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:args.top]
    return {"batch": batch, "layers": layers, "graph": use_graph, "wall_ms": wall * 1e3,
            "kernel_ms": total, "kernels_per_step": count,
            "top": [{"name": n[:120], "ms_per_step": sum(v) / steps / 1e3, "calls_per_step": len(v) / steps}
                    for n, v in top]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--batches", default="8,64")
    p.add_argument("--layers", default="fused,eager", help=f"comma-separated, of {', '.join(LAYERS)}")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--kv-pages", type=int, default=4096)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out", type=Path, default=Path("bench/results/decode_profile_cuda.json"))
    args = p.parse_args(argv)
    weights = load_weights(args.model, args.device)
    rows = []
    for layers in args.layers.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for graph in (False, True):
                r = profile_steps(args, weights, batch, layers, graph)
                rows.append(r)
                print(f"{layers:5s} batch {batch:3d} graph {graph!s:5s}: wall {r['wall_ms']:.2f} ms, kernels "
                      f"{r['kernel_ms']:.2f} ms in {r['kernels_per_step']:.0f} launches", flush=True)
                for k in r["top"][:6]:
                    print(f"    {k['ms_per_step']:7.3f} ms x{k['calls_per_step']:5.0f}  {k['name'][:90]}", flush=True)
    out = {"command": "python -m tools.profile_decode " + " ".join(argv or sys.argv[1:]),
           "device": torch.cuda.get_device_name(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
