"""FP8 Linear weights as the sidecar's region holds them, and the arithmetic over them.

A quantized weight (kvhold.protocol.quantization) stays float8_e4m3fn in the region with its
scales beside it; nothing is dequantized into the region or kept dequantized in a process.

* CPU (the reference): `dequantize` to the compute dtype on every use, then the same
  F.linear as a float checkpoint. The dequantized weight depends on nothing but the region's
  bytes, so a row's output depends on the other rows of its batch no more than on a float
  checkpoint (float64: the BLAS's blocking by row count moves the last bits at most). In float64 the product weight * scale is exact (a 4-bit significand times
  a float32 one); in float32 it is rounded once, then cast to a narrower compute dtype once.
  Activations are not quantized: the activation scheme only says how an FP8 GEMM would scale
  them (`scaled_mm_linear`).
* CUDA, the default (kvhold.executor.cuda.fp8_gemm, where it applies): the projection reads
  the FP8 weight and dequantizes each tile in registers with `dequantize`'s arithmetic, then runs
  the batch-invariant bf16 kernel's tensor-core steps on its tiles: one byte a weight read, a
  row's bits the same at any row count (on the H200, the path below's bits too). Where
  it does not apply (parts not adjacent in the region, block rows that do not tile a part) the
  projection's weight is dequantized to bf16 per call into a temporary and multiplied on
  kvhold.executor.cuda.gemm's kernel, at five bytes a weight moved.
* CUDA, opt-in (`KVHOLD_FP8_SCALED_MM=1`): `scaled_mm_linear`, torch._scaled_mm on FP8
  activations (quantized per row at run time with a dynamic scale, or with the checkpoint's
  static input_scale) and FP8 weights with per-output-channel scales (a per-tensor scale is
  broadcast to one per channel). A row's activation scale is its own, but cuBLAS picks the
  FP8 kernel by shape and is not known to be batch-invariant, so exact prefill is off with it
  (the runner says why) and a recompute may differ from an uninterrupted run where rounding
  tips a near-tie. 128x128 block scales have no _scaled_mm form here: they always take the
  default path. Both CUDA paths ran on the GPU (tests/gpu/test_gpu_fp8.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvhold.protocol.model_spec import ModelSpec
from kvhold.protocol.quantization import FP8_MAX


def scaled_mm_enabled() -> bool:
    return os.environ.get("KVHOLD_FP8_SCALED_MM", "0") == "1"


@dataclass(slots=True)
class Fp8Weight:
    """One quantized weight [out, in] (float8_e4m3fn) and its scales, viewing the region."""
    name: str
    weight: torch.Tensor
    scale: torch.Tensor               # [out, 1] channel, [] / [1] tensor, [ceil(out/bn), ceil(in/bk)] block
    strategy: str                     # "channel" | "tensor" | "block"
    block: tuple[int, int] | None = None
    input_scale: torch.Tensor | None = None    # static activations: [] / [1]

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """weight * scale in `dtype`: computed in float64 for a float64 result, else in float32
        and rounded once to `dtype`."""
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        w = self.weight.to(acc)             # a copy (the region's FP8 bytes stay as they are)
        s = self.scale.to(acc)
        if self.strategy == "tensor":
            w.mul_(s.reshape(()))
        elif self.strategy == "channel":
            w.mul_(s.reshape(-1, 1))
        else:
            out, inp = w.shape
            bn, bk = self.block
            if out % bn == 0 and inp % bk == 0:     # whole blocks: a broadcast, no full-size scale tensor
                w.view(out // bn, bn, inp // bk, bk).mul_(s[:, None, :, None])
            else:
                w.mul_(s.repeat_interleave(bn, 0)[:out].repeat_interleave(bk, 1)[:, :inp])
        return w if w.dtype == dtype else w.to(dtype)

    def row_scales(self) -> torch.Tensor:
        """The per-output-channel scales as float32 [1, out] (channel or tensor strategy)."""
        if self.strategy == "block":
            raise ValueError(f"{self.name}: block scales have no per-channel form")
        s = self.scale.to(torch.float32).reshape(-1)
        if self.strategy == "tensor":
            s = s.expand(self.weight.shape[0])
        return s.reshape(1, -1).contiguous()


def fp8_weights(spec: ModelSpec, weights: dict[str, torch.Tensor]) -> dict[str, Fp8Weight]:
    """Every quantized weight of `weights` (the region's views), keyed by its weight name."""
    q = spec.quant
    if q is None:
        return {}
    out = {}
    for name in spec.fp8_weights():
        w = weights[name]
        if w.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}: dtype {w.dtype}, float8_e4m3fn expected ({q.describe})")
        base = name.removesuffix("weight")
        out[name] = Fp8Weight(name=name, weight=w, scale=weights[base + q.scale_name], strategy=q.strategy,
                              block=q.block, input_scale=weights.get(base + "input_scale"))
    return out


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row FP8 quantization: (x / s).to(e4m3), s = max|x_row| / 448 as float32 [M, 1].
    Each row's scale and values depend on that row alone."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def scaled_mm_applies(w: Fp8Weight) -> bool:
    """Whether torch._scaled_mm can take this weight: per-channel or per-tensor scales, and N and
    K multiples of 16 (cuBLASLt's FP8 layout needs)."""
    n, k = w.weight.shape
    return w.strategy in ("channel", "tensor") and n % 16 == 0 and k % 16 == 0


def scaled_mm_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequant(w).T on FP8 tensor cores (CUDA, sm89+): rows of x quantized to e4m3 with
    their own scale (or the static input scale), weight scales per output channel."""
    x2 = x.reshape(-1, x.shape[-1])
    if w.input_scale is not None:
        s = w.input_scale.to(torch.float32).reshape(1, 1)
        xq = (x2.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        sa = s.expand(x2.shape[0], 1).contiguous()
    else:
        xq, sa = quantize_rows(x2)
    out = torch._scaled_mm(xq, w.weight.t(), scale_a=sa, scale_b=w.row_scales(), bias=bias,
                           out_dtype=x.dtype)
    return out.reshape(*x.shape[:-1], out.shape[-1])
