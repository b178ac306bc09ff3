"""Weight GEMMs of a small decode batch on CUDA (Triton): `x @ w.T`, optionally + residual.

At batch 1..64 a decode step's projections are matrix-vector products bound by reading
the weights once, and cuBLAS's choices for them reach only 64-77% of the copy bandwidth
at Llama-3-8B's o_proj, q|k|v and down_proj shapes (split-K plus a separate reduce
kernel for down_proj; see bench/results/decode_profile_cuda.json). This kernel streams
each weight row block once:

* one program per BLOCK_N output columns reads its [BLOCK_N, K] slice of `w` (row-major,
  K contiguous, as nn.Linear stores it) in BLOCK_K tiles and multiplies the batch,
  padded to a block of 16, 32 or 64 rows (`block_m`), on the tensor cores, accumulating in
  float32;
* every row's sum runs over K in the same order whatever the other rows hold, so a
  row's result does not depend on the batch or its padding (decode graphs per bucket of
  16/32/64 rows give a row the same bits, and so does a takeover that regroups the batch),
  and there is no split-K and no atomics: the result is deterministic;
* `residual` adds into a tensor in the epilogue (float32, rounded once), as
  `addmm_(beta=1)` does: o_proj and down_proj write the residual stream in place.

`linear` takes this path only when it applies (CUDA, bf16/fp16, at most 64 rows, N and
K multiples of the tile sizes, contiguous rows); anything else goes to cuBLAS. A decode
step of 65..256 rows (MAX_DECODE_ROWS) runs its projections and logits on `exact_linear`
instead (kvhold.executor.cuda.runner), whose tiles (below) give a row the bits the decode
tiles give it: a row's result is the same at every bucket up to 256 rows.

Exact prefill (kvhold.executor.cuda.runner) runs a prefill chunk's projections on this
kernel too, at any row count (`exact_linear`): up to 64 rows on the decode's tiles,
beyond that on `prefill_tiles` (128- or 256-row blocks, BLOCK_K 64, 8 warps, the grouped
program order `GROUP_M` for L2 reuse). An element's value is its fp32 accumulator after
the k16 tensor-core steps over K in order and one rounding (the residual added in fp32
first); the tile shapes, warps, stages and program order only decide which program
computes which elements and how the loads are pipelined, so a row's bits are those a
decode step gives it (tests/gpu/test_gpu_exact.py; the sweep over tiles:
tools/probe_exact --gemm). cuBLAS instead picks its kernel, tile and split-K by shape.
`KVHOLD_SKINNY_GEMM=0` turns it off (tools/bench_decode measures both). The tile sizes
were chosen on the H200 by tools/bench_gemm (bench/results/gemm_cuda.json).

65..128 rows (WIDE_DEFAULT_ROWS; `KVHOLD_WIDE_DECODE_TILES=1`: up to 256, MAX_DECODE_ROWS;
`=0`: none) run on the 64-row decode tile instead of the prefill tiles:
the same compiled tile as a 64-row decode step's, over ceil(rows / 64) row blocks, the row
blocks of one column tile launched next to each other (GROUP_M = WIDE_GROUP_M) so that its
weights come from DRAM once and from L2 after. The prefill tiles give 16-48 programs to a
decode step's projections (bench/results/decode_cuda_96_192.json: 15.6 ms at 96 rows against
6.0 ms at 64); the decode tile gives the 64-row step's programs times the row blocks. At 256
rows the prefill tiles' reuse of each weight tile wins back what their fewer programs lose, so
the default stops at 128. A row's bits are the 64-row tile's either way (the module's
invariant, checked by tests/gpu/test_gpu_gemm.py with the variable at 0 and 1).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvhold.executor.cuda import triton_aot

MAX_ROWS = 64            # rows on the decode tiles (one program covers every row)
MAX_DECODE_ROWS = 256    # a decode step's rows on the kernel: beyond MAX_ROWS on exact_linear's tiles
WIDE_GROUP_M = MAX_DECODE_ROWS // MAX_ROWS   # row blocks of one column tile next to each other (wide tiles)
# rows past MAX_ROWS on the wide tiles by default: on an H100 (bench/results/decode_cuda_256_wide_h100.json)
# they took a 128-row Llama-3-8B step from 15.7 to 10.7 ms, and a 256-row one from 18.2 to 19.0 ms
WIDE_DEFAULT_ROWS = 128
DECODE_BUCKETS = (16, 32, 64, 128, 256)
BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 32, 256, 4, 4       # H200, see module docstring
# (N, K, rows per program) -> (BLOCK_N, BLOCK_K, warps, stages) where another tile won the
# sweep (Llama-3-8B's q|k|v, o, gate|up, down; 32 rows take the 64-row choice)
_SWEPT = {(6144, 4096): ((64, 128, 4, 5), (64, 128, 4, 5)), (4096, 4096): ((32, 256, 4, 5), (32, 256, 4, 4)),
          (28672, 4096): ((32, 128, 4, 3), (64, 128, 4, 3)), (4096, 14336): ((32, 256, 4, 5), (32, 256, 4, 4))}
TUNED: dict[tuple[int, int, int], tuple[int, int, int, int]] = {
    (n, k, bm): choice[bm > 16] for (n, k), choice in _SWEPT.items() for bm in (16, 32, 64)}


def enabled() -> bool:
    return os.environ.get("KVHOLD_SKINNY_GEMM", "1") != "0"


def wide_decode_rows() -> int:
    """The most rows that run on the 64-row decode tile over row blocks (the module docstring):
    KVHOLD_WIDE_DECODE_TILES=0 none (MAX_ROWS), =1 every decode bucket (MAX_DECODE_ROWS), unset
    WIDE_DEFAULT_ROWS. Read at each launch and by the warm-ups alike, so both take one path."""
    value = os.environ.get("KVHOLD_WIDE_DECODE_TILES", "")
    rows = {"0": MAX_ROWS, "1": MAX_DECODE_ROWS, "": WIDE_DEFAULT_ROWS}.get(value)
    if rows is None:
        raise ValueError(f"KVHOLD_WIDE_DECODE_TILES={value!r}: want 0 (off), 1 (to {MAX_DECODE_ROWS} rows) "
                         f"or unset (to {WIDE_DEFAULT_ROWS})")
    return rows


def wide(rows: int) -> bool:
    """Whether `rows` rows run on the 64-row decode tile over several row blocks."""
    return MAX_ROWS < rows <= wide_decode_rows()


@triton_aot.aot
@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, res_ptr, M, N, K, stride_x, stride_w, stride_o, stride_r,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   RESIDUAL: tl.constexpr, EVEN_N: tl.constexpr, GROUP_M: tl.constexpr = 0):
    if GROUP_M:
        # one program id, GROUP_M row tiles per column tile in turn (an L2-friendly order for
        # many rows); which program computes a tile changes nothing in the tile's arithmetic
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=rows, other=0.0)
        if EVEN_N:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=cols, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_mask = rows & (rn[None, :] < N)
    if RESIDUAL:
        acc += tl.load(res_ptr + rm[:, None] * stride_r + rn[None, :], mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rm[:, None] * stride_o + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def block_m(rows: int) -> int:
    """Rows per program: the batch padded to 16, 32 or 64 (one program covers them all)."""
    return min(MAX_ROWS, max(16, triton.next_power_of_2(rows)))


def tiles(n: int, k: int, rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages); BLOCK_K divides K (K's largest power-of-2 divisor at most)."""
    block_n, block_k, warps, stages = TUNED.get((n, k, block_m(rows)), (BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES))
    return block_n, min(block_k, k & -k), warps, stages


