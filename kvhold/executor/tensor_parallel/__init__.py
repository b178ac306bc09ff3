"""Tensor parallelism: one model split across the ranks of an executor group.

* `plan`: which sizes a group of N ranks can split (heads, KV heads, MLP width), the
  Megatron-style shard of every weight (column-parallel q/k/v/gate/up, row-parallel
  o/down), and the per-rank KV geometry (each rank holds its own KV heads' pages).
* `model`: `TensorParallelLlama`, the reference decoder over one rank's shard, with an
  all-reduce after each row-parallel projection.
* `ranks`: groups served by the sidecar: an executor is the group's leader (rank 0), its
  followers are its children over the sidecar's KV pool and weights
  (docs/ARCHITECTURE.md, "Tensor-parallel groups").
"""
from kvhold.executor.tensor_parallel.plan import TpPlan, tensor_parallel_refusal

__all__ = ["TpPlan", "tensor_parallel_refusal"]
