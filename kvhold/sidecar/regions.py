"""The memory the sidecar owns and executors map: the tables segment, the KV pool, the weights.

`create_regions` makes the KV pool and (with a model) the weights region, on the
host (POSIX shm) or on a CUDA device (VMM), calling `on_created` with each as it
is made so its owner can register the unlink at once. `PoolMemory` describes the
regions to an attaching executor and exports their descriptors: the weights are
read-only except to the designated loader.
"""
from __future__ import annotations

import os
from typing import Callable

from kvhold.protocol.memory import CudaRegion, HostRegion
from kvhold.protocol.naming import InstancePaths
from kvhold.protocol.tables import Tables


def create_regions(sizes: dict[str, int], pool_config, paths: InstancePaths,
                   on_created: Callable[[object], None], adopt: bool = False) -> dict:
    """`sizes`: region name -> bytes; `pool_config`: SidecarConfig.pool (backend, device);
    `adopt`: open a dead predecessor's host regions by name instead (kvhold.sidecar.adoption)."""
    regions = {}
    device = int(pool_config.device.partition(":")[2] or 0) if pool_config.backend == "cuda" else 0
    if adopt and pool_config.backend != "host":
        raise ValueError("only host memory can be adopted by name")
    for index, (name, size) in enumerate(sizes.items()):
        if pool_config.backend == "cuda":
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
