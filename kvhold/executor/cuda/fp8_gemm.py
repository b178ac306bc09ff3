"""FP8 weight GEMMs on CUDA (Triton): the weight read as FP8, dequantized in registers,
multiplied on kvhold.executor.cuda.gemm's tiles (wider ones on the decode tiles: `_tiles`).

A decode step reads every weight once, so its time is the weights' bytes over the memory
bandwidth. Dequantizing an FP8 weight to bf16 in memory before the bf16 kernel (the fallback,
`Fp8Weight.dequantize`) reads the FP8 bytes, writes twice as many and reads those again: five
bytes a weight where a bf16 checkpoint's decode reads two. This kernel reads the FP8 tile (one
byte a weight) and its scales and computes in registers what `dequantize` computes in memory,

    w_bf16 = round_to_bf16(float32(w_fp8) * scale)          (one float32 product, one rounding)

with the scale of the weight's output channel (per-channel and per-tensor checkpoints: one float32
a row) or of its 128x128 block (block-scaled checkpoints: BLOCK_K divides the block, so a tile's K
range has one scale column), then runs the bf16 kernel's tensor-core steps over K in order, on its
tiles: the decode tiles up to gemm.MAX_ROWS rows, exact_linear's beyond. A row's result depends
on nothing but that order, so it is the same at every row count and tile (decode at any bucket up
to 256 rows, an exact prefill chunk of any size): tests/gpu/test_gpu_fp8.py checks the bits on
the GPU. That order includes which K elements share a k16 tensor-core step and where in it:
Triton packs an mma.sync operand's K (kWidth) by the narrowest type its elementwise chain was
loaded as, and the FP8 load gave kWidth 4 where the bf16 kernel has 2, another K permutation in
each k16 step, whose fp32 sums differ in their last bits on the H200 from wgmma's (the tiles of
64+ rows) and the bf16 kernel's: rows 1..32 (mma.sync) then disagreed with rows 33+ (wgmma).
An opaque bit-preserving move (`_KEEP_16_BIT`) on the dequantized tile ends that chain, so every
tile runs the bf16 kernel's K packing; the compiled kernels are checked for it on the CPU
(tests/process/test_executor_triton_aot.py). On the H200 the kernel's rows are then the
dequantizing path's bits at every row count from 1 to 256. A projection still keeps one path:
exact prefill and batch-invariant decode run every FP8 projection that the kernel takes on the
kernel, at any row count (kvhold.executor.cuda.layers).

Activations are not quantized (the weights are the bytes a decode step reads): the FP8 tensor
cores are not used; KVHOLD_FP8_SCALED_MM=1 runs torch._scaled_mm instead, which is not
batch-invariant (kvhold.executor.fp8).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvhold.executor.cuda import gemm, triton_aot

# A 16-bit move Triton cannot see through (not pure, so no elementwise chain crosses it): the
# dequantized tile then reaches tl.dot as a 16-bit value, on the bf16 kernel's mma.sync K packing
# (kWidth 2) instead of the FP8 load's (kWidth 4). It moves a register, no arithmetic.
_KEEP_16_BIT = tl.constexpr("mov.b16 $0, $1;")


@triton_aot.aot
@triton.jit
def _fp8_kernel(x_ptr, w_ptr, s_ptr, out_ptr, res_ptr, M, N, K, stride_x, stride_w, stride_s, stride_o, stride_r,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                RESIDUAL: tl.constexpr, EVEN_N: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                GROUP_M: tl.constexpr = 0):
    # SCALE_BN == 0: one scale per output row (s_ptr [N]); else one per SCALE_BN x SCALE_BK block
    # (s_ptr [ceil(N / SCALE_BN), stride_s]), and BLOCK_K divides SCALE_BK
    if GROUP_M:
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        in_group = GROUP_M * tiles_n
        first_m = (pid // in_group) * GROUP_M
        size_m = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % in_group) % size_m
        pid_n = (pid % in_group) // size_m
    else:
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    rows = rm[:, None] < M
    cols = rn[:, None] < N
    x_ptrs = x_ptr + rm[:, None] * stride_x + rk[None, :]
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
    if SCALE_BN == 0:
        scale = tl.load(s_ptr + rn[:, None], mask=cols, other=0.0)
    else:
        s_ptrs = s_ptr + (rn[:, None] // SCALE_BN) * stride_s
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=rows, other=0.0)
        if EVEN_N:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=cols, other=0.0)
        if SCALE_BN != 0:
            scale = tl.load(s_ptrs + k0 // SCALE_BK, mask=cols, other=0.0)
        w = (w.to(tl.float32) * scale).to(x_ptr.dtype.element_ty)
        w = tl.inline_asm_elementwise(_KEEP_16_BIT, "=h,h", [w], dtype=x_ptr.dtype.element_ty,
                                      is_pure=False, pack=1)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_mask = rows & (rn[None, :] < N)
    if RESIDUAL:
        acc += tl.load(res_ptr + rm[:, None] * stride_r + rn[None, :], mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rm[:, None] * stride_o + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


# BLOCK_N on the decode and wide tiles where its programs fill the SMs as well as the bf16 kernel's
# choice: an FP8 weight row is half a bf16 one's bytes, and at Llama-3-70B's o, gate|up and down 64
# columns a program read 0.54-0.59 of the copy bandwidth at 64 rows against 0.39-0.43, and 7-9% faster
# at 16 (bench/results/gemm_fp8_70b_h100.json); q|k|v (10,240 columns: 160 programs, a second wave
# of 28 on 132 SMs) was 12% slower at 16 rows, which the wave count predicts. BLOCK_N decides no bits.
FP8_BLOCK_N = 64
SM_COUNT = 132           # an H100's or H200's (SXM): the waves `_block_n` counts; a wrong count costs speed only


def _block_n(n: int, bn: int) -> int:
    """FP8_BLOCK_N unless its column programs fill the waves over SM_COUNT SMs worse than `bn`'s
    (counted for one row block, so that every row count of a launch key takes one tile)."""
    def filled(block_n: int) -> float:
        programs = -(-n // block_n)
        return programs / (-(-programs // SM_COUNT) * SM_COUNT)
    return FP8_BLOCK_N if filled(FP8_BLOCK_N) >= filled(bn) else bn


def _tiles(n: int, k: int, rows: int, block_k_max: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M): the bf16 kernel's tiles at these rows
    (exact_linear's past gemm.MAX_ROWS), with `_block_n`'s BLOCK_N on the decode and wide tiles
    (at most 4 stages where it widened a BLOCK_K of 256: five do not fit shared memory at 64 rows),
    BLOCK_K at most `block_k_max`. A launch key of gemm.exact_launch_key gives one FP8 tile."""
    if rows <= gemm.MAX_ROWS or gemm.wide(rows):
        bf16_bn, bk, warps, stages = gemm.tiles(n, k, min(rows, gemm.MAX_ROWS))
        bk = min(bk, block_k_max)
        bm = gemm.block_m(rows) if rows <= gemm.MAX_ROWS else gemm.MAX_ROWS
        bn = _block_n(n, bf16_bn)
        if bn != bf16_bn and bk >= 256:
            stages = min(stages, 4)
        return bm, bn, bk, warps, stages, 0 if rows <= gemm.MAX_ROWS else gemm.WIDE_GROUP_M
    bm, bn, bk, warps, stages = gemm.prefill_tiles(n, k)
    return bm, bn, min(bk, block_k_max), warps, stages, gemm.PREFILL_GROUP_M


