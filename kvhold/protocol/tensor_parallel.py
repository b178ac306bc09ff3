"""Whether a tensor-parallel size can serve a model: the checks `kvhold sidecar`, `kvhold
serve` (`pool.tensor_parallel_size`) and the executor groups (kvhold.executor.tensor_parallel)
share. Each rank holds an equal share of the attention heads, the KV heads and the MLP's
intermediate width."""
from __future__ import annotations

from kvhold.protocol.model_spec import CheckpointError, ModelSpec


def tensor_parallel_refusal(spec: ModelSpec | None, size: int, device: str = "cpu") -> str | None:
    """Why a group of `size` ranks cannot serve `spec` on `device` (None: it can)."""
    if size < 1:
        return f"pool.tensor_parallel_size must be at least 1, got {size}"
    if size == 1:
        return None
    if device != "cpu":
        return (f"pool.tensor_parallel_size {size} on {device}: tensor-parallel groups run on CPU (gloo) "
                "only; a CUDA group needs an NCCL communicator, which kvhold does not build yet")
    if spec is None:
        return None
    for what, n in (("attention heads", spec.num_heads), ("KV heads", spec.num_kv_heads),
                    ("MLP intermediate size", spec.intermediate_size)):
        if n % size:
            return (f"pool.tensor_parallel_size {size}: the model's {what} ({n}) do not divide by {size} "
                    "(each rank holds an equal share)")
    if spec.fused_tensors:
        return (f"pool.tensor_parallel_size {size}: {spec.model_type} stores q|k|v and gate|up fused; "
                "kvhold shards separate q/k/v/gate/up tensors only")
    if spec.quant is not None:
        return (f"pool.tensor_parallel_size {size}: the checkpoint's weights are FP8 ({spec.quant.describe}); "
                "kvhold shards float weights only")
    return None


def sidecar_refusal(size: int, model_dir, device: str) -> str | None:
    """Why `kvhold sidecar` / `kvhold serve` cannot run `pool.tensor_parallel_size size` (None: it
    can). The size is checked against the model, and N > 1 against the device: executor groups
    run on CPU (gloo) only."""
    if size == 1:
        return None
    spec = None
    if model_dir is not None and size > 1:
        try:
            spec = ModelSpec.from_dir(model_dir)
        except (CheckpointError, OSError, ValueError):   # reported by the checks of the model itself
            spec = None
    return tensor_parallel_refusal(spec, size, device)


# the program a group's ranks 1..N-1 run (`python -m`): kvhold.executor.tensor_parallel.ranks
FOLLOWER_MODULE = "kvhold.executor.tensor_parallel.ranks"


def follower_pids(leader: int) -> list[int]:
    """The follower ranks (1..N-1) of the group led by `leader` as /proc shows them: the leader's
    children that run FOLLOWER_MODULE, in pid order (their rank order: the leader starts them in
    turn, unless pids wrapped between them). A sidecar that re-adopts a group (it
    got no `Ready` naming them) watches these; tests and tools check what the sidecar reports."""
    import os

    from kvhold.protocol.procfs import stat_fields

    followers = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = stat_fields(int(name))
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if fields and int(fields[1]) == leader and FOLLOWER_MODULE.encode() in cmd.split(b"\0"):
            followers.append(int(name))
    return sorted(followers)
