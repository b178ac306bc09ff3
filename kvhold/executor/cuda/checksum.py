"""The KV-page checksum on CUDA: one fused Triton pass, bit-identical to kvhold.protocol.checksum.

Same definition (sum of splitmix64(word ^ index << 40 ^ SEED) mod 2**64 over the
committed 64-bit words of a page; the pool is read as int64, and every index, length
and block below counts 64-bit words), computed for token ranges [start, end) of pages
in one launch: whole committed ranges when validating after a crash (`pages`: one
program per page and split, looping over the page), the few new slots of each touched
page when committing a step (`slots`, and `ranges`: a grid of (range, layer x k/v,
block of the range's words)). Each program reduces its words and writes a partial sum;
partials are added with wrapping int64 arithmetic, which is order-free, so the result
is the CPU's to the bit (tests/gpu/test_gpu.py; tests/process/test_checksum_triton.py
under Triton's interpreter).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvhold.executor.cuda import triton_aot
from kvhold.protocol.checksum import C1, C2, SEED, check_page_shape

BLOCK = 1024


@triton_aot.aot
@triton.jit
def _range_hash_kernel(words_ptr, pages_ptr, starts_ptr, ends_ptr, out_ptr,
                       page_words, row_words, page_tokens, n_lkv, n_blocks,
                       SEED: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, BLOCK: tl.constexpr,
                       SINGLE: tl.constexpr):
    i = tl.program_id(0)
    lkv = tl.program_id(1)
    b = tl.program_id(2)
    page = tl.load(pages_ptr + i).to(tl.int64)
    start = tl.load(starts_ptr + i).to(tl.int32)
    if SINGLE:          # one slot per range: ends_ptr is not read
        end = start + 1
    else:
        end = tl.load(ends_ptr + i).to(tl.int32)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    mask = offs < (end - start) * row_words
    widx = (lkv * page_tokens + start) * row_words + offs
    w = tl.load(words_ptr + page * page_words + widx, mask=mask, other=0)
    x = w.to(tl.uint64, bitcast=True) ^ (widx.to(tl.uint64) << 40)
    x = x ^ SEED
    x = (x ^ (x >> 30)) * C1
    x = (x ^ (x >> 27)) * C2
    x = x ^ (x >> 31)
    x = tl.where(mask, x, tl.zeros_like(x))
    total = tl.sum(x, axis=0)
    tl.store(out_ptr + (i * n_lkv + lkv) * n_blocks + b, total.to(tl.int64, bitcast=True))


@triton_aot.aot
@triton.jit
def _pages_hash_kernel(words_ptr, pages_ptr, counts_ptr, out_ptr, page_words,
                       ROW_WORDS: tl.constexpr, PAGE_TOKENS: tl.constexpr, N_LKV: tl.constexpr,
                       SPLIT: tl.constexpr, SEED: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Whole committed ranges (rows [0, count) of every layer x k/v block), for validation: one
    program per (page, split) loops over its share of the page, accumulating in registers, so
    a pass over thousands of 2 MiB pages runs as a few thousand programs instead of millions
    of one-block ones (bench/results/checksum_cuda.json, with the previous definition, one
    mix per 32-bit word: 3.96 against 4.61 ms for 5,700 Llama-3-8B pages, where reading them
    alone takes 2.67 ms; one mix per 64-bit word over whole pages measured 2.70 ms there)."""
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
            x = w.to(tl.uint64, bitcast=True) ^ (widx.to(tl.uint64) << 40)
            x = x ^ SEED
            x = (x ^ (x >> 30)) * C1
            x = (x ^ (x >> 27)) * C2
            x = x ^ (x >> 31)
            acc += tl.where(mask, x, tl.zeros_like(x))
    tl.store(out_ptr + i * SPLIT + s, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))


# 1024 64-bit words (8 KiB) a block, 2 splits, 8 warps: the fastest of tools/probe_checksum's sweep
# of this kernel on the H200 (its `loop` rows: 2.69 ms for 5,700 Llama-3-8B pages, the read floor
# 2.70 ms; 1024/4/4 took 2.84 ms; bench/results/checksum_cuda.json)
PAGES_BLOCK, PAGES_SPLIT, PAGES_WARPS = 1024, 2, 8


