"""Probe: what the takeover's validation pass costs on the GPU, and what bounds it.

    python -m tools.probe_checksum --pages 5700            # Llama-3-8B page shapes
    python -m tools.probe_checksum --pages 5700 --out bench/results/checksum_cuda.json

Times, with CUDA events (median of --repeat runs after a warm-up), the checksum of
`--pages` full KV pages at a model's page shape (default Llama-3-8B: 32 layers x K/V x 16
tokens x 8 KV heads x 128 dims, bf16: 2 MiB a page), picked at random from a pool of
`--pool-pages`:

* `served`: the kernel kvhold validates with (kvhold.executor.cuda_checksum.TritonChecksum);
* `read`: the same pages only read and summed, no hashing: the bandwidth floor of the pass;
* the served kernel's tiling swept (its block of words, splits per page, warps), each
  checked to give the served kernel's bits on every page;
* `pair64`: a cheaper definition for comparison (one splitmix64 per aligned 64-bit word
  instead of one per 32-bit word), not what kvhold computes.

Writes JSON: per kernel the median milliseconds, GB/s over the pages' bytes, and whether its
checksums equal the served kernel's.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from kvhold.executor.cuda_checksum import TritonChecksum, _pages_hash_kernel
from kvhold.protocol.checksum import C1, C2, SEED


@triton.jit
def _mix(x, C1: tl.constexpr, C2: tl.constexpr):
    x = (x ^ (x >> 30)) * C1
    x = (x ^ (x >> 27)) * C2
    return x ^ (x >> 31)


@triton.jit
def _pages_pair_kernel(dwords_ptr, pages_ptr, out_ptr, page_dwords: tl.constexpr, SPLIT: tl.constexpr,
                       SEED: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, BLOCK: tl.constexpr):
    """A different definition, for comparison: one mix per 64-bit word (index in the high half)."""
    i = tl.program_id(0)
    s = tl.program_id(1)
    page = tl.load(pages_ptr + i).to(tl.int64)
    base = dwords_ptr + page * page_dwords
    acc = tl.zeros([BLOCK], dtype=tl.uint64)
    for k in range(0, page_dwords // (SPLIT * BLOCK)):
        offs = (k * SPLIT + s) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(base + offs).to(tl.uint64, bitcast=True)
        x = _mix(v ^ (offs.to(tl.uint64) << 40) ^ SEED, C1, C2)
        acc += x
    tl.store(out_ptr + i * SPLIT + s, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))


@triton.jit
def _pages_read_kernel(dwords_ptr, pages_ptr, out_ptr, page_dwords: tl.constexpr, SPLIT: tl.constexpr,
                       BLOCK: tl.constexpr):
    """The floor: read every byte of the pages once and add them up, no hashing."""
    i = tl.program_id(0)
    s = tl.program_id(1)
    page = tl.load(pages_ptr + i).to(tl.int64)
    base = dwords_ptr + page * page_dwords
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    for k in range(0, page_dwords // (SPLIT * BLOCK)):
        acc += tl.load(base + (k * SPLIT + s) * BLOCK + tl.arange(0, BLOCK))
    tl.store(out_ptr + i * SPLIT + s, tl.sum(acc, axis=0))


def time_ms(fn, repeat: int) -> tuple[float, list[float]]:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2], times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=5700, help="pages checksummed per pass (default 5700)")
    ap.add_argument("--pool-pages", type=int, default=6144, help="pages in the pool (default 6144)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--partial", type=float, default=0.01,
                    help="share of pages only partly filled, as tails are (default 0.01)")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--out", default="bench/results/checksum_cuda.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_checksum needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    shape = (args.pool_pages, args.layers, 2, args.page_tokens, args.kv_heads, args.head_dim)
    pool = torch.empty(shape, dtype=torch.bfloat16, device=dev)
    pool.view(torch.int16).random_(-32768, 32767)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randperm(args.pool_pages - 1, generator=gen)[:args.pages] + 1
    counts = torch.full((args.pages,), args.page_tokens, dtype=torch.int64)
    partial = torch.rand(args.pages, generator=gen) < args.partial
    counts[partial] = torch.randint(1, args.page_tokens, (int(partial.sum()),), generator=gen)
    ids_d, counts_d = ids.to(dev), counts.to(dev)
    page_bytes = pool[0].numel() * pool.element_size()
    committed_bytes = int((counts * page_bytes // args.page_tokens).sum())
    served = TritonChecksum(pool)
    words = served.words
    dwords = pool.reshape(args.pool_pages, -1).view(torch.int64)
    page_words = words.shape[1]
    row_words = page_words // (args.layers * 2 * args.page_tokens)
    reference = served.pages(ids_d, counts_d)
    rows = []

    def record(name: str, fn, check=None, bytes_=committed_bytes, note: str = "") -> None:
        ms, times = time_ms(fn, args.repeat)
        same = None if check is None else bool(torch.equal(check(), reference))
        rows.append(dict(kernel=name, median_ms=round(ms, 4), min_ms=round(min(times), 4),
                         gb_per_s=round(bytes_ / ms / 1e6, 1), same_bits_as_served=same, note=note))
        print(f"{name:34s} {ms:8.3f} ms  {bytes_ / ms / 1e6:8.1f} GB/s  same bits: {same}", flush=True)

    record("served", lambda: served.pages(ids_d, counts_d), note="TritonChecksum.pages, as validation runs it")
    for block, split, warps in ((1024, 1, 4), (2048, 2, 8), (2048, 4, 8), (4096, 4, 8), (1024, 8, 4),
                                (2048, 8, 8), (4096, 8, 16)):
        out = torch.empty((args.pages, split), dtype=torch.int64, device=dev)

        def loop(block=block, split=split, warps=warps, out=out):
            _pages_hash_kernel[(args.pages, split)](
                words, ids_d, counts_d, out, page_words, ROW_WORDS=row_words, PAGE_TOKENS=args.page_tokens,
                N_LKV=args.layers * 2, SPLIT=split, SEED=SEED, C1=C1, C2=C2, BLOCK=block, num_warps=warps)
            return out.sum(dim=1)
        record(f"loop block={block} split={split} warps={warps}", loop, check=loop)
    full_bytes = args.pages * page_bytes
    for block, split, warps in ((1024, 4, 4), (2048, 4, 8)):
        out = torch.empty((args.pages, split), dtype=torch.int64, device=dev)

        def pair(block=block, split=split, warps=warps, out=out):
            _pages_pair_kernel[(args.pages, split)](dwords, ids_d, out, dwords.shape[1], SPLIT=split,
                                                    SEED=SEED, C1=C1, C2=C2, BLOCK=block, num_warps=warps)
            return out.sum(dim=1)
        record(f"pair64 block={block} split={split}", pair, bytes_=full_bytes,
               note="another definition (whole pages): one mix per 64-bit word")
        out2 = torch.empty((args.pages, split), dtype=torch.int64, device=dev)

        def read(block=block, split=split, warps=warps, out=out2):
            _pages_read_kernel[(args.pages, split)](dwords, ids_d, out, dwords.shape[1], SPLIT=split,
                                                    BLOCK=block, num_warps=warps)
            return out.sum(dim=1)
        record(f"read block={block} split={split}", read, bytes_=full_bytes, note="read and add, no hash")
    doc = dict(command="python -m tools.probe_checksum " + " ".join(argv if argv is not None else sys.argv[1:]),
               machine=dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                            triton=triton.__version__, host=platform.node()),
               when=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               pages=args.pages, page_bytes=page_bytes, committed_bytes=committed_bytes,
               partial_pages=int(partial.sum()), rows=rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
