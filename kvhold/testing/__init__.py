"""Local test material: a checkpoint builder (nothing downloaded) and real-process harnesses for a sidecar,
`kvhold serve` and etcd."""
