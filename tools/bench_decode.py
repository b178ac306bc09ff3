"""Benchmark: steady-state decode throughput, with the commit protocol on and off.

    python -m tools.bench_decode --model DIR --device cuda:0 [--batches 1,8,64]

For each batch size B: admit B requests (short prompts, long outputs) to two engines,
one with the full commit protocol (KV page checksums, seqlock publish, journal) and one
with commit off (the engine only keeps tokens in memory), run until all decode, then
time windows of N decode steps on each in turn (--rounds each; the median window is
the step time, and the commit's cost is the on windows' total over the off windows'). Decode runs padded to --max-batch rows (64, as a server sized for 64
streams runs; 0 pads only to B). `--layers` picks the layer implementations: `fused`
(kvhold.executor.cuda.layers with kvhold.executor.cuda.gemm's projections, what executors run),
`fused-cublas` (the same with cuBLAS projections) and `eager` (the unfused composition). Also measures the
device's copy bandwidth and reports each step time against the memory-bandwidth
floor: weight bytes / copy bandwidth. Writes JSON under bench/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
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


LAYERS = {"fused": {"KVHOLD_FUSED": "1", "KVHOLD_SKINNY_GEMM": "1"},      # what executors run
          "fused-cublas": {"KVHOLD_FUSED": "1", "KVHOLD_SKINNY_GEMM": "0"},  # fused, projections on cuBLAS
          "eager": {"KVHOLD_FUSED": "0", "KVHOLD_SKINNY_GEMM": "0"}}         # the unfused composition


def decoding_engine(args, weights, batch: int, commit: bool):
    """An engine with `batch` requests admitted, prefilled and decoding."""
    engine, tables = build_engine(args.model, args.device, args.kv_pages, args.max_seq_len,
                                  max(args.max_batch, batch) if args.max_batch else batch,
                                  8192, 512, commit=commit, weights=weights)
    admit(tables, [dict(prompt_ids=list(range(3, 3 + args.prompt_len)), max_tokens=args.steps * (args.rounds + 3))
                   for _ in range(batch)])
    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()
    return engine, tables


def time_steps(engine, steps: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps


def measure(args, weights, batch: int, layers: str) -> list[dict]:
    """Commit on and off, timed in alternating windows of --steps steps (--rounds each): the
    median window of each. Both engines live side by side, so drift hits both alike."""
    os.environ.update(LAYERS[layers])
    engines = {commit: decoding_engine(args, weights, batch, commit) for commit in (True, False)}
    windows = {True: [], False: []}
    try:
        for _ in range(args.rounds):
            for commit, (engine, _) in engines.items():
                windows[commit].append(time_steps(engine, args.steps))
    finally:
        for _, tables in engines.values():
            tables.unlink()
    rows = []
    for commit in (True, False):
        dt = statistics.median(windows[commit])
        rows.append({"batch": batch, "commit": commit, "layers": layers, "step_ms": dt * 1e3,
                     "tokens_per_s": batch / dt, "window_ms": [round(w * 1e3, 4) for w in windows[commit]],
                     "max_batch": engines[commit][0].runner.max_batch})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--layers", default="fused,fused-cublas,eager",
                   help=f"comma-separated, of {', '.join(LAYERS)}")
    p.add_argument("--steps", type=int, default=50, help="steps per timed window")
    p.add_argument("--rounds", type=int, default=3, help="timed windows per engine, commit on and off alternating")
    p.add_argument("--max-batch", type=int, default=64,
                   help="decode rows the engine pads to (at least the batch); 0: each batch's own size")
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
            for r in measure(args, weights, batch, layers):
                rows.append(r)
                commit = r["commit"]
                print(f"{layers:5s} batch {batch:3d} commit {'on ' if commit else 'off'}: {r['step_ms']:7.2f} "
                      f"ms/step, {r['tokens_per_s']:9.1f} tok/s ({r['step_ms'] / floor_ms:.2f}x the floor)",
                      flush=True)
                r["floor_ratio"] = r["step_ms"] / floor_ms
            on, off = rows[-2], rows[-1]
            # windows run in pairs (on, then off, round after round) while the contexts grow: the
            # overhead is the total time of the on windows over that of the off windows
            on["commit_overhead_pct"] = 100 * (sum(on["window_ms"]) / sum(off["window_ms"]) - 1)
            on["commit_overhead_pct_by_round"] = [round(100 * (a / b - 1), 2)
                                                  for a, b in zip(on["window_ms"], off["window_ms"])]
            print(f"      commit overhead {on['commit_overhead_pct']:.1f}% (by round "
                  f"{on['commit_overhead_pct_by_round']})", flush=True)
    result = {"command": "python -m tools.bench_decode " + " ".join(argv or sys.argv[1:]),
              "device": torch.cuda.get_device_name(), "weight_bytes": weight_bytes,
              "copy_bandwidth_bytes_per_s": bw, "floor_ms": floor_ms,
              "floor_without_embedding_ms": read_floor_ms,
              # the kernel switches the environment sets (kvhold.executor.cuda.gemm), as run
              "environment": {k: os.environ[k] for k in ("KVHOLD_WIDE_DECODE_TILES", "KVHOLD_SKINNY_GEMM")
                              if k in os.environ},
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"floor {floor_ms:.2f} ms/step ({weight_bytes / 2**30:.1f} GiB at {bw / 1e12:.2f} TB/s); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
