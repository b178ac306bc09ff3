"""CUDA virtual memory management (cuda.bindings.driver), for the `cuda` backend.

Sidecar side (`VmmAllocation`): cuInit, then cuMemCreate with the POSIX-fd handle
type and cuMemExportToShareableHandle. No context is created: the physical memory
belongs to the allocation handle, which the sidecar holds until it exits, so the
memory outlives every executor that imported it (tools/gpu_probe_vmm.py and the GPU
tests show it on an H200). A restarted sidecar that takes a dead one's memory back from
its executors (`adopt_handle`, kvhold.protocol.hand_back) imports their descriptors, again
with no context, and holds the imported handles instead. Executor side (`VmmMapping`): import the fd, reserve a virtual range at a
deterministic hint (so the same region has the same address in every executor
when the driver honours the hint; `stable` says whether it did), map, set access
read-write or read-only, and expose the range as a torch tensor without copying
(through __cuda_array_interface__).

Imported lazily: CPU-only machines never load CUDA libraries.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

_driver = None


def driver():
    global _driver
    if _driver is None:
        from cuda.bindings import driver as cu  # noqa: PLC0415 (optional dependency)

        _driver = cu
    return _driver


class CudaError(RuntimeError):
    pass


def check(result, what: str):
    """Unpack a cuda-python (CUresult, *values) tuple, raising on error."""
    cu = driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise CudaError(f"{what}: {name.decode() if isinstance(name, bytes) else name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _prop(device: int):
    cu = driver()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def init() -> None:
    check(driver().cuInit(0), "cuInit")


def granularity(device: int) -> int:
    cu = driver()
    return int(check(cu.cuMemGetAllocationGranularity(
        _prop(device), cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
        "cuMemGetAllocationGranularity"))


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def has_current_context() -> bool:
    ctx = check(driver().cuCtxGetCurrent(), "cuCtxGetCurrent")
    return int(ctx) != 0


class VmmAllocation:
    """Physical device memory owned by the sidecar, shareable as POSIX fds."""

    def __init__(self, size: int, device: int):
        init()
        self.device = device
        self.size = round_up(size, granularity(device))
        self.handle = check(driver().cuMemCreate(self.size, _prop(device), 0), "cuMemCreate")

    def export_fd(self) -> int:
        cu = driver()
        fd = check(cu.cuMemExportToShareableHandle(
            self.handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            "cuMemExportToShareableHandle")
        return int(fd)

    def release(self) -> None:
        if self.handle is not None:
            check(driver().cuMemRelease(self.handle), "cuMemRelease")
            self.handle = None


def adopt_handle(fd: int, size: int, device: int):
    """Import a POSIX-fd handle another process received, in a process with no CUDA context
    (a restarted sidecar, kvhold.sidecar.hand_back), and check that it is device memory of
    `device` holding at least `size` bytes: the imported handle is reserved a virtual range
    and mapped there with no access (which the driver refuses for a smaller allocation), then
    unmapped. Returns (the imported handle, which keeps the memory alive until released,
    what was checked). Raises CudaError, naming the check that failed."""
    cu = driver()
    init()
    handle = check(cu.cuMemImportFromShareableHandle(
        fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
        "cuMemImportFromShareableHandle (not a CUDA memory handle)")
    try:
        prop = check(cu.cuMemGetAllocationPropertiesFromHandle(handle),
                     "cuMemGetAllocationPropertiesFromHandle")
        if (prop.location.type != cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                or int(prop.location.id) != device):
            raise CudaError(f"the allocation is not memory of device {device} "
                            f"(location {prop.location.type!r} {int(prop.location.id)})")
        gran = granularity(device)
        checked = f"imported: memory of device {device}, {size} bytes mapped with no context"
        try:
            va = int(check(cu.cuMemAddressReserve(round_up(size, gran), gran, 0, 0), "cuMemAddressReserve"))
        except CudaError as exc:      # a driver that wants a context for it: the importers' map checks
            if "CONTEXT" not in str(exc):
                raise
            va, checked = 0, f"imported: memory of device {device}; size not checked here ({exc})"
        if va:
            try:
                check(cu.cuMemMap(va, size, 0, handle, 0),
                      f"cuMemMap of {size} bytes (the allocation is smaller than the region)")
                check(cu.cuMemUnmap(va, size), "cuMemUnmap")
            finally:
                check(cu.cuMemAddressFree(va, round_up(size, gran)), "cuMemAddressFree")
        if has_current_context():
            raise CudaError("checking the handle made a CUDA context current in the sidecar")
    except BaseException:
        cu.cuMemRelease(handle)
        raise
    return handle, checked


@dataclass
class _CudaArray:
    """Minimal __cuda_array_interface__ exporter: a byte range of device memory."""

    ptr: int
    nbytes: int
    readonly: bool

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, self.readonly),
                "version": 3, "strides": None}


class VmmMapping:
    """An imported allocation mapped into this process (a CUDA context must be current)."""

    def __init__(self, fd: int, size: int, device: int, readonly: bool, va_hint: int = 0):
        cu = driver()
        self.device, self.size, self.readonly = device, size, readonly
        self.handle = check(cu.cuMemImportFromShareableHandle(
            fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            "cuMemImportFromShareableHandle")
        gran = granularity(device)
        try:
            self.va = int(check(cu.cuMemAddressReserve(size, gran, va_hint, 0), "cuMemAddressReserve"))
        except CudaError:            # the hint is only a wish: any address works for correctness
            self.va = int(check(cu.cuMemAddressReserve(size, gran, 0, 0), "cuMemAddressReserve"))
        self.stable = va_hint != 0 and self.va == va_hint
        check(cu.cuMemMap(self.va, size, 0, self.handle, 0), "cuMemMap")
        self.set_access(readonly)
        self._tensor = None

    def set_access(self, readonly: bool) -> None:
        cu = driver()
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.device
        desc.flags = (cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ if readonly
                      else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        check(cu.cuMemSetAccess(self.va, self.size, [desc], 1), "cuMemSetAccess")
        self.readonly = readonly

    def bytes_tensor(self):
        """The whole range as one uint8 torch tensor (no copy)."""
        if self._tensor is None:
            import torch

            self._tensor = torch.as_tensor(_CudaArray(self.va, self.size, False),
                                           device=f"cuda:{self.device}")
        return self._tensor


def va_hint(region_index: int) -> int:
    """A deterministic address per region, far from where the driver usually places things."""
    base = int(os.environ.get("KVHOLD_VA_BASE", str(0x7E00_0000_0000)), 0)
    return base + region_index * (1 << 40)
