"""One rank's decoder: the reference Llama layers over a shard, summing the row-parallel
projections (o_proj, down_proj) across the group with an all-reduce. Every rank ends a
step with the same hidden states and the same (replicated) logits."""
from __future__ import annotations

from typing import Callable

import torch

from kvhold.executor.llama import LlamaModel
from kvhold.executor.tensor_parallel.plan import ROW, TpPlan


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(t)
    return t


class TensorParallelLlama(LlamaModel):
    def __init__(self, plan: TpPlan, shard: dict[str, torch.Tensor], compute_dtype: torch.dtype,
                 max_positions: int, reduce: Callable[[torch.Tensor], torch.Tensor] = _all_reduce):
        super().__init__(plan.rank_spec(), shard, compute_dtype, torch.device("cpu"), max_positions)
        self.plan = plan
        self.reduce = reduce

    def _linear(self, x, name: str, bias: bool = False):
        out = super()._linear(x, name, bias)
        if self.plan.size > 1 and name.endswith(ROW):
            out = self.reduce(out.contiguous())
        return out
