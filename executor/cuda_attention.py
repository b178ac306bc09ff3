"""Paged decode attention on CUDA (Triton), straight from the shared KV pool.

One program per (sequence, kv head) computes the attention of that head's group
of query heads for one new token over the sequence's pages, read in place through
a block table: no gather, no copy. Keys are visited from position 0 in fixed
blocks of 64 positions (a few pages gathered through the table per iteration)
with an online softmax, so a row's result depends only on its own query, keys
and values, never on the other rows of the batch: decode output is the same
whatever else is batched with it. Padding rows (context 1, block table
pointing at the reserved null page) compute garbage that nobody reads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor import triton_aot


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


@triton_aot.warm_up
def _aot_shapes(shapes) -> None:
    """Decode as executor.cuda_runner runs it, padded to max_batch rows, for every layer (the
    layer offset's divisibility by 16 is part of the specialization). The runner stages ctx
    and the block table in one int32 buffer, ctx first, so the table is 16-byte aligned only
    when max_batch is a multiple of 4: both layouts are prepared (one, when they agree)."""
    b, width = shapes.max_batch, shapes.max_pages_per_seq
    q = triton_aot.meta((b, shapes.num_heads, shapes.head_dim), shapes.dtype)
    pool = triton_aot.meta(shapes.kv_pool_shape, shapes.kv_torch_dtype)
    staged = triton_aot.meta((b + b * width,), torch.int32)
    for ctx, table in ((triton_aot.meta((b,), torch.int32), triton_aot.meta((b, width), torch.int32)),
                       (staged[:b], staged[b:].view(b, width))):
        for layer in range(shapes.num_layers):
            paged_decode_attention(q, pool, layer, table, ctx, shapes.head_dim ** -0.5)