def decode_buckets(max_batch: int) -> list[int]:
    """The row counts a decode step is padded to, one CUDA graph each: 16, 32, 64, 128, 256
    up to max_batch, and max_batch. The kernel's rows are bit-identical at every count (each
    row's sum runs over K in the same order, on the decode tiles up to 64 rows and on
    exact_linear's beyond; tests/gpu/test_gpu_gemm.py), so a row's result does not depend on
    which bucket its step ran in. Past MAX_DECODE_ROWS cuBLAS takes over and that holds no
    longer: one bucket."""
    if max_batch > MAX_DECODE_ROWS:
        return [max_batch]
    return sorted({b for b in DECODE_BUCKETS if b < max_batch} | {max_batch})


def fits(n: int, k: int, rows: int) -> bool:
    """Whether the kernel takes a [rows, k] @ [n, k].T product on the decode tiles (K in
    tiles of at least 16)."""
    return 0 < rows <= MAX_ROWS and tiles(n, k, rows)[1] >= 16


def decode_fits(n: int, k: int, rows: int) -> bool:
    """Whether a decode step of `rows` rows runs [rows, k] @ [n, k].T on the kernel: on the
    decode tiles up to MAX_ROWS rows, on exact_linear's up to MAX_DECODE_ROWS."""
    return 0 < rows <= MAX_DECODE_ROWS and fits(n, k, min(rows, MAX_ROWS))


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
            and x.dim() == 2 and x.shape[1] == w.shape[1] and x.stride(1) == 1 and w.stride(1) == 1
            and fits(w.shape[0], w.shape[1], x.shape[0]))


