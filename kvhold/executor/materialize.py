"""Point a meta-device torch module at the sidecar's weights region: no copy, no load.

Contract of `materialize(module, weights, *, strict=True, init_buffers=None, rename=None)`:

* `module` is any `nn.Module`, normally built under `torch.device("meta")`, whose
  parameter and buffer names (after `rename`) are the checkpoint's tensor names
  (Hugging Face names, as in `kvhold.protocol.checkpoint.Manifest`).
* `weights` is an `kvhold.executor.weights.WeightsRegion` (a mapped region plus its
  manifest: what an executor holds, or what `open_host_weights` returns) or any
  mapping name -> tensor.
* Every parameter and buffer the checkpoint provides is replaced by a tensor that
  views the region (same storage: `data_ptr` inside the mapping), whatever device
  the old one was on. Parameters become `nn.Parameter(view, requires_grad=False)`.
  The region stores the checkpoint's dtype: a module built in another dtype is an
  error, never a silent cast (a cast would be a copy).
* Tied parameters (one Parameter object under several names, e.g. `lm_head.weight`
  and `model.embed_tokens.weight`) stay tied: every alias gets the same new
  Parameter. If the checkpoint holds several aliases, their contents must agree.
* Buffers the checkpoint does not provide and that are still on meta (rotary
  `inv_freq`, ...) are allocated on the region's device and handed, per owning
  submodule, to `init_buffers(submodule_name, submodule)` to recompute; the hook
  must write only those buffers. With `transformers`, `model._init_weights` fits.
* strict: every problem is collected and raised as one `MaterializeError` naming
  the tensors: shape or dtype mismatches, parameters or buffers still on meta,
  checkpoint tensors nothing consumed. Non-strict: mismatches still raise; the
  rest is left as it is for the caller.
* The views are read-only memory (PROT_READ on the host backend): an in-place write
  to a weight kills the process with SIGSEGV instead of corrupting every executor.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Callable, Mapping as MappingT

import posix_ipc
import torch
from torch import nn

from kvhold.executor.weights import WeightsRegion, wait_until_sealed
from kvhold.protocol.checkpoint import build_manifest
from kvhold.protocol.memory import HOST_ALIGN, Mapping, RegionInfo, round_up
from kvhold.protocol.model_spec import ModelSpec
from kvhold.protocol.naming import InstancePaths
from kvhold.protocol.tables import Tables

log = logging.getLogger(__name__)
MAX_LISTED = 8


class MaterializeError(ValueError):
    """The module and the checkpoint in the weights region do not match."""


def materialize(module: nn.Module, weights, *, strict: bool = True,
                init_buffers: Callable[[str, nn.Module], None] | None = None,
                rename: Callable[[str], str] | None = None) -> nn.Module:
    """Replace the module's tensors by views of `weights` (see the module docstring)."""
    views = weights.tensors() if hasattr(weights, "tensors") else dict(weights)
    rename = rename or (lambda name: name)
    problems: list[str] = []
    used: set[str] = set()
    for slots in _slots(module, "_parameters").values():
        _bind(slots, views, rename, used, problems, as_parameter=True)
    pending: dict[str, nn.Module] = {}
    for slots in _slots(module, "_buffers").values():
        if not _bind(slots, views, rename, used, problems, as_parameter=False):
            _allocate_buffer(slots, _device_of(views), pending)
    if problems:
        raise MaterializeError(_summary("tensors do not match the checkpoint", problems))
    if pending and init_buffers is not None:
        with torch.no_grad():
            for owner_name, owner in pending.items():
                init_buffers(owner_name, owner)
    if strict:
        _check_complete(module, views, used, pending, init_buffers)
    return module


def _slots(module: nn.Module, kind: str) -> dict[int, list[tuple[str, nn.Module, str]]]:
    """id(tensor) -> every (qualified name, owner, attribute) holding it (tied aliases)."""
    out: dict[int, list] = defaultdict(list)
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for attr, tensor in getattr(owner, kind).items():
            if tensor is not None:
                out[id(tensor)].append((f"{owner_name}.{attr}" if owner_name else attr, owner, attr))
    return out


def _bind(slots, views, rename, used: set[str], problems: list[str], as_parameter: bool) -> bool:
    """Point every alias in `slots` at its checkpoint view. False if the checkpoint has none."""
    names = list(dict.fromkeys(rename(qual) for qual, _, _ in slots))
    found = [n for n in names if n in views]
    if not found:
        return False
    used.update(found)
    name, old = found[0], getattr(slots[0][1], slots[0][2])
    view = views[name]
    if tuple(view.shape) != tuple(old.shape) or view.dtype != old.dtype:
        problems.append(f"{name}: module has {list(old.shape)} {old.dtype}, checkpoint "
                        f"{list(view.shape)} {view.dtype}")
        return True
    for other in found[1:]:
        if views[other].data_ptr() != view.data_ptr() and not torch.equal(views[other], view):
            problems.append(f"{other}: tied to {name} in the module but differs in the checkpoint")
    new = nn.Parameter(view, requires_grad=False) if as_parameter else view
    for _, owner, attr in slots:
        getattr(owner, "_parameters" if as_parameter else "_buffers")[attr] = new
    return True


