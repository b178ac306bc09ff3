"""Benchmark: steady-state decode throughput, with the commit protocol on and off.

    python -m tools.bench_decode --model DIR --device cuda:0 [--batches 1,8,64]

For each batch size B: admit B requests (short prompts, long outputs), run until all
decode, then time N decode steps with the full commit protocol (KV page checksums,
seqlock publish, journal) and again with commit off (the engine only keeps tokens in
memory). `--layers fused,eager` measures both the fused CUDA layers
(executor.cuda_layers) and the eager composition they replace. Also measures the
device's copy bandwidth and reports each step time against the memory-bandwidth
floor: weight bytes / copy bandwidth. Writes JSON under bench/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from tools.bench_engine_setup import admit, build_engine, load_weights


def copy_bandwidth(device: str, nbytes: int = 4 << 30) -> float:
    """Bytes moved (read + written) per second by a device-to-device copy."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (time.perf_counter() - t)


def measure(args, weights, batch: int, commit: bool, layers: str) -> dict:
    os.environ["KVHOLD_FUSED"] = "1" if layers == "fused" else "0"
    engine, tables = build_engine(args.model, args.device, args.kv_pages, args.max_seq_len, max(64, batch),
                                  8192, 512, commit=commit, weights=weights)
    try:
        admit(tables, [dict(prompt_ids=list(range(3, 3 + args.prompt_len)), max_tokens=args.steps * 3)
                       for _ in range(batch)])
        while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
            engine.step()
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / args.steps
    finally:
        tables.unlink()
    return {"batch": batch, "commit": commit, "layers": layers, "step_ms": dt * 1e3, "tokens_per_s": batch / dt}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--layers", default="fused,eager", help="fused, eager, or both (comma-separated)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--kv-pages", type=int, default=4096)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--out", type=Path, default=Path("bench/results/decode_cuda.json"))
    args = p.parse_args(argv)
    weights = load_weights(args.model, args.device)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    bw = copy_bandwidth(args.device)
    floor_ms = weight_bytes / bw * 1e3
    embed = weights["model.embed_tokens.weight"]      # a decode step reads B rows of it, not all
    read_floor_ms = (weight_bytes - embed.numel() * embed.element_size()) / bw * 1e3
    rows = []
    for layers in args.layers.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for commit in (True, False):
                rows.append(measure(args, weights, batch, commit, layers))
                r = rows[-1]
                print(f"{layers:5s} batch {batch:3d} commit {'on ' if commit else 'off'}: {r['step_ms']:7.2f} "
                      f"ms/step, {r['tokens_per_s']:9.1f} tok/s ({r['step_ms'] / floor_ms:.2f}x the floor)",
                      flush=True)
                r["floor_ratio"] = r["step_ms"] / floor_ms
            on, off = rows[-2], rows[-1]
            on["commit_overhead_pct"] = 100 * (on["step_ms"] / off["step_ms"] - 1)
            print(f"      commit overhead {on['commit_overhead_pct']:.1f}%", flush=True)
    result = {"command": "python -m tools.bench_decode " + " ".join(argv or sys.argv[1:]),
              "device": torch.cuda.get_device_name(), "weight_bytes": weight_bytes,
              "copy_bandwidth_bytes_per_s": bw, "floor_ms": floor_ms,
              "floor_without_embedding_ms": read_floor_ms, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"floor {floor_ms:.2f} ms/step ({weight_bytes / 2**30:.1f} GiB at {bw / 1e12:.2f} TB/s); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
