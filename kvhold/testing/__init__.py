"""Local test material: a checkpoint builder (nothing downloaded), real-process harnesses for a
sidecar and etcd, and a standalone tensor-parallel group machinery (tensor_parallel_group)."""