def skinny(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None,
           out: torch.Tensor | None = None, block_n: int = 0, block_k: int = 0, num_warps: int = 0,
           num_stages: int = 0, rows_per_program: int = 0, group_m: int = 0) -> torch.Tensor:
    """x [M, K] @ w[N, K].T (+ residual [M, N]) into out (default: a new tensor; may be
    `residual` itself). The caller checks `applies` (or `exact_applies`) first; tile
    arguments left 0 take `tiles` (tools/bench_gemm sets them to compare). `group_m` > 0
    launches one program per tile, GROUP_M row tiles per column tile in turn (prefill)."""
    m, k = x.shape
    n = w.shape[0]
    tuned = tiles(n, k, min(m, MAX_ROWS))
    block_n, block_k = block_n or tuned[0], block_k or tuned[1]
    num_warps, num_stages = num_warps or tuned[2], num_stages or tuned[3]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res = residual if residual is not None else out
    bm = rows_per_program or block_m(m)
    if group_m:
        grid = (triton.cdiv(n, block_n) * triton.cdiv(m, bm),)
    else:
        grid = (triton.cdiv(n, block_n), triton.cdiv(m, bm))
    extra = {"GROUP_M": group_m} if group_m else {}       # the decode launch keeps its exact form
    _skinny_kernel[grid](
        x, w, out, res, m, n, k, x.stride(0), w.stride(0), out.stride(0), res.stride(0),
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, RESIDUAL=residual is not None, EVEN_N=n % block_n == 0,
        num_warps=num_warps, num_stages=num_stages, **extra)
    return out


# ---------------------------------------------------------------- exact prefill
# A prefill chunk's projections on the same kernel as decode, in big tiles. An output
# element's value is its fp32 accumulator after the k16 tensor-core steps over K in
# order 0, 16, 32, ... and one rounding (plus the residual, in fp32, then one rounding):
# the tile sizes, warps, stages and program order only say which program computes which
# elements and how loads are pipelined, not that order. On the H200 every one of 301
# configurations (BLOCK_M 16..256, BLOCK_N 32..256, BLOCK_K 32..256, 4/8 warps, 2-4
# stages; mma.sync at 16-32 rows per program, wgmma from 64) gave each row the decode's
# bits at Llama-3-8B's four shapes, BLOCK_K included (bench/results/exact_gemm_cuda.json,
# tools/probe_exact --gemm), so the prefill tiles are simply the fastest of that sweep:
# 572-676 TFLOP/s at 2048 rows, against cuBLAS's 702-798. tests/gpu/test_gpu_exact.py
# checks the bits on the GPU.
PREFILL_GROUP_M = 8
PREFILL_DEFAULT = (128, 256, 64, 8, 3)          # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
PREFILL_TUNED: dict[tuple[int, int], tuple[int, int, int, int, int]] = {
    (6144, 4096): (256, 128, 64, 8, 3), (4096, 4096): (128, 256, 64, 8, 4),
    (28672, 4096): (256, 128, 64, 8, 3), (4096, 14336): (128, 256, 64, 8, 3)}