def _device_of(views: MappingT[str, torch.Tensor]) -> torch.device:
    return next(iter(views.values())).device if views else torch.device("cpu")


def _allocate_buffer(slots, device: torch.device, pending: dict[str, nn.Module]) -> None:
    """A meta buffer the checkpoint lacks: real (uninitialised) memory, owner queued for init."""
    qual, owner, attr = slots[0]
    old = owner._buffers[attr]
    if not old.is_meta:
        return
    new = torch.empty(old.shape, dtype=old.dtype, device=device)
    for alias_qual, alias_owner, alias_attr in slots:
        alias_owner._buffers[alias_attr] = new
        pending[alias_qual.rpartition(".")[0]] = alias_owner


def _check_complete(module, views, used: set[str], pending, init_buffers) -> None:
    problems = [f"parameter {n} is still on meta (not in the checkpoint)"
                for n, p in module.named_parameters() if p.is_meta]
    problems += [f"buffer {n} is still on meta" for n, b in module.named_buffers() if b.is_meta]
    if pending and init_buffers is None:
        problems += [f"buffers of {n or '<root>'} are not in the checkpoint: pass init_buffers= "
                     "to recompute them" for n in pending]
    problems += [f"checkpoint tensor {n} matches no parameter or buffer"
                 for n in views if n not in used]
    if problems:
        raise MaterializeError(_summary("incomplete materialization", problems))


def _summary(title: str, problems: list[str]) -> str:
    more = f"; and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    return f"{title}: " + "; ".join(problems[:MAX_LISTED]) + more


def region_bounds(weights: WeightsRegion) -> tuple[int, int]:
    """[start, end) addresses of a mapped weights region, to check that views point into it."""
    base = weights.mapping.tensor(torch.uint8, (weights.mapping.size,))
    return base.data_ptr(), base.data_ptr() + weights.mapping.size


def open_host_weights(instance: str, model_dir: str | Path, timeout_s: float = 30.0) -> WeightsRegion:
    """Map a running host-backend sidecar's sealed weights region read-only, by name.

    For inspectors, tests and processes that are not executors (executors get the
    region descriptor and manifest in their attach reply instead). Waits until the
    region is sealed and checks that its fingerprint is the one this checkpoint's
    manifest implies, so a stale or foreign region is never mapped.
    """
    paths = InstancePaths.for_instance(instance)
    manifest = build_manifest(model_dir, ModelSpec.from_dir(model_dir))
    tables = Tables.attach_name(paths.shm_name("tables"))
    try:
        # epoch -1 is never designated: this only waits for (and checks) the seal
        wait_until_sealed(tables, manifest.fingerprint, -1, lambda: None, timeout_s)
    finally:
        tables.close()
    try:
        shm = posix_ipc.SharedMemory(paths.shm_name("weights"), read_only=True)
    except posix_ipc.ExistentialError:
        raise FileNotFoundError(f"instance {instance!r} has no host weights region (a cuda-backend "
                                "sidecar hands its weights to executors only)") from None
    try:
        info = RegionInfo("weights", round_up(manifest.region_bytes, HOST_ALIGN), "host", True)
        mapping = Mapping.from_fd(shm.fd, info)
    finally:
        shm.close_fd()
    return WeightsRegion(mapping, manifest, model_dir)


def rebind_unchanged(model: nn.Module, region: MappingT[str, torch.Tensor],
                     rename: Callable[[str], str] | None = None) -> list[str]:
    """After an engine loaded its own copies: replace every parameter that equals the region
    tensor of its (renamed) name (shape, dtype, device and bytes) by that tensor, a view.

    A tensor the engine fused, sharded, cast or repacked never qualifies, so what the engine
    computes with is unchanged. Returns the rebound names (the module's own names)."""
    rename = rename or (lambda name: name)
    same, views = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        t = region.get(rename(name))
        if (t is None or tuple(t.shape) != tuple(p.shape) or t.dtype != p.dtype or t.device != p.device
                or not torch.equal(t, p.detach())):
            continue
        same[name] = t
    if same:
        views = dict(same)
        materialize(model, views, strict=False)
    return sorted(same)
