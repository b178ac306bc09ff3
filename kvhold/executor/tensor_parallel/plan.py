"""What a tensor-parallel group of N ranks splits, and how.

Megatron-style: q/k/v and gate/up are column-parallel (each rank computes its heads' and
its share of the MLP's columns), o_proj and down_proj are row-parallel (each rank
multiplies its slice of the inputs and the group sums the partial outputs with one
all-reduce). Norms, embeddings and the LM head are replicated. Each rank's KV pages hold
its own num_kv_heads / N heads only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvhold.protocol.layout import KvGeometry
from kvhold.protocol.model_spec import ModelSpec
from kvhold.protocol.tensor_parallel import tensor_parallel_refusal

COLUMN = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "mlp.gate_proj.", "mlp.up_proj.")
ROW = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


@dataclass(frozen=True, slots=True)
class TpPlan:
    spec: ModelSpec       # the whole model
    size: int

    def __post_init__(self):
        if (why := tensor_parallel_refusal(self.spec, self.size)) is not None:
            raise ValueError(why)

    def rank_spec(self) -> ModelSpec:
        """The model one rank runs: its share of the heads, KV heads and MLP width."""
        s = self.spec
        return dataclasses.replace(s, num_heads=s.num_heads // self.size,
                                   num_kv_heads=s.num_kv_heads // self.size,
                                   intermediate_size=s.intermediate_size // self.size)

    def kv_geometry(self, dtype: str, page_tokens: int) -> KvGeometry:
        """One rank's KV page: its own KV heads only."""
        return KvGeometry(num_layers=self.spec.num_layers, num_kv_heads=self.spec.num_kv_heads // self.size,
                          head_dim=self.spec.head_dim, dtype=dtype, page_tokens=page_tokens)

    def shard(self, weights: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        """Rank `rank`'s tensors of a whole checkpoint (contiguous copies)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} outside a group of {self.size}")
        out = {}
        for name, w in weights.items():
            if any(part in name for part in COLUMN):
                w = w.chunk(self.size, dim=0)[rank]
            elif name.endswith(ROW):
                w = w.chunk(self.size, dim=1)[rank]
            out[name] = w.contiguous().clone()
        return out
