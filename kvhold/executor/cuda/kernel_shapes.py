"""KernelShapes: the shapes an executor's GPU kernels will run at, known before it starts.

The zygote compiles the executor's Triton kernels ahead of time (kvhold.executor.cuda.triton_aot)
without a model loaded and without a CUDA context; this value tells it what to
compile for. The sidecar sends it as JSON (a kvhold.protocol.settings.KernelShapesRequest:
its executor settings plus the table geometry, see `from_settings`); the kernel
modules' warm-ups read it to build meta tensors shaped like the ones the executor
will pass. A shape that turns out wrong costs speed only: launches that do not match a prepared specialization take the JIT.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import torch

from kvhold.protocol.layout import TableGeometry
from kvhold.protocol.settings import ExecutorSettings, KernelShapesRequest

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}


@dataclass(frozen=True, slots=True)
class KernelShapes:
    dtype: str                  # compute dtype, also the KV pool's
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    page_tokens: int
    num_pages: int
    max_seq_len: int            # also the rope tables' length
    max_batch: int              # decode runs padded to exactly this many rows
    prefill_chunk: int          # rows of a prefill chunk (padded to it, but for exact prefill)
    kv_dtype: str = ""          # the KV pool's dtype when it differs from `dtype`
    qk_norm: bool = False       # RMSNorm of each query and key head (Qwen3)
    fp8: str = ""               # FP8 Linear weights' scales: "" (none), "rows" (one per output row), "BNxBK" blocks

    def __post_init__(self):
        for name in ("dtype", "kv_dtype"):
            value = getattr(self, name)
            if value and value not in _DTYPES:
                raise ValueError(f"kernel shapes: {name} {value!r} not one of {sorted(_DTYPES)}")
        for name, value in asdict(self).items():
            if isinstance(value, int) and not isinstance(value, bool) and value < 1:
                raise ValueError(f"kernel shapes: {name}={value} must be positive")
        if self.fp8 not in ("", "rows"):
            parts = self.fp8.split("x")
            if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise ValueError(f"kernel shapes: fp8 {self.fp8!r} is not '', 'rows' or 'BNxBK'")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("kernel shapes: num_heads must be a multiple of num_kv_heads")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.kv_dtype or self.dtype]

    @property
    def fp8_scale_block(self) -> tuple[int, int] | None:
        """The (rows, columns) of an FP8 weight's scale block; None for one scale per row (or no FP8)."""
        if self.fp8 in ("", "rows"):
            return None
        bn, bk = self.fp8.split("x")
        return int(bn), int(bk)

    @property
    def max_pages_per_seq(self) -> int:
        """A block table row's width."""
        return math.ceil(self.max_seq_len / self.page_tokens)

    @property
    def kv_pool_shape(self) -> tuple[int, ...]:
        """[page][layer][k/v][token][kv_head][head_dim], as kvhold.executor.kv_cache lays it out."""
        return (self.num_pages, self.num_layers, 2, self.page_tokens, self.num_kv_heads, self.head_dim)

    @classmethod
    def from_settings(cls, settings: ExecutorSettings, geometry: TableGeometry) -> "KernelShapes | None":
        """From the sidecar's executor settings and its table geometry. None when there is no
        model or the executors do not run on CUDA."""
        if not settings.model or not settings.device.startswith("cuda"):
            return None
        from kvhold.executor.engine_workload import cuda_prefill_chunk
        from kvhold.protocol.model_spec import ModelSpec

        spec = ModelSpec.from_dir(settings.model)
        chunk = cuda_prefill_chunk(settings.prefill_chunk, settings.max_batch_tokens, settings.max_batch,
                                   settings.exact_prefill)
        return cls(dtype=settings.compute_dtype or spec.dtype, num_layers=spec.num_layers,
                   num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                   hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                   vocab_size=spec.vocab_size, page_tokens=geometry.kv.page_tokens,
                   num_pages=geometry.num_pages, max_seq_len=geometry.max_seq_len,
                   max_batch=settings.max_batch, prefill_chunk=chunk, kv_dtype=geometry.kv.dtype,
                   qk_norm=spec.qk_norm, fp8=fp8_scales(spec))

    @classmethod
    def from_json(cls, text: str) -> "KernelShapes | None":
        """Either a KernelShapes' own fields or a KernelShapesRequest (`from_settings`' input)."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("kernel shapes: expected a JSON object")
        if "num_heads" in data:
            return cls(**data)
        request = KernelShapesRequest.from_wire(data)
        return cls.from_settings(request.settings, request.geometry)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def fp8_scales(spec) -> str:
    """KernelShapes.fp8 of a model: how its FP8 weights are scaled, as the FP8 kernel takes them."""
    quant = spec.quant
    if quant is None:
        return ""
    if quant.strategy == "block":
        return f"{quant.block[0]}x{quant.block[1]}"
    return "rows"
