"""Fused elementwise kernels of a decoder layer on CUDA (Triton).

A decode step at batch 8..64 is bound by reading the weights, and between the
GEMMs the eager layer used to launch some thirty small elementwise kernels per
layer (RMSNorm in six, RoPE in ten, the KV scatter, SiLU, the residual adds).
Inside a CUDA graph each still costs a few microseconds, about a third of the
step at Llama-3-8B's shapes. These kernels do the same arithmetic in three
launches per layer:

* `rmsnorm`: one program per row; the row's mean square in float32, then
  `weight * (x * rsqrt(ms + eps)).to(dtype)` as in Hugging Face's LlamaRMSNorm.
* `rope_and_store`: one program per (token, head) of the fused q|k|v rows; rotates
  q in place (rotate-half convention), rotates k and stores k and v straight into
  their (page, slot) of the shared pool: no scatter through advanced indexing.
* `silu_mul`: `silu(gate) * up` from the fused gate|up rows.

Every program reads only its own row, so a row's result never depends on what
else is batched with it: a takeover that regroups the batch computes the same bits
(docs/ARCHITECTURE.md, section 9). Products are taken
in float32 and rounded once, so the bits differ from the eager composition; the
fused path is used for prefill and decode alike, and eager and graph replay run
these same kernels, so an executor and its replacement agree to the bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvhold.executor.cuda import triton_aot


@triton_aot.aot
@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    ms = tl.sum(x * x, axis=0) / n
    y = (x * tl.rsqrt(ms + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * y.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden] in x's dtype."""
    t, n = x.shape
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        _rmsnorm_kernel[(t,)](x, weight, out, x.stride(0), out.stride(0), n, eps,
                              BLOCK=triton.next_power_of_2(n), num_warps=8 if n >= 4096 else 4)
    return out


@triton_aot.aot
@triton.jit
def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, page_ptr, slot_ptr, pool_ptr,
                       stride_t, stride_cos, stride_page, stride_kv, stride_tok, stride_head, layer_offset,
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    half = tl.arange(0, D // 2)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c1 = tl.load(cos_ptr + pos * stride_cos + half).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * stride_cos + D // 2 + half).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * stride_cos + half).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * stride_cos + D // 2 + half).to(tl.float32)
    row = qkv_ptr + t * stride_t
    x_ptr = row + h * D                       # q heads, then k heads (v follows k)
    x1 = tl.load(x_ptr + half).to(tl.float32)
    x2 = tl.load(x_ptr + D // 2 + half).to(tl.float32)
    o1 = (x1 * c1 - x2 * s1).to(qkv_ptr.dtype.element_ty)
    o2 = (x2 * c2 + x1 * s2).to(qkv_ptr.dtype.element_ty)
    if h < HEADS:
        tl.store(x_ptr + half, o1)
        tl.store(x_ptr + D // 2 + half, o2)
    else:
        kvh = h - HEADS
        page = tl.load(page_ptr + t).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        dst = pool_ptr + layer_offset + page * stride_page + slot * stride_tok + kvh * stride_head
        tl.store(dst + half, o1.to(pool_ptr.dtype.element_ty))
        tl.store(dst + D // 2 + half, o2.to(pool_ptr.dtype.element_ty))
        v_ptr = row + (HEADS + KV_HEADS + kvh) * D
        full = tl.arange(0, D)
        v = tl.load(v_ptr + full)
        tl.store(dst + stride_kv + full, v.to(pool_ptr.dtype.element_ty))


def rope_and_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   pages: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor, layer: int,
                   heads: int, kv_heads: int, head_dim: int) -> None:
    """qkv [T, (heads + 2 kv_heads) * head_dim]: rotate q in place; store rotated k and v
    at (pages[t], layer, k/v, slots[t]) of pool [P, L, 2, page_tokens, kv_heads, head_dim]."""
    t = qkv.shape[0]
    if not t:
        return
    sp = pool.stride()
    _rope_store_kernel[(t, heads + kv_heads)](
        qkv, cos, sin, positions, pages, slots, pool,
        qkv.stride(0), cos.stride(0), sp[0], sp[2], sp[3], sp[4], layer * sp[1],
        HEADS=heads, KV_HEADS=kv_heads, D=head_dim, num_warps=1 if head_dim <= 128 else 2)


@triton_aot.aot
@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + n + offs, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 I] (gate then up) -> silu(gate) * up [T, I]."""
    t, two_n = gate_up.shape
    n = two_n // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = 1024
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n,
                                                     BLOCK=block, num_warps=4)
    return out


@triton_aot.warm_up
def _aot_shapes(shapes) -> None:
    """A decode step (max_batch rows; CudaRunner stages positions, pages and slots as rows of
    one int64 buffer) and a prefill chunk, as kvhold.executor.cuda.layers runs them."""
    meta, dt = triton_aot.meta, shapes.torch_dtype
    heads, kv_heads, dim = shapes.num_heads, shapes.num_kv_heads, shapes.head_dim
    pool = meta(shapes.kv_pool_shape, shapes.kv_torch_dtype)
    cos = meta((shapes.max_seq_len, dim), dt)
    for t in (shapes.max_batch, shapes.prefill_chunk):
        rmsnorm(meta((t, shapes.hidden_size), dt), meta((shapes.hidden_size,), dt), 1e-5)
        if shapes.qk_norm:          # each query and key head (kvhold.executor.cuda.layers.FusedLayers)
            for n in (heads, kv_heads):
                rmsnorm(meta((t * n, dim), dt), meta((dim,), dt), 1e-5)
        silu_mul(meta((t, 2 * shapes.intermediate_size), dt))
        qkv = meta((t, (heads + 2 * kv_heads) * dim), dt)
        staged = meta((4, t), torch.int64).unbind(0)        # ids, positions, pages, slots
        for layer in range(shapes.num_layers):
            rope_and_store(qkv, cos, cos, staged[1], staged[2], staged[3], pool, layer, heads, kv_heads, dim)
