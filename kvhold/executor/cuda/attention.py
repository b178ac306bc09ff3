"""Paged decode attention on CUDA (Triton), straight from the shared KV pool.

One program per (sequence, kv head) computes the attention of that head's group
of query heads for one new token over the sequence's pages, read in place through
a block table: no gather, no copy. Keys are visited from position 0 in fixed
blocks of 64 positions (a few pages gathered through the table per iteration)
with an online softmax, so a row's result depends only on its own query, keys
and values, never on the other rows of the batch: decode output is the same
whatever else is batched with it. Padding rows (context 1, block table
pointing at the reserved null page) compute garbage that nobody reads.

Exact prefill (kvhold.executor.cuda.runner) runs a prefill chunk's attention on the same
fused decode kernel, one row per position (`rope_prefill_attention`): a row's keys are
visited in the same blocks, in the same order, with the same dot shapes ([GROUP_PAD, D]
by [D, 64]) and the same online-softmax arithmetic as in the decode step that would
have computed that position, so its output, and the key and value it stores, are the
same bits. With `PREFILL_PACKED` the attention runs on `_rope_prefill_kernel` instead,
which puts several positions' query heads into the tile rows a decode step pads with
zeros (the tile is GROUP_PAD = 16 rows, Llama-3-8B's group is 4 heads), so one key block
read serves 4 positions and the dot shapes stay the decode's. A tiled prefill kernel
(64-128 query rows per program) would read each key block once for more rows, but its
dot shapes, and with them the order in which a row's softmax sums are reduced across
threads, would differ from the decode's.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvhold.executor.cuda import triton_aot
from kvhold.executor.cuda.gemm import rows_per_key


TOKENS_PER_ITERATION = 64


@triton_aot.aot
@triton.jit
def _paged_decode_kernel(q_ptr, pool_ptr, table_ptr, ctx_ptr, out_ptr,
                         stride_qb, stride_qh, stride_ob, stride_oh,
                         stride_page, stride_kv, stride_tok, stride_head, stride_table,
                         layer_offset, scale,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, PAGE: tl.constexpr,
                         D: tl.constexpr, PRECISION: tl.constexpr, PAGES: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    t = tl.arange(0, PAGE * PAGES)          # PAGES pages per iteration: fewer, wider loads
    hmask = g < GROUP
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None], other=0.0)
    m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, D), tl.float32)
    base = pool_ptr + layer_offset + kvh * stride_head
    for blk in range(0, tl.cdiv(ctx, PAGE * PAGES)):
        pos = blk * PAGE * PAGES + t
        tmask = pos < ctx
        page = tl.load(table_ptr + b * stride_table + pos // PAGE, mask=tmask, other=0).to(tl.int64)
        kp = base + page[:, None] * stride_page + (pos % PAGE)[:, None] * stride_tok + d[None, :]
        k = tl.load(kp, mask=tmask[:, None], other=0.0)
        v = tl.load(kp + stride_kv, mask=tmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        prob = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(prob, axis=1)
        acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])


def paged_decode_attention(q: torch.Tensor, pool: torch.Tensor, layer: int, block_table: torch.Tensor,
                           context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, heads, D]; pool [P, L, 2, T, kv_heads, D]; block_table [B, max_pages] int32;
    context_lens [B] int32 (including the new token, already written). Returns [B, heads, D]."""
    batch, heads, dim = q.shape
    _, _, _, page_tokens, kv_heads, _ = pool.shape
    group = heads // kv_heads
    out = torch.empty_like(q)
    sp = pool.stride()
    _paged_decode_kernel[(batch, kv_heads)](
        q, pool, block_table, context_lens, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        sp[0], sp[2], sp[3], sp[4], block_table.stride(0),
        layer * sp[1], scale,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), PAGE=page_tokens, D=dim,
        PRECISION="ieee" if pool.dtype == torch.float32 else "tf32",
        PAGES=max(1, TOKENS_PER_ITERATION // page_tokens))
    return out


@triton_aot.aot
@triton.jit
def _rope_decode_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, wpage_ptr, wslot_ptr,
                        pool_ptr, table_ptr, ctx_ptr, out_ptr,
                        stride_t, stride_cos, stride_ob, stride_oh,
                        stride_page, stride_kv, stride_tok, stride_head, stride_table,
                        layer_offset, scale,
                        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                        GROUP_PAD: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
                        PRECISION: tl.constexpr, PAGES: tl.constexpr):
    """RoPE on the new token's q and k (as kvhold.executor.cuda.kernels.rope_and_store rounds it), k
    and v stored at their slot, then _paged_decode_kernel's attention with q and k in
    rotate-half halves. One program per (sequence, kv head) reads and writes only its own."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    H2: tl.constexpr = D // 2
    half = tl.arange(0, H2)
    g = tl.arange(0, GROUP_PAD)
    hmask = g < GROUP
    heads = kvh * GROUP + g
    pos = tl.load(pos_ptr + b).to(tl.int64)
    c1 = tl.load(cos_ptr + pos * stride_cos + half).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * stride_cos + H2 + half).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * stride_cos + half).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * stride_cos + H2 + half).to(tl.float32)
    row = qkv_ptr + b * stride_t
    qp = row + heads[:, None] * D + half[None, :]
    x1 = tl.load(qp, mask=hmask[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(qp + H2, mask=hmask[:, None], other=0.0).to(tl.float32)
    q1 = (x1 * c1[None, :] - x2 * s1[None, :]).to(qkv_ptr.dtype.element_ty)
    q2 = (x2 * c2[None, :] + x1 * s2[None, :]).to(qkv_ptr.dtype.element_ty)
    kp = row + (HEADS + kvh) * D
    y1 = tl.load(kp + half).to(tl.float32)
    y2 = tl.load(kp + H2 + half).to(tl.float32)
    k1 = (y1 * c1 - y2 * s1).to(qkv_ptr.dtype.element_ty)
    k2 = (y2 * c2 + y1 * s2).to(qkv_ptr.dtype.element_ty)
    full = tl.arange(0, D)
    v_new = tl.load(row + (HEADS + KV_HEADS + kvh) * D + full)
    base = pool_ptr + layer_offset + kvh * stride_head
    wpage = tl.load(wpage_ptr + b).to(tl.int64)
    wslot = tl.load(wslot_ptr + b).to(tl.int64)
    dst = base + wpage * stride_page + wslot * stride_tok
    tl.store(dst + half, k1.to(pool_ptr.dtype.element_ty))
    tl.store(dst + H2 + half, k2.to(pool_ptr.dtype.element_ty))
    tl.store(dst + stride_kv + full, v_new.to(pool_ptr.dtype.element_ty))
    tl.debug_barrier()          # the slot just written is read back below by the other threads
    q1 = q1.to(pool_ptr.dtype.element_ty)
    q2 = q2.to(pool_ptr.dtype.element_ty)
    ctx = tl.load(ctx_ptr + b)
    t = tl.arange(0, PAGE * PAGES)
    m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, D), tl.float32)
    for blk in range(0, tl.cdiv(ctx, PAGE * PAGES)):
        p = blk * PAGE * PAGES + t
        tmask = p < ctx
        page = tl.load(table_ptr + b * stride_table + p // PAGE, mask=tmask, other=0).to(tl.int64)
        kptr = base + page[:, None] * stride_page + (p % PAGE)[:, None] * stride_tok
        ka = tl.load(kptr + half[None, :], mask=tmask[:, None], other=0.0)
        kb = tl.load(kptr + H2 + half[None, :], mask=tmask[:, None], other=0.0)
        v = tl.load(kptr + stride_kv + full[None, :], mask=tmask[:, None], other=0.0)
        s = tl.dot(q2, tl.trans(kb), tl.dot(q1, tl.trans(ka), input_precision=PRECISION),
                   input_precision=PRECISION) * scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        prob = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(prob, axis=1)
        acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + full[None, :],
             out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])


def rope_decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                          pages: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor, layer: int,
                          block_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                          heads: int, kv_heads: int) -> torch.Tensor:
    """A decode step's rope_and_store plus paged_decode_attention in one launch: qkv [B,
    (heads + 2 kv_heads) * D] (not modified); the new token's rotated k and v go to (pages[b],
    slots[b]) of `layer` and count in its attention (context_lens include it). Returns the
    attention output [B, heads, D]."""
    batch = qkv.shape[0]
    _, _, _, page_tokens, _, dim = pool.shape
    group = heads // kv_heads
    out = torch.empty((batch, heads, dim), dtype=qkv.dtype, device=qkv.device)
    sp = pool.stride()
    _rope_decode_kernel[(batch, kv_heads)](
        qkv, cos, sin, positions, pages, slots, pool, block_table, context_lens, out,
        qkv.stride(0), cos.stride(0), out.stride(0), out.stride(1),
        sp[0], sp[2], sp[3], sp[4], block_table.stride(0), layer * sp[1], scale,
        HEADS=heads, KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        PAGE=page_tokens, D=dim, PRECISION="ieee" if pool.dtype == torch.float32 else "tf32",
        PAGES=max(1, TOKENS_PER_ITERATION // page_tokens))
    return out


@triton.jit
def _prefill_tile_q(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, pool_ptr, ctx_ptr, first, T, stride_t, stride_cos, kvh,
                    HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, ROWS: tl.constexpr,
                    D: tl.constexpr):
    """One tile of _rope_prefill_kernel: the rotated query rows of positions first..first+ROWS-1
    (GROUP heads each, in the GROUP_PAD rows a decode step's tile has), their contexts, rows
    and heads."""
    H2: tl.constexpr = D // 2
    half = tl.arange(0, H2)
    r = tl.arange(0, GROUP_PAD)
    local = r // GROUP
    b = first + local
    rmask = (local < ROWS) & (b < T)
    b = tl.where(rmask, b, 0).to(tl.int64)
    heads = kvh * GROUP + r % GROUP
    pos = tl.load(pos_ptr + b, mask=rmask, other=0).to(tl.int64)
    c1 = tl.load(cos_ptr + pos[:, None] * stride_cos + half[None, :]).to(tl.float32)
    c2 = tl.load(cos_ptr + pos[:, None] * stride_cos + H2 + half[None, :]).to(tl.float32)
    s1 = tl.load(sin_ptr + pos[:, None] * stride_cos + half[None, :]).to(tl.float32)
    s2 = tl.load(sin_ptr + pos[:, None] * stride_cos + H2 + half[None, :]).to(tl.float32)
    qp = qkv_ptr + b[:, None] * stride_t + heads[:, None] * D + half[None, :]
    x1 = tl.load(qp, mask=rmask[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(qp + H2, mask=rmask[:, None], other=0.0).to(tl.float32)
    q1 = (x1 * c1 - x2 * s1).to(qkv_ptr.dtype.element_ty)
    q2 = (x2 * c2 + x1 * s2).to(qkv_ptr.dtype.element_ty)
    q1 = q1.to(pool_ptr.dtype.element_ty)
    q2 = q2.to(pool_ptr.dtype.element_ty)
    ctx = tl.load(ctx_ptr + b, mask=rmask, other=0)
    return q1, q2, ctx, b, rmask, heads


@triton.jit
def _prefill_tile_block(q1, q2, ka, kb, v, p, ctx, block_start, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
    """One key block of a tile's online softmax, the decode kernel's arithmetic; a row takes no
    part in a block past its own context (its state is kept, as if its loop had ended there)."""
    s = tl.dot(q2, tl.trans(kb), tl.dot(q1, tl.trans(ka), input_precision=PRECISION),
               input_precision=PRECISION) * scale
    s = tl.where(p[None, :] < ctx[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    prob = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_new = l_i * alpha + tl.sum(prob, axis=1)
    acc_new = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v, input_precision=PRECISION)
    active = block_start < ctx
    return tl.where(active, m_new, m_i), tl.where(active, l_new, l_i), tl.where(active[:, None], acc_new, acc)


@triton.jit
def _prefill_tile_store(out_ptr, b, rmask, heads, acc, l_i, stride_ob, stride_oh, D: tl.constexpr):
    full = tl.arange(0, D)
    out = acc / l_i[:, None]
    tl.store(out_ptr + b[:, None] * stride_ob + heads[:, None] * stride_oh + full[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


@triton_aot.aot
@triton.jit
def _rope_prefill_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, pool_ptr, table_ptr, ctx_ptr, out_ptr, T,
                         stride_t, stride_cos, stride_ob, stride_oh,
                         stride_page, stride_kv, stride_tok, stride_head, stride_table,
                         layer_offset, scale,
                         HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                         GROUP_PAD: tl.constexpr, ROWS: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
                         PRECISION: tl.constexpr, PAGES: tl.constexpr, TILES: tl.constexpr = 1):
    """_rope_decode_kernel's attention (keys and values already stored) for TILES x ROWS
    consecutive positions of one sequence at once. A tile is the decode kernel's: its GROUP_PAD
    rows, which in a decode step hold one position's GROUP query heads and zeros, hold ROWS
    positions' heads here. Each tile keeps its own online softmax, with the decode kernel's
    q rotation, dot shapes, key blocks and arithmetic; the TILES tiles (1, 2 or 4) share each key
    block's load."""
    kvh = tl.program_id(1)
    H2: tl.constexpr = D // 2
    half = tl.arange(0, H2)
    full = tl.arange(0, D)
    first = tl.program_id(0).to(tl.int64) * ROWS * TILES   # every row shares one sequence's table
    q1a, q2a, ctx_a, b_a, rmask_a, heads = _prefill_tile_q(
        qkv_ptr, cos_ptr, sin_ptr, pos_ptr, pool_ptr, ctx_ptr, first, T, stride_t, stride_cos, kvh,
        HEADS, GROUP, GROUP_PAD, ROWS, D)
    ctx_max = tl.max(ctx_a, axis=0)
    m_a = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l_a = tl.zeros((GROUP_PAD,), tl.float32)
    acc_a = tl.zeros((GROUP_PAD, D), tl.float32)
    m_b, l_b, acc_b, m_c, l_c, acc_c, m_d, l_d, acc_d = m_a, l_a, acc_a, m_a, l_a, acc_a, m_a, l_a, acc_a
    q1b, q2b, ctx_b, b_b, rmask_b = q1a, q2a, ctx_a, b_a, rmask_a
    q1c, q2c, ctx_c, b_c, rmask_c = q1a, q2a, ctx_a, b_a, rmask_a
    q1d, q2d, ctx_d, b_d, rmask_d = q1a, q2a, ctx_a, b_a, rmask_a
    if TILES >= 2:
        q1b, q2b, ctx_b, b_b, rmask_b, heads = _prefill_tile_q(
            qkv_ptr, cos_ptr, sin_ptr, pos_ptr, pool_ptr, ctx_ptr, first + ROWS, T, stride_t, stride_cos, kvh,
            HEADS, GROUP, GROUP_PAD, ROWS, D)
        ctx_max = tl.maximum(ctx_max, tl.max(ctx_b, axis=0))
    if TILES >= 4:
        q1c, q2c, ctx_c, b_c, rmask_c, heads = _prefill_tile_q(
            qkv_ptr, cos_ptr, sin_ptr, pos_ptr, pool_ptr, ctx_ptr, first + 2 * ROWS, T, stride_t, stride_cos,
            kvh, HEADS, GROUP, GROUP_PAD, ROWS, D)
        q1d, q2d, ctx_d, b_d, rmask_d, heads = _prefill_tile_q(
            qkv_ptr, cos_ptr, sin_ptr, pos_ptr, pool_ptr, ctx_ptr, first + 3 * ROWS, T, stride_t, stride_cos,
            kvh, HEADS, GROUP, GROUP_PAD, ROWS, D)
        ctx_max = tl.maximum(ctx_max, tl.maximum(tl.max(ctx_c, axis=0), tl.max(ctx_d, axis=0)))
    base = pool_ptr + layer_offset + kvh * stride_head
    t = tl.arange(0, PAGE * PAGES)
    for blk in range(0, tl.cdiv(ctx_max, PAGE * PAGES)):
        p = blk * PAGE * PAGES + t
        tmask = p < ctx_max
        page = tl.load(table_ptr + first * stride_table + p // PAGE, mask=tmask, other=0).to(tl.int64)
        kptr = base + page[:, None] * stride_page + (p % PAGE)[:, None] * stride_tok
        ka = tl.load(kptr + half[None, :], mask=tmask[:, None], other=0.0)
        kb = tl.load(kptr + H2 + half[None, :], mask=tmask[:, None], other=0.0)
        v = tl.load(kptr + stride_kv + full[None, :], mask=tmask[:, None], other=0.0)
        start = blk * PAGE * PAGES
        m_a, l_a, acc_a = _prefill_tile_block(q1a, q2a, ka, kb, v, p, ctx_a, start, m_a, l_a, acc_a, scale,
                                              PRECISION)
        if TILES >= 2:
            m_b, l_b, acc_b = _prefill_tile_block(q1b, q2b, ka, kb, v, p, ctx_b, start, m_b, l_b, acc_b, scale,
                                                  PRECISION)
        if TILES >= 4:
            m_c, l_c, acc_c = _prefill_tile_block(q1c, q2c, ka, kb, v, p, ctx_c, start, m_c, l_c, acc_c, scale,
                                                  PRECISION)
            m_d, l_d, acc_d = _prefill_tile_block(q1d, q2d, ka, kb, v, p, ctx_d, start, m_d, l_d, acc_d, scale,
                                                  PRECISION)
    _prefill_tile_store(out_ptr, b_a, rmask_a, heads, acc_a, l_a, stride_ob, stride_oh, D)
    if TILES >= 2:
        _prefill_tile_store(out_ptr, b_b, rmask_b, heads, acc_b, l_b, stride_ob, stride_oh, D)
    if TILES >= 4:
        _prefill_tile_store(out_ptr, b_c, rmask_c, heads, acc_c, l_c, stride_ob, stride_oh, D)
        _prefill_tile_store(out_ptr, b_d, rmask_d, heads, acc_d, l_d, stride_ob, stride_oh, D)


# rope_prefill_attention's default (its docstring): packed. On the H200 the packed kernel gave the
# decode's bits in every case of tests/gpu/test_gpu_exact.py and was the faster form at every
# prompt length (bench/results/exact_prefill_cuda.json: MFU 0.42 / 0.41 / 0.33 at 512 / 2k / 8k
# tokens, against 0.35 / 0.30 / 0.17 one position per program)
PREFILL_PACKED = True
# decode tiles per program of the packed kernel (1, 2 or 4): its tiles share each key block's
# load (KVHOLD_PREFILL_TILES sets it, for measurements)
PREFILL_TILES = int(os.environ.get("KVHOLD_PREFILL_TILES", "4"))


def rope_prefill_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                           pages: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor, layer: int,
                           block_table: torch.Tensor, context_lens: torch.Tensor, no_context: torch.Tensor,
                           scale: float, heads: int, kv_heads: int, packed: bool | None = None,
                           tiles: int | None = None) -> torch.Tensor:
    """A prefill chunk's RoPE, KV store and attention, each row computed exactly as a decode
    step computes it: the decode kernel (rope_decode_attention) with one row per position of
    the chunk. qkv [T, ...] holds the chunk's rows; positions, pages, slots [T]; block_table
    [T, W] (every row the sequence's pages: a stride-0 view is fine); context_lens [T] int32
    = positions + 1; no_context [T] int32 zeros.

    Two launches of the same kernel: the first, with no context, only stores every row's
    rotated key and value (its attention loop runs zero times and its output is dropped);
    the second attends, row t over positions 0..positions[t] in the decode's blocks of 64,
    and stores each row's key and value again. The bits it stores are those already
    there, so a program reading another row's slot while that row's program rewrites it
    reads the same value either way.

    `packed` (default PREFILL_PACKED): the second launch is _rope_prefill_kernel instead,
    GROUP_PAD // GROUP positions per program in the tile rows that a decode step pads with
    zeros: the same per-row arithmetic (for sm_90 it compiles to the decode kernel's layouts and
    MMA instructions), each key block read once for those positions (4 for Llama-3-8B),
    no store. All rows of block_table must be the same sequence's. One row per program
    re-reads a row's whole context for each position: at 8k tokens it was 3/4 of an
    exact prefill's time on the H200. `tiles` (default PREFILL_TILES) decode tiles run in one
    program, each with its own softmax state and the decode's dot shapes, and share each
    key block's load: 16 positions per key block read for Llama-3-8B at 4."""
    rope_decode_attention(qkv, cos, sin, positions, pages, slots, pool, layer, block_table, no_context, scale,
                          heads, kv_heads)
    if not (PREFILL_PACKED if packed is None else packed):
        return rope_decode_attention(qkv, cos, sin, positions, pages, slots, pool, layer, block_table,
                                     context_lens, scale, heads, kv_heads)
    t = qkv.shape[0]
    _, _, _, page_tokens, _, dim = pool.shape
    group = heads // kv_heads
    group_pad = max(16, triton.next_power_of_2(group))
    rows = group_pad // group
    tiles = PREFILL_TILES if tiles is None else tiles
    if tiles not in (1, 2, 4):
        raise ValueError(f"tiles: 1, 2 or 4 decode tiles per program, not {tiles}")
    out = torch.empty((t, heads, dim), dtype=qkv.dtype, device=qkv.device)
    sp = pool.stride()
    _rope_prefill_kernel[(triton.cdiv(t, rows * tiles), kv_heads)](
        qkv, cos, sin, positions, pool, block_table, context_lens, out, t,
        qkv.stride(0), cos.stride(0), out.stride(0), out.stride(1),
        sp[0], sp[2], sp[3], sp[4], block_table.stride(0), layer * sp[1], scale,
        HEADS=heads, KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=group_pad, ROWS=rows,
        PAGE=page_tokens, D=dim, PRECISION="ieee" if pool.dtype == torch.float32 else "tf32",
        PAGES=max(1, TOKENS_PER_ITERATION // page_tokens), TILES=tiles)
    return out


def prefill_launch_key(rows: int) -> tuple[bool, bool, bool]:
    """What decides which compiled kernels a prefill chunk of `rows` rows launches here, as
    kvhold.executor.cuda.runner stages its rows: Triton specialises the row count (a multiple
    of 16 or not) and the 16-byte alignment of each pointer. The runner packs the int32 context
    lengths, zeros and block table one after another (the zeros aligned when rows is a multiple
    of 4, the table when it is even) and the int64 ids, positions, pages and slots as rows of
    one tensor (positions and slots aligned when rows is even)."""
    return rows % 16 == 0, rows % 4 == 0, rows % 2 == 0


@triton_aot.warm_up
def _aot_shapes(shapes) -> None:
    """Decode as kvhold.executor.cuda.runner runs it, padded to max_batch rows (the grid is all a
    smaller bucket changes), for every layer (the
    layer offset's divisibility by 16 is part of the specialization). The runner stages ctx
    and the block table in one int32 buffer, ctx first, so the table is 16-byte aligned only
    when max_batch is a multiple of 4: both layouts are prepared (one, when they agree)."""
    b, width = shapes.max_batch, shapes.max_pages_per_seq
    q = triton_aot.meta((b, shapes.num_heads, shapes.head_dim), shapes.dtype)
    pool = triton_aot.meta(shapes.kv_pool_shape, shapes.kv_torch_dtype)
    staged = triton_aot.meta((b + b * width,), torch.int32)
    staged64 = triton_aot.meta((4, b), torch.int64).unbind(0)      # ids, positions, pages, slots
    qkv = triton_aot.meta((b, (shapes.num_heads + 2 * shapes.num_kv_heads) * shapes.head_dim), shapes.dtype)
    cos = triton_aot.meta((shapes.max_seq_len, shapes.head_dim), shapes.dtype)
    for ctx, table in ((triton_aot.meta((b,), torch.int32), triton_aot.meta((b, width), torch.int32)),
                       (staged[:b], staged[b:].view(b, width))):
        for layer in range(shapes.num_layers):
            paged_decode_attention(q, pool, layer, table, ctx, shapes.head_dim ** -0.5)
            rope_decode_attention(qkv, cos, cos, staged64[1], staged64[2], staged64[3], pool, layer, table, ctx,
                                  shapes.head_dim ** -0.5, shapes.num_heads, shapes.num_kv_heads)
    # exact prefill chunks (kvhold.executor.cuda.runner._prefill_exact), one of each launch key
    for c in rows_per_key(shapes.prefill_chunk, prefill_launch_key):
        rows64 = triton_aot.meta((4, c), torch.int64).unbind(0)
        rows32 = triton_aot.meta((2 * c + width,), torch.int32)
        qkv = triton_aot.meta((c, (shapes.num_heads + 2 * shapes.num_kv_heads) * shapes.head_dim), shapes.dtype)
        table = rows32[2 * c:][None, :].expand(c, -1)
        for layer in range(shapes.num_layers):
            rope_prefill_attention(qkv, cos, cos, rows64[1], rows64[2], rows64[3], pool, layer, table, rows32[:c],
                                   rows32[c:2 * c], shapes.head_dim ** -0.5, shapes.num_heads, shapes.num_kv_heads)