def applies(x: torch.Tensor, n: int, k: int, block: tuple[int, int] | None) -> bool:
    """Whether the kernel takes x [rows, k] @ w[n, k].T for an FP8 weight: bf16/fp16 rows with
    contiguous columns, and `applies_shape`."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2 and x.shape[1] == k
            and x.stride(1) == 1 and applies_shape(n, k, x.shape[0], block))


def applies_shape(n: int, k: int, rows: int, block: tuple[int, int] | None) -> bool:
    """Where the bf16 kernel takes the shape (K in tiles of at least 16), at any number of rows
    (the decode tiles up to gemm.MAX_ROWS, exact_linear's beyond), and for block scales a block
    width that is a power of two of at least 16 (a tile's K range then lies in one block column)."""
    return (rows > 0 and gemm.fits(n, k, min(rows, gemm.MAX_ROWS))
            and (block is None or (block[1] >= 16 and block[1] & (block[1] - 1) == 0)))


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
               residual: torch.Tensor | None = None, out: torch.Tensor | None = None, block_n: int = 0,
               block_k: int = 0, num_warps: int = 0, num_stages: int = 0) -> torch.Tensor:
    """x [M, K] @ dequant(w [N, K] float8_e4m3fn).T (+ residual) into out, each row's bits the same
    at any M. `scale`: float32 [N] (one per output row) with
    `block` None, else float32 [ceil(N / block[0]), ceil(K / block[1])]. The caller checks
    `applies` first. Tile arguments left 0 take the bf16 kernel's tiles (`_tiles`); tools/bench_gemm
    --fp8 sets them to compare (BLOCK_K must divide a block's width)."""
    m, k = x.shape
    n = w.shape[0]
    bm, bn, bk, warps, stages, group_m = _tiles(n, k, m, block[1] if block else k)
    bn, bk, warps, stages = block_n or bn, block_k or bk, num_warps or warps, num_stages or stages
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res = residual if residual is not None else out
    grid = (triton.cdiv(n, bn) * triton.cdiv(m, bm),) if group_m else (triton.cdiv(n, bn), triton.cdiv(m, bm))
    _fp8_kernel[grid](
        x, w, scale, out, res, m, n, k, x.stride(0), w.stride(0), scale.stride(0) if block else 0, out.stride(0),
        res.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, RESIDUAL=residual is not None,
        EVEN_N=n % bn == 0, SCALE_BN=block[0] if block else 0, SCALE_BK=block[1] if block else 1,
        num_warps=warps, num_stages=stages, GROUP_M=group_m)
    return out


@triton_aot.warm_up
def _aot_shapes(shapes) -> None:
    """A decode step's four projections at each bucket's rows, for an FP8 checkpoint's scales
    (`shapes.fp8`: one per output row, or per block)."""
    if not shapes.fp8 or shapes.torch_dtype not in (torch.bfloat16, torch.float16):
        return
    meta, dt = triton_aot.meta, shapes.torch_dtype
    hidden, inter, q = shapes.hidden_size, shapes.intermediate_size, shapes.num_heads * shapes.head_dim
    qkv = q + 2 * shapes.num_kv_heads * shapes.head_dim
    block = shapes.fp8_scale_block
    side_n, side_k = block or (0, 0)
    for b in gemm.decode_buckets(shapes.max_batch) + [1]:
        h = meta((b, hidden), dt)
        for n, k, residual in ((qkv, hidden, False), (2 * inter, hidden, False), (hidden, q, True),
                               (hidden, inter, True)):
            x = meta((b, k), dt)
            if not (gemm.decode_fits(n, k, b) and applies_shape(n, k, b, block)) or (b == 1 and residual):
                continue
            scale = meta((-(-n // side_n), -(-k // side_k)) if block else (n,), torch.float32)
            fp8_linear(x, meta((n, k), torch.float8_e4m3fn), scale, block, residual=h if residual else None,
                       out=h if residual else None)