class TritonChecksum:
    """Drop-in for kvhold.protocol.checksum.TorchChecksum on CUDA pools."""

    def __init__(self, pool: torch.Tensor):
        num_pages, layers, two, tokens = pool.shape[:4]
        row_bytes = pool.element_size() * math.prod(pool.shape[4:])
        check_page_shape(row_bytes, row_bytes * layers * two * tokens)
        self.words = pool.reshape(num_pages, -1).view(torch.int64)
        self.page_tokens = tokens
        self.n_lkv = layers * two
        self.row_words = self.words.shape[1] // (self.n_lkv * tokens)
        self.page_words = self.words.shape[1]
        self.n_blocks = triton.cdiv(tokens * self.row_words, BLOCK)

    def ranges(self, page_ids, starts, ends) -> torch.Tensor:
        n = len(page_ids)
        dev = self.words.device
        out = torch.empty((n, self.n_lkv, self.n_blocks), dtype=torch.int64, device=dev)
        if n == 0:
            return out.view(0)
        page_ids = page_ids.to(device=dev, dtype=torch.int64)
        starts = starts.to(device=dev, dtype=torch.int32)
        ends = ends.to(device=dev, dtype=torch.int32)
        _range_hash_kernel[(n, self.n_lkv, self.n_blocks)](
            self.words, page_ids, starts, ends, out, self.page_words, self.row_words,
            self.page_tokens, self.n_lkv, self.n_blocks, SEED=SEED, C1=C1, C2=C2, BLOCK=BLOCK, SINGLE=False)
        return out.view(n, -1).sum(dim=1)

    def pages(self, page_ids, num_tokens) -> torch.Tensor:
        """Checksums of whole committed ranges (a takeover's validation, a tail's publication)."""
        n = len(page_ids)
        dev = self.words.device
        out = torch.empty((n, PAGES_SPLIT), dtype=torch.int64, device=dev)
        if n == 0:
            return out.view(0)
        page_ids = page_ids.to(device=dev, dtype=torch.int64)
        num_tokens = num_tokens.to(device=dev, dtype=torch.int32)
        _pages_hash_kernel[(n, PAGES_SPLIT)](
            self.words, page_ids, num_tokens, out, self.page_words, ROW_WORDS=self.row_words,
            PAGE_TOKENS=self.page_tokens, N_LKV=self.n_lkv, SPLIT=PAGES_SPLIT, SEED=SEED, C1=C1, C2=C2,
            BLOCK=PAGES_BLOCK, num_warps=PAGES_WARPS)
        return out.sum(dim=1)

    def slots(self, page_ids, slots) -> torch.Tensor:
        """One slot of each page: a decode step's commit, hashed inside its CUDA graph. Only
        the blocks one slot spans are launched, and no index is converted first (int32 or
        int64 indices are read as they are): one launch plus the sum."""
        n = len(page_ids)
        dev = self.words.device
        n_blocks = triton.cdiv(self.row_words, BLOCK)
        out = torch.empty((n, self.n_lkv, n_blocks), dtype=torch.int64, device=dev)
        if n == 0:
            return out.view(0)
        page_ids, slots = page_ids.to(device=dev), slots.to(device=dev)
        _range_hash_kernel[(n, self.n_lkv, n_blocks)](
            self.words, page_ids, slots, slots, out, self.page_words, self.row_words,
            self.page_tokens, self.n_lkv, n_blocks, SEED=SEED, C1=C1, C2=C2, BLOCK=BLOCK, SINGLE=True)
        return out.view(n, -1).sum(dim=1)


@triton_aot.warm_up
def _aot_shapes(shapes) -> None:
    pool = triton_aot.meta(shapes.kv_pool_shape, shapes.kv_torch_dtype)
    one = triton_aot.meta((1,), torch.int64)
    TritonChecksum(pool).ranges(one, one, one)
    TritonChecksum(pool).pages(one, one)
    staged = triton_aot.meta((4, shapes.max_batch), torch.int64)     # CudaRunner's pages and slots rows
    TritonChecksum(pool).slots(staged[2], staged[3])