def prefill_tiles(n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of a prefill chunk's [rows, k] @ [n, k].T
    (BLOCK_K divides K: K's largest power-of-2 divisor at most)."""
    bm, bn, bk, warps, stages = PREFILL_TUNED.get((n, k), PREFILL_DEFAULT)
    return bm, bn, min(bk, k & -k), warps, stages


def exact_launch_key(n: int, k: int, rows: int) -> tuple:
    """What decides which compiled kernel `exact_linear` launches at `rows` rows of an
    [rows, k] @ [n, k].T: the tile it takes and how Triton specialises the row count (a
    multiple of 16 or not; one row never comes here from a prefill). Two row counts with
    the same key run the same compiled kernel (and of kvhold.executor.cuda.fp8_gemm's, whose
    tiles follow from this key: fp8_gemm._tiles)."""
    if rows <= MAX_ROWS:
        return ("decode", block_m(rows), tiles(n, k, rows), rows % 16 == 0, rows == 1)
    if wide(rows):
        return ("wide", tiles(n, k, MAX_ROWS), rows % 16 == 0)
    return ("prefill", prefill_tiles(n, k), rows % 16 == 0)


def rows_per_key(chunk: int, key) -> list[int]:
    """The largest row count in 2..`chunk` for each distinct `key(rows)`, largest first: a
    warm-up that runs a chunk of each launches every compiled kernel a chunk of 2..chunk
    rows can, so no step of a serving executor compiles one (a compile takes about a second,
    and a step that long is fenced as a hang)."""
    seen, rows = set(), []
    for m in range(chunk, 1, -1):
        k = key(m)
        if k not in seen:
            seen.add(k)
            rows.append(m)
    return rows


def logits_warm_up_rows(vocab: int, hidden: int) -> list[int]:
    """Row counts in 2..MAX_ROWS at which the logits GEMM ([rows, hidden] @ [vocab, hidden].T)
    runs on this kernel, one per compiled kernel: a prefill chunk's prompt log-prob rows reach it
    at any count (kvhold.executor.cuda.runner), a decode step only at its buckets. A warm-up
    that runs each leaves no compile to a serving step."""
    return [m for m in rows_per_key(MAX_ROWS, lambda m: exact_launch_key(vocab, hidden, m))
            if fits(vocab, hidden, m)]


def exact_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `exact_linear` takes x @ w.T: as `applies`, at any number of rows."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
            and x.dim() == 2 and x.shape[1] == w.shape[1] and x.stride(1) == 1 and w.stride(1) == 1
            and x.shape[0] > 0 and fits(w.shape[0], w.shape[1], MAX_ROWS))


def exact_linear(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """skinny(x, w, residual, out) at any number of rows, each row's bits those a decode
    step gives it: at most MAX_ROWS rows on the decode tiles, more on prefill_tiles (those that
    `wide` takes on the 64-row decode tile over row blocks)."""
    m = x.shape[0]
    if m <= MAX_ROWS:
        return skinny(x, w, residual=residual, out=out)
    if wide(m):
        return skinny(x, w, residual=residual, out=out, rows_per_program=MAX_ROWS, group_m=WIDE_GROUP_M)
    bm, bn, bk, warps, stages = prefill_tiles(w.shape[0], w.shape[1])
    return skinny(x, w, residual=residual, out=out, block_n=bn, block_k=bk, num_warps=warps,
                  num_stages=stages, rows_per_program=bm, group_m=PREFILL_GROUP_M)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           exact: bool = False) -> torch.Tensor:
    """F.linear(x, w, bias), on the skinny kernel where it applies; `exact`: at any number
    of rows (the caller checked `exact_applies`)."""
    if exact:
        return exact_linear(x, w)
    if bias is None and enabled() and applies(x, w):
        return skinny(x, w)
    return F.linear(x, w, bias)


def add_linear_(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """h += x @ w.T in place (one rounding), as h.addmm_(x, w.t()); `exact`: as `linear`."""
    if exact:
        return exact_linear(x, w, residual=h, out=h)
    if enabled() and applies(x, w) and h.stride(1) == 1:
        return skinny(x, w, residual=h, out=h)
    return h.addmm_(x, w.t())


@triton_aot.warm_up
def _aot_shapes(shapes) -> None:
    """A decode step's projections and logits at each bucket's rows, and a prefill chunk's
    logits (one row, and the prompt log-prob rows: `logits_warm_up_rows`), as
    kvhold.executor.cuda.layers runs them."""
    if shapes.torch_dtype not in (torch.bfloat16, torch.float16):
        return
    meta, dt = triton_aot.meta, shapes.torch_dtype
    hidden, inter, q = shapes.hidden_size, shapes.intermediate_size, shapes.num_heads * shapes.head_dim
    qkv = q + 2 * shapes.num_kv_heads * shapes.head_dim
    for b in decode_buckets(shapes.max_batch) + [1]:
        h = meta((b, hidden), dt)
        for n, k, residual in ((qkv, hidden, False), (2 * inter, hidden, False), (shapes.vocab_size, hidden, False),
                               (hidden, q, True), (hidden, inter, True)):
            x, w = meta((b, k), dt), meta((n, k), dt)
            if decode_fits(n, k, b) and not (b == 1 and residual):
                (skinny if b <= MAX_ROWS else exact_linear)(x, w, residual=h if residual else None,
                                                             out=h if residual else None)
    for m in logits_warm_up_rows(shapes.vocab_size, hidden):     # prompt log-prob rows of a prefill chunk
        skinny(meta((m, hidden), dt), meta((shapes.vocab_size, hidden), dt))
    projections = ((qkv, hidden, False), (hidden, q, True), (2 * inter, hidden, False), (hidden, inter, True))
    if all(fits(n, k, MAX_ROWS) for n, k, _ in projections):      # an exact prefill chunk's projections
        for m in rows_per_key(shapes.prefill_chunk,
                              lambda m: tuple(exact_launch_key(n, k, m) for n, k, _ in projections)):
            h = meta((m, hidden), dt)
            for n, k, residual in projections:
                exact_linear(meta((m, k), dt), meta((n, k), dt), residual=h if residual else None,
                             out=h if residual else None)
