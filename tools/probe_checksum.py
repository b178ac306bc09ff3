"""Probe: what the takeover's validation pass costs on the GPU, and what bounds it.

    python -m tools.probe_checksum --pages 5700            # Llama-3-8B page shapes
    python -m tools.probe_checksum --pages 5700 --out bench/results/checksum_cuda.json

Times, with CUDA events (median of --repeat runs after a warm-up), the checksum of
`--pages` full KV pages at a model's page shape (default Llama-3-8B: 32 layers x K/V x 16
tokens x 8 KV heads x 128 dims, bf16: 2 MiB a page), picked at random from a pool of
`--pool-pages`:

* `served`: the kernel kvhold validates with (kvhold.executor.cuda.checksum.TritonChecksum:
  one splitmix64 mix per 64-bit word, kvhold.protocol.checksum);
* `read`: the same pages only read and summed, no hashing: the bandwidth floor of the pass;
* the served kernel's tiling swept (its block of 64-bit words, splits per page, warps),
  each checked to give the served kernel's bits on every page;
* `old32`: the previous definition (one mix per 32-bit word, its index in the high half),
  kept for the before/after comparison and not what kvhold computes; its bits are checked
  against a numpy transcription of that definition on a few pages (`old32_reference_ok`).

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

import numpy as np
import torch
import triton
import triton.language as tl

from kvhold.executor.cuda.checksum import TritonChecksum, _pages_hash_kernel
from kvhold.protocol.checksum import C1, C2, SEED, mix_np, to_u64


@triton.jit
def _pages_hash32_kernel(words_ptr, pages_ptr, counts_ptr, out_ptr, page_words,
                         ROW_WORDS: tl.constexpr, PAGE_TOKENS: tl.constexpr, N_LKV: tl.constexpr,
                         SPLIT: tl.constexpr, SEED: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
                         BLOCK: tl.constexpr):
    """The previous definition, for comparison: mix(w | i << 32) over 32-bit words w (i their
    index in 32-bit words), the served kernel's loop otherwise (words, rows and blocks in 32-bit
    units). Not what kvhold computes."""
    i = tl.program_id(0)
    s = tl.program_id(1)
    page = tl.load(pages_ptr + i).to(tl.int64)
    span = tl.load(counts_ptr + i).to(tl.int32) * ROW_WORDS
    base = words_ptr + page * page_words
    acc = tl.zeros([BLOCK], dtype=tl.uint64)
    for lkv in range(0, N_LKV):
        for k in range(0, tl.cdiv(PAGE_TOKENS * ROW_WORDS, SPLIT * BLOCK)):
            offs = (k * SPLIT + s) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < span
            widx = lkv * (PAGE_TOKENS * ROW_WORDS) + offs
            w = tl.load(base + widx, mask=mask, other=0)
            x = w.to(tl.uint32, bitcast=True).to(tl.uint64) | (widx.to(tl.uint64) << 32)
            x = x ^ SEED
            x = (x ^ (x >> 30)) * C1
            x = (x ^ (x >> 27)) * C2
            x = x ^ (x >> 31)
            acc += tl.where(mask, x, tl.zeros_like(x))
    tl.store(out_ptr + i * SPLIT + s, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))


def old32_reference_np(page_words32: np.ndarray, num_tokens: int) -> int:
    """The previous definition in numpy: page_words32 is a uint32 view [layers, 2, tokens, W]."""
    index = np.arange(page_words32.size, dtype=np.uint64).reshape(page_words32.shape)
    x = page_words32[:, :, :num_tokens].astype(np.uint64) | (index[:, :, :num_tokens] << np.uint64(32))
    with np.errstate(over="ignore"):
        return int(mix_np(x).sum(dtype=np.uint64))


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
    words = served.words                                      # int64: the definition's words
    page_words, row_words = served.page_words, served.row_words
    words32 = pool.reshape(args.pool_pages, -1).view(torch.int32)
    page_words32, row_words32 = words32.shape[1], 2 * row_words
    reference = served.pages(ids_d, counts_d)
    rows = []

    def record(name: str, fn, check=None, bytes_=committed_bytes, note: str = "") -> None:
        ms, times = time_ms(fn, args.repeat)
        same = None if check is None else bool(torch.equal(check(), reference))
        rows.append(dict(kernel=name, median_ms=round(ms, 4), min_ms=round(min(times), 4),
                         gb_per_s=round(bytes_ / ms / 1e6, 1), same_bits_as_served=same, note=note))
        print(f"{name:34s} {ms:8.3f} ms  {bytes_ / ms / 1e6:8.1f} GB/s  same bits: {same}", flush=True)

    record("served", lambda: served.pages(ids_d, counts_d), note="TritonChecksum.pages, as validation runs it")
    for block, split, warps in ((512, 1, 4), (1024, 2, 8), (1024, 4, 4), (1024, 4, 8), (2048, 4, 8),
                                (512, 8, 4), (1024, 8, 8), (2048, 8, 16)):
        out = torch.empty((args.pages, split), dtype=torch.int64, device=dev)

        def loop(block=block, split=split, warps=warps, out=out):
            _pages_hash_kernel[(args.pages, split)](
                words, ids_d, counts_d, out, page_words, ROW_WORDS=row_words, PAGE_TOKENS=args.page_tokens,
                N_LKV=args.layers * 2, SPLIT=split, SEED=SEED, C1=C1, C2=C2, BLOCK=block, num_warps=warps)
            return out.sum(dim=1)
        record(f"loop block={block} split={split} warps={warps}", loop, check=loop)
    old32_reference_ok = None
    for block, split, warps in ((2048, 2, 8), (1024, 8, 4)):      # the old definition's best two
        out = torch.empty((args.pages, split), dtype=torch.int64, device=dev)

        def old32(block=block, split=split, warps=warps, out=out):
            _pages_hash32_kernel[(args.pages, split)](
                words32, ids_d, counts_d, out, page_words32, ROW_WORDS=row_words32,
                PAGE_TOKENS=args.page_tokens, N_LKV=args.layers * 2, SPLIT=split, SEED=SEED, C1=C1, C2=C2,
                BLOCK=block, num_warps=warps)
            return out.sum(dim=1)
        record(f"old32 block={block} split={split} warps={warps}", old32,
               note="the previous definition (one mix per 32-bit word), not served")
        if old32_reference_ok is None:
            got = to_u64(old32())
            picks = [0, 1] + [int(k) for k in partial.nonzero()[:2, 0]]
            old32_reference_ok = all(
                int(got[k]) == old32_reference_np(
                    words32[ids[k]].cpu().numpy().view(np.uint32).reshape(args.layers, 2, args.page_tokens, -1),
                    int(counts[k]))
                for k in picks)
            print(f"old32 equals its numpy reference on pages {picks}: {old32_reference_ok}", flush=True)
    full_bytes = args.pages * page_bytes
    dwords = words
    for block, split, warps in ((1024, 4, 4), (2048, 4, 8)):
        out = torch.empty((args.pages, split), dtype=torch.int64, device=dev)

        def read(block=block, split=split, warps=warps, out=out):
            _pages_read_kernel[(args.pages, split)](dwords, ids_d, out, dwords.shape[1], SPLIT=split,
                                                    BLOCK=block, num_warps=warps)
            return out.sum(dim=1)
        record(f"read block={block} split={split}", read, bytes_=full_bytes, note="read and add, no hash")
    doc = dict(command="python -m tools.probe_checksum " + " ".join(argv if argv is not None else sys.argv[1:]),
               machine=dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                            triton=triton.__version__, host=platform.node()),
               when=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               pages=args.pages, page_bytes=page_bytes, committed_bytes=committed_bytes,
               partial_pages=int(partial.sum()), old32_reference_ok=old32_reference_ok, rows=rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
