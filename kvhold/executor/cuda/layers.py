"""The decoder layers on CUDA with fused projections and fused elementwise kernels.

Same model as kvhold.executor.llama (which keeps the float64 reference on CPU), shaped for
a GPU step that is bound by reading weights:

* q|k|v and gate|up each run as ONE GEMM over a view that spans the adjacent
  weight tensors: the sidecar's weights region stores a layer's tensors in config
  order (kvhold.protocol.checkpoint), so q_proj, k_proj, v_proj (and gate_proj, up_proj) lie
  back to back and their concatenation is a view, not a copy. Where they are not
  adjacent (weights loaded tensor by tensor), each projection runs on its own and
  the outputs are concatenated (activations only; weights are never copied).
* o_proj and down_proj add into the residual inside the GEMM (`addmm_`, beta = 1).
* A decode batch of at most 64 rows runs its projections on kvhold.executor.cuda.gemm's
  kernel, which streams each weight once; a decode batch of 65..256 rows and an exact
  prefill chunk (`layers(exact=True)`) run them on the same kernel in bigger tiles, each
  row's bits those a 16-row decode step gives it (kvhold.executor.cuda.runner); other
  prefill chunks run on cuBLAS.
* RMSNorm, RoPE with the KV store into the pool, and SiLU-times-up are one kernel
  each (kvhold.executor.cuda.kernels). Qwen3's RMSNorm of each query and key head runs the
  same row kernel over the heads, before RoPE; Phi-3's single q|k|v and gate|up tensors are
  the fused projections as they are stored.
* A decode step's attention applies RoPE and stores the keys and values itself
  (kvhold.executor.cuda.attention.rope_decode_attention): 8 launches per layer instead of 9.
  Folding RMSNorm into the next GEMM as well (row sums of squares left by the GEMM
  that wrote the residual, the norm applied to each x tile in the K loop) was tried
  and made the GEMMs 38% slower on the H200 (x no longer feeds the tensor cores
  straight from the pipelined loads): bench/results/decode_cuda_norm_folded.json.

Eight launches per decode layer (nine per prefill layer) instead of about forty. Enabled on every CUDA device unless
KVHOLD_FUSED=0 (which tools/bench_decode uses to measure the unfused baseline).

FP8 weights (kvhold.executor.fp8) stay FP8 in the region. By default each projection reads
them as FP8 and dequantizes them in registers (kvhold.executor.cuda.fp8_gemm), on the tiles of
the kernels above, so decode stays batch-invariant and exact prefill applies; a projection that
kernel cannot take has its weight(s) dequantized per call (one temporary per projection) and
runs on the kernels above. With KVHOLD_FP8_SCALED_MM=1 per-channel and per-tensor FP8 weights
run on torch._scaled_mm instead (per-row dynamic activation scales), which is not known to be
batch-invariant: exact prefill is then off. Block-scaled weights never take _scaled_mm.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kvhold.executor.cuda import fp8_gemm
from kvhold.executor.cuda import gemm as cuda_gemm
from kvhold.executor.cuda.gemm import add_linear_, linear
from kvhold.executor.cuda.kernels import rmsnorm, rope_and_store, silu_mul
from kvhold.executor.fp8 import Fp8Weight, scaled_mm_applies, scaled_mm_enabled, scaled_mm_linear


def fused_enabled() -> bool:
    return os.environ.get("KVHOLD_FUSED", "1") != "0"


def adjacent_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One tensor spanning `tensors` (same dtype, same trailing shape, contiguous, stored
    back to back in one storage), as a view; None if they are not laid out that way."""
    first = tensors[0]
    tail = first.shape[1:]
    if any(t.dtype != first.dtype or t.shape[1:] != tail or not t.is_contiguous() for t in tensors):
        return None
    end = first.data_ptr()
    for t in tensors:
        if t.data_ptr() != end:
            return None
        end += t.numel() * t.element_size()
    storage = first.untyped_storage()
    if end > storage.data_ptr() + storage.nbytes():
        return None
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *tail), first.stride())


