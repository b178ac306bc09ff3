"""Benchmark: what the vLLM bridge's KV mirror adds to a step on a GPU, per vLLM KV cache layout.

    python -m tools.bench_vllm_mirror --device cuda:0 [--batches 8,64,256] [--out FILE]

vLLM 0.32 hands the connector each layer's cache as a [blocks, kv_heads, tokens, key and value]
view strided by its KVCacheLayout; the bridge reads it through `VllmAttentionBlocks`
(kvhold.vllm_bridge.connector). No vLLM build runs here: the caches are allocated and viewed as
vLLM's GPU model runner does (tests/vllm_bridge checks the views against vLLM's own code), at
Llama-3-8B's KV shapes (32 layers, 8 KV heads of 128, bf16, 16-token blocks), and kvhold's pool is
on the same GPU (the sidecar's device memory: device-to-device copies).

For each layout and batch B, `--steps` decode steps: B requests each commit one new token row
(one new block every 16 steps), and `KvMirror.mirror_committed` runs as `wait_for_save` runs it
after vLLM's forward: gather the rows from vLLM's blocks, scatter them into kvhold pages, hash
them, wait for the copy, publish (count, checksum) under the seqlock. What the step waits for
is that call's wall time (the host blocks until the copy has landed, then publishes): its
median and P99 are reported, and a prefill: one request committing `--prefill-tokens` rows.

The step the mirror is weighed against: a decode step of the same shapes on this GPU, read from
`--reference` (bench/results/decode_cuda.json, kvhold's own engine; vLLM's own step could not
be run), and the weights-only floor recorded there. Afterwards every mirrored page is compared
with its vLLM block, byte for byte, and with its published checksum.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvhold.executor.kv_mirror import Committed, KvMirror
from kvhold.protocol.checksum import to_u64
from kvhold.protocol.layout import KvGeometry, TableGeometry
from kvhold.protocol.leases import Lease
from kvhold.protocol.tables import Tables
from kvhold.vllm_bridge.connector import VllmAttentionBlocks

# vLLM's KVCacheLayout: each member's stride permutation of the logical [L, B, H, N, C]
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


def vllm_caches(kv: KvGeometry, blocks: int, layout: str, device) -> list[torch.Tensor]:
    shape = (kv.num_layers, blocks, kv.num_kv_heads, kv.page_tokens, 2 * kv.head_dim)
    strides, size = [0] * 5, 1
    for dim in reversed(LAYOUTS[layout]):
        strides[dim], size = size, size * shape[dim]
    raw = torch.empty(size, dtype=torch.bfloat16, device=device).normal_()
    view = raw.as_strided(shape, strides)
    return [view[i] for i in range(kv.num_layers)]


def pct(values, q):
    return float(np.percentile(np.asarray(values), q))


def run_layout(args, kv: KvGeometry, layout: str, batch: int, device) -> dict:
    geometry = TableGeometry(kv=kv, num_pages=args.pages, num_slots=max(batch, 1) + 1, max_seq_len=4096,
                             num_leases=2)
    name = f"/kvhold-bench-vllm-mirror-{os.getpid()}"
    tables = Tables.create(name, geometry, 1)
    try:
        tables.leases["epoch"][0] = tables.next_epoch()
        lease = Lease(tables, 0, int(tables.leases["epoch"][0]))
        pool = torch.zeros((args.pages, kv.num_layers, 2, kv.page_tokens, kv.num_kv_heads, kv.head_dim),
                           dtype=torch.bfloat16, device=device)
        layout_obj = VllmAttentionBlocks(vllm_caches(kv, args.blocks, layout, device), kv.num_kv_heads,
                                         kv.head_dim, kv.page_tokens)
        mirror = KvMirror(tables, pool, layout_obj, lease)
        mirror.warm_up()
        rng = np.random.default_rng(batch)
        free = list(rng.permutation(args.blocks))
        blocks: dict[int, list[int]] = {}
        times = []
        for step in range(args.warm + args.steps):
            work = []
            for rid in range(1, batch + 1):
                owned = blocks.setdefault(rid, [])
                if step % kv.page_tokens == 0:
                    owned.append(int(free.pop()))
                work.append(Committed(rid, step // kv.page_tokens, owned[-1], step % kv.page_tokens + 1))
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            mirror.mirror_committed(work)
            if step >= args.warm:
                times.append((time.perf_counter() - t0) * 1e3)
        # a prefill: one request commits a whole prompt's rows in one step
        rid, n = batch + 1, args.prefill_tokens
        owned = [int(free.pop()) for _ in range(-(-n // kv.page_tokens))]
        work = [Committed(rid, i, b, min(kv.page_tokens, n - i * kv.page_tokens)) for i, b in enumerate(owned)]
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        mirror.mirror_committed(work)
        prefill_ms = (time.perf_counter() - t0) * 1e3
        block_of = {(r, i): b for r, owned_blocks in blocks.items() for i, b in enumerate(owned_blocks)}
        block_of.update({(rid, i): b for i, b in enumerate(owned)})
        check = verify(mirror, block_of)
        return dict(layout=layout, batch=batch, steps=len(times), mirror_ms_p50=statistics.median(times),
                    mirror_ms_p99=pct(times, 99), mirror_ms_mean=statistics.fmean(times),
                    prefill_tokens=n, prefill_mirror_ms=prefill_ms, check=check)
    finally:
        tables.unlink()


def verify(mirror: KvMirror, block_of: dict[tuple[int, int], int]) -> dict:
    """Every held page: its published rows equal its vLLM block's, bit for bit, and the checksum
    published in the page table is the checksum of those rows."""
    items = [(page, block_of[rid, index], count) for rid, index, page, count in mirror.holdings()]
    table = mirror.page_table.snapshot()
    dev = mirror.pool.device
    bytes_ok, sums_ok = True, True
    for i in range(0, len(items), 64):
        pages, blks, counts = (torch.tensor(c, dtype=torch.long, device=dev) for c in zip(*items[i:i + 64]))
        rows = torch.arange(mirror.page_tokens, device=dev)[None, :] < counts[:, None]       # [N, T]
        mirrored, theirs = (x.flatten(4).contiguous().view(torch.uint8)                  # bits, not values
                            for x in (mirror.pool[pages], mirror.layout.read(blks)))
        differ = (mirrored != theirs).any(-1).any(2).any(1)
        bytes_ok &= not bool((differ & rows).any())
        sums = to_u64(mirror.checksum.pages(pages, counts))
        sums_ok &= bool((sums == table["checksum"][pages.cpu().numpy()]).all())
    return dict(pages=len(items), bytes_match=bytes_ok, checksums_match=sums_ok)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--batches", default="8,64,256", help="decode batch sizes (default 8,64,256)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="vLLM KVCacheLayout names (default: all six)")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per layout and batch")
    p.add_argument("--warm", type=int, default=8, help="untimed steps first")
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--blocks", type=int, default=6144, help="vLLM blocks allocated (Llama-3-8B: 2 MiB each)")
    p.add_argument("--pages", type=int, default=6144, help="kvhold pages on the GPU")
    p.add_argument("--reference", type=Path, default=Path("bench/results/decode_cuda.json"),
                   help="the decode step weighed against (kvhold's engine, same shapes and GPU)")
    p.add_argument("--out", type=Path, default=None, help="write JSON here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        p.error("needs a CUDA device (--device cuda:N)")
    kv = KvGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_tokens=16)
    reference = json.loads(args.reference.read_text()) if args.reference.exists() else None
    steps = {r["batch"]: r["step_ms"] for r in (reference or {}).get("rows", []) if not r.get("commit")}
    result = dict(command="python -m tools.bench_vllm_mirror " + " ".join(sys.argv[1:] if argv is None else argv),
                  device=torch.cuda.get_device_name(device), torch=torch.__version__, host=platform.node(),
                  kv_shapes=dict(layers=32, kv_heads=8, head_dim=128, dtype="bfloat16", block_tokens=16),
                  reference=dict(file=str(args.reference), decode_step_ms_by_batch=steps,
                                 floor_ms=(reference or {}).get("floor_ms")),
                  rows=[])
    for batch in [int(b) for b in args.batches.split(",")]:
        for layout in args.layouts.split(","):
            row = run_layout(args, kv, layout, batch, device)
            if batch in steps:
                row["of_reference_step_pct"] = 100 * row["mirror_ms_p50"] / steps[batch]
            result["rows"].append(row)
            print(f"{layout} batch {batch}: mirror P50 {row['mirror_ms_p50']:.3f} ms P99 {row['mirror_ms_p99']:.3f} ms"
                  f" ({row.get('of_reference_step_pct', float('nan')):.1f}% of the step), prefill "
                  f"{row['prefill_tokens']} tokens {row['prefill_mirror_ms']:.2f} ms, check {row['check']}",
                  flush=True)
            if args.out:
                args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(r["check"]["bytes_match"] and r["check"]["checksums_match"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
