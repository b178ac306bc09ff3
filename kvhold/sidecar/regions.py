"""The memory the sidecar owns and executors map: the tables segment, the KV pool, the weights.

`create_regions` makes the KV pool and (with a model) the weights region, on the
host (POSIX shm) or on a CUDA device (VMM), calling `on_created` with each as it
is made so its owner can register the unlink at once. `PoolMemory` describes the
regions to an attaching executor and exports their descriptors: the weights are
read-only except to the designated loader. A dead predecessor's regions are adopted: host
ones opened by name, CUDA ones built from the descriptors an executor handed back.
"""
from __future__ import annotations

import os
from typing import Callable

from kvhold.protocol.memory import HOST_ALIGN, AdoptedCudaRegion, CudaRegion, HostRegion, RegionInfo, round_up
from kvhold.protocol.naming import InstancePaths
from kvhold.protocol.tables import Tables


# what a pool restart holds beside the new pool: the old tables, which the frontend process keeps
# mapped (unlinked, still taking space) until it re-executes over the new pool
RESTART_RESERVE = "the old tables during a pool restart"


def shm_needs(tables_bytes: int, sizes: dict[str, int], backend: str, restart_reserve: bool) -> dict[str, int]:
    """What a new pool takes of /dev/shm, by part: the tables, the regions on the host backend,
    and with `restart_reserve` (a frontend in its own process, not in a pool restart's new image,
    whose old tables are out of the free space already) room for the old tables that a later
    pool restart creates the new pool beside."""
    needs = {"tables": tables_bytes, **(sizes if backend == "host" else {})}
    if restart_reserve:
        needs[RESTART_RESERVE] = tables_bytes
    return needs


def _device(pool_config) -> int:
    return int(pool_config.device.partition(":")[2] or 0) if pool_config.backend == "cuda" else 0


def expected_infos(sizes: dict[str, int], pool_config) -> dict[str, RegionInfo]:
    """What each region's RegionInfo is in a pool of these sizes (its size rounded as the
    backend allocates it): a handed-back region must match it (kvhold.sidecar.hand_back)."""
    if pool_config.backend == "cuda":
        from kvhold.protocol import cuda_vmm

        device = _device(pool_config)
        cuda_vmm.init()
        gran = cuda_vmm.granularity(device)
        return {name: RegionInfo(name, cuda_vmm.round_up(size, gran), "cuda", False, device,
                                 cuda_vmm.va_hint(index))
                for index, (name, size) in enumerate(sizes.items())}
    return {name: RegionInfo(name, round_up(size, HOST_ALIGN), "host", False) for name, size in sizes.items()}


def create_regions(sizes: dict[str, int], pool_config, paths: InstancePaths,
                   on_created: Callable[[object], None], adopt: bool = False,
                   taken_back: dict | None = None) -> dict:
    """`sizes`: region name -> bytes; `pool_config`: SidecarConfig.pool (backend, device);
    `adopt`: open a dead predecessor's host regions by name instead (kvhold.sidecar.adoption);
    CUDA regions, which have no name, are built from `taken_back` (name -> (fd, imported
    handle), kvhold.sidecar.hand_back), whose descriptors they then own."""
    regions = {}
    device = _device(pool_config)
    if adopt and pool_config.backend == "cuda" and set(taken_back or {}) != set(sizes):
        raise ValueError("CUDA regions are adopted only from descriptors handed back for each")
    infos = expected_infos(sizes, pool_config) if adopt and pool_config.backend == "cuda" else {}
    for index, (name, size) in enumerate(sizes.items()):
        if pool_config.backend == "cuda" and adopt:
            fd, handle = taken_back[name]
            regions[name] = AdoptedCudaRegion(name, infos[name], fd, handle)
        elif pool_config.backend == "cuda":
            regions[name] = CudaRegion(name, size, device, index)
        else:
            regions[name] = HostRegion(paths.shm_name(name), name, size, adopt=adopt)
        on_created(regions[name])
    return regions


class PoolMemory:
    def __init__(self, tables: Tables, regions: dict):
        self.tables = tables
        self.regions = regions

    def infos(self, writable_weights: bool = False) -> list[dict]:
        infos = [{"name": "tables", "size": self.tables.geometry.total_bytes, "backend": "host",
                  "readonly": False}]
        for name, region in self.regions.items():
            infos.append(region.info(readonly=name == "weights" and not writable_weights).to_wire())
        return infos

    def export_fds(self, writable_weights: bool) -> tuple[list[str], list[int]]:
        names, fds = ["tables"], [os.dup(self.tables.fd)]
        for name, region in self.regions.items():
            names.append(name)
            fds.append(region.export_fd(readonly=name == "weights" and not writable_weights))
        return names, fds