class _Projection:
    """x @ [w_1; w_2; ...].T (+ bias): one GEMM over an adjacent view, else one per part."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None):
        self.fused = adjacent_view(weights)
        self.parts = weights
        self.bias_parts = biases
        self.bias = None
        if biases is not None:
            self.bias = adjacent_view(biases)
            if self.bias is None:
                self.bias = torch.cat(biases)          # biases are tiny

    def __call__(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        if self.fused is not None:
            return linear(x, self.fused, self.bias, exact=exact)
        if exact:
            raise RuntimeError("exact prefill needs each projection's weights adjacent (one GEMM)")
        biases = self.bias_parts or [None] * len(self.parts)
        return torch.cat([F.linear(x, w, b) for w, b in zip(self.parts, biases)], dim=-1)


class _Fp8Projection:
    """As _Projection, over weights of which some or all are FP8.

    * In registers (the default where it applies): every part FP8 with the same kind of scales,
      the parts adjacent in the region (one [N, K] FP8 view, as the region lays out a layer's
      q|k|v and gate|up): kvhold.executor.cuda.fp8_gemm reads the FP8 bytes and dequantizes each
      tile in registers. Exact prefill and decode take it at every row count (a row's bits are
      the same at any count there; on the H200 they are also the dequantized path's).
    * Dequantized: the parts dequantized to `dtype` and concatenated, one GEMM on the
      batch-invariant kernels (a projection the kernel cannot take, at every row count) or on
      cuBLAS (a prefill chunk of more than 64 rows without exact prefill, as bf16 weights).
    * KVHOLD_FP8_SCALED_MM=1: each FP8 part on torch._scaled_mm where it applies (`fused` is then
      None: not batch-invariant)."""

    def __init__(self, weights: list, biases: list[torch.Tensor] | None, dtype: torch.dtype):
        self.parts = weights
        self.dtype = dtype
        self.bias = None if biases is None else torch.cat(biases)      # biases are tiny
        self.bias_parts = biases
        self.scaled = scaled_mm_enabled() and all(isinstance(w, Fp8Weight) and scaled_mm_applies(w)
                                                  for w in weights)
        self.fused = None if self.scaled else True      # dequantized: one contiguous weight per call
        self.fp8 = None if self.scaled or biases is not None else _fp8_operands(weights)

    def dense(self) -> torch.Tensor:
        ws = [w.dequantize(self.dtype) if isinstance(w, Fp8Weight) else w for w in self.parts]
        return ws[0] if len(ws) == 1 else torch.cat(ws)

    def _in_registers(self, x: torch.Tensor, exact: bool) -> bool:
        if self.fp8 is None or not cuda_gemm.enabled():
            return False
        w, _, block = self.fp8
        # exact (exact prefill, decode past MAX_ROWS rows): at any row count, so that a row's bits
        # never depend on which path its chunk took; otherwise as gemm.linear: the kernel's tiles up
        # to MAX_ROWS rows, cuBLAS on the dequantized weight beyond
        return (exact or x.shape[0] <= cuda_gemm.MAX_ROWS) and fp8_gemm.applies(x, w.shape[0], w.shape[1], block)

    def __call__(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        if self._in_registers(x, exact):
            return fp8_gemm.fp8_linear(x, *self.fp8)
        if not self.scaled:
            return linear(x, self.dense(), self.bias, exact=exact)
        if exact:
            raise RuntimeError("exact prefill needs the dequantized FP8 path (KVHOLD_FP8_SCALED_MM=0)")
        biases = self.bias_parts or [None] * len(self.parts)
        outs = [scaled_mm_linear(x, w, b) for w, b in zip(self.parts, biases)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def add_into_(self, h: torch.Tensor, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """h += x @ w.T (o_proj, down_proj)."""
        if h.stride(1) == 1 and self._in_registers(x, exact):
            return fp8_gemm.fp8_linear(x, *self.fp8, residual=h, out=h)
        if not self.scaled:
            return add_linear_(h, x, self.dense(), exact)
        if exact:
            raise RuntimeError("exact prefill needs the dequantized FP8 path (KVHOLD_FP8_SCALED_MM=0)")
        return h.add_(scaled_mm_linear(x, self.parts[0]))


def _fp8_operands(parts: list) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None] | None:
    """(weight [N, K] FP8 view, float32 scales, block) for kvhold.executor.cuda.fp8_gemm over the
    parts as one weight, or None where the kernel cannot take them: a part not FP8, parts not
    adjacent, mixed kinds of scales, block rows that do not tile a part."""
    if not all(isinstance(w, Fp8Weight) for w in parts):
        return None
    strategies = {w.strategy for w in parts}
    blocks = {w.block for w in parts}
    weight = adjacent_view([w.weight for w in parts])
    if weight is None or len(strategies) != 1 or len(blocks) != 1:
        return None
    if strategies == {"block"}:
        block = parts[0].block
        if any(w.shape[0] % block[0] for w in parts[:-1]):
            return None
        scale = torch.cat([w.scale.to(torch.float32).reshape(-(-w.shape[0] // block[0]), -1) for w in parts])
        return weight, scale.contiguous(), block
    scale = torch.cat([w.row_scales().reshape(-1) for w in parts])       # one float32 a row (small)
    return weight, scale.contiguous(), None


def _projection(weights: list, biases, dtype):
    if any(isinstance(w, Fp8Weight) for w in weights):
        return _Fp8Projection(weights, biases, dtype)
    return _Projection(weights, biases)


class FusedLayers:
    def __init__(self, model):
        spec = model.spec
        self.spec = spec
        self.model = model
        self.eps = spec.rms_norm_eps
        self.layers_w = []
        self.qk_norms = []          # per layer: (q_norm, k_norm) weights (Qwen3), else None
        for layer in range(spec.num_layers):
            p = f"model.layers.{layer}."
            w, lw = model._weight, model.linear_weight       # lw: FP8 weights stay FP8
            bias = [w(p + f"self_attn.{x}_proj.bias") for x in "qkv"] if spec.attention_bias else None
            if spec.fused_tensors:      # Phi-3 stores q|k|v and gate|up as one tensor each
                qkv_w, gate_up_w = [lw(p + "self_attn.qkv_proj.weight")], [lw(p + "mlp.gate_up_proj.weight")]
            else:
                qkv_w = [lw(p + f"self_attn.{x}_proj.weight") for x in "qkv"]
                gate_up_w = [lw(p + "mlp.gate_proj.weight"), lw(p + "mlp.up_proj.weight")]
            o_w, down_w = lw(p + "self_attn.o_proj.weight"), lw(p + "mlp.down_proj.weight")
            self.layers_w.append((
                w(p + "input_layernorm.weight"),
                _projection(qkv_w, bias, model.dtype),
                _Fp8Projection([o_w], None, model.dtype) if isinstance(o_w, Fp8Weight) else o_w,
                w(p + "post_attention_layernorm.weight"),
                _projection(gate_up_w, None, model.dtype),
                _Fp8Projection([down_w], None, model.dtype) if isinstance(down_w, Fp8Weight) else down_w,
            ))
            self.qk_norms.append((w(p + "self_attn.q_norm.weight"), w(p + "self_attn.k_norm.weight"))
                                 if spec.qk_norm else None)
        self.norm = w("model.norm.weight")

    @property
    def fused_gemms(self) -> bool:
        return all(qkv.fused is not None and gu.fused is not None for _, qkv, _, _, gu, _ in self.layers_w)

    def projection_shapes(self) -> tuple[tuple[int, int], ...]:
        """(N, K) of a layer's q|k|v, o, gate|up and down projections."""
        spec = self.spec
        hidden, q = spec.hidden_size, spec.num_heads * spec.head_dim
        qkv = q + 2 * spec.num_kv_heads * spec.head_dim
        return ((qkv, hidden), (hidden, q), (2 * spec.intermediate_size, hidden), (hidden, spec.intermediate_size))

    def batch_invariant(self, rows: int) -> bool:
        """Whether a decode step of `rows` rows runs every projection on kvhold.executor.cuda.gemm's
        kernel (whose rows come out the same at any row count)."""
        shapes = self.projection_shapes() + ((self.model.lm_head.shape[0], self.spec.hidden_size),)
        scaled = any(isinstance(x, _Fp8Projection) and x.scaled for layer in self.layers_w for x in layer)
        return (cuda_gemm.enabled() and self.fused_gemms and not self.spec.attention_bias and not scaled
                and self.model.dtype in (torch.bfloat16, torch.float16)
                and all(cuda_gemm.decode_fits(n, k, rows) for n, k in shapes))

    def exact_prefill(self, max_batch: int) -> str | None:
        """Why a prefill chunk cannot compute its rows as decode does (None: it can). It can
        where decode is batch-invariant at `max_batch` rows and every projection runs on
        the same kernel at any row count (kvhold.executor.cuda.gemm.exact_linear)."""
        if not self.batch_invariant(max_batch):
            return ("the decode step is not on the batch-invariant kernels (needs bf16/fp16, no projection "
                    "biases, adjacent q|k|v and gate|up weights, max_batch <= 256, KVHOLD_SKINNY_GEMM on, "
                    "FP8 weights dequantized: KVHOLD_FP8_SCALED_MM off)")
        return None

    def layers(self, token_ids, positions, write_pages, write_slots, kv, attend, attend_qkv=None,
               exact: bool = False) -> torch.Tensor:
        """As LlamaModel.layers; with `attend_qkv(layer, qkv)`, attention also applies RoPE and
        stores the step's keys and values itself (kvhold.executor.cuda.attention.rope_decode_attention).
        `exact`: every projection on kvhold.executor.cuda.gemm.exact_linear, whatever the rows
        (the caller checked `exact_prefill`)."""
        spec, model = self.spec, self.model
        t = token_ids.shape[0]
        heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        h = model.w["model.embed_tokens.weight"][token_ids].to(model.dtype)
        for layer, (ln1, qkv_proj, o_w, ln2, gate_up, down_w) in enumerate(self.layers_w):
            qkv = qkv_proj(rmsnorm(h, ln1, self.eps), exact)
            if self.qk_norms[layer] is not None:
                self._norm_heads(qkv, *self.qk_norms[layer])
            if attend_qkv is not None:
                attn = attend_qkv(layer, qkv)
            else:
                rope_and_store(qkv, model.cos, model.sin, positions, write_pages, write_slots, kv.pool, layer,
                               heads, kv_heads, dim)
                attn = attend(layer, qkv[:, :heads * dim].view(t, heads, dim))
            _add_linear_(h, attn.reshape(t, -1), o_w, exact)
            _add_linear_(h, silu_mul(gate_up(rmsnorm(h, ln2, self.eps), exact)), down_w, exact)
        return h

    def _norm_heads(self, qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor) -> None:
        """RMSNorm of each query head and each key head of `qkv` [T, (H + 2 KV) * D], in place,
        before RoPE (Qwen3): the row kernel over [T * heads, D] copies of the two slices. Each
        row's arithmetic is the row kernel's, whatever T is, so decode stays batch-invariant."""
        spec = self.spec
        t, dim = qkv.shape[0], spec.head_dim
        nq, nk = spec.num_heads * dim, spec.num_kv_heads * dim
        for start, width, weight in ((0, nq, q_norm), (nq, nk, k_norm)):
            part = qkv[:, start:start + width]
            part.copy_(rmsnorm(part.reshape(-1, dim), weight, self.eps).view(t, width))

    def logits(self, h: torch.Tensor, head: torch.Tensor, exact: bool = False) -> torch.Tensor:
        return linear(rmsnorm(h, self.norm, self.eps), head, exact=exact)


def _add_linear_(h: torch.Tensor, x: torch.Tensor, w, exact: bool) -> torch.Tensor:
    """h += x @ w.T for a weight in the compute dtype or an FP8 one (_Fp8Projection)."""
    if isinstance(w, _Fp8Projection):
        return w.add_into_(h, x, exact)
    return add_linear_(h, x, w, exact)
