"""Local test material: a checkpoint builder (nothing downloaded), real-process harnesses for a
sidecar, `kvhold serve` and etcd, and a standalone tensor-parallel group machinery
(tensor_parallel_group)."""
