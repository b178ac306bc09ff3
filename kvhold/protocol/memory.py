"""Memory regions behind one interface: the sidecar creates, executors map.

A region is a named block of memory owned by the sidecar (`weights`, `kv`). The
sidecar hands executors a file descriptor per region over SCM_RIGHTS (kvhold.protocol.fdpass);
executors never open regions by name. Two backends:

* `host` (`HostRegion`): a POSIX shm object, 0600, named per instance. A read-only
  recipient gets a descriptor opened O_RDONLY, so it cannot map the memory
  writable even by mistake; writes through a PROT_READ mapping raise SIGSEGV.
* `cuda` (`CudaRegion`, over kvhold.protocol.cuda_vmm): physical memory from
  cuMemCreate with the POSIX-fd handle type; the exported fd travels the same
  way and the importer maps it at a deterministic virtual address, read-only for weights.
  A restarted sidecar takes a dead one's CUDA regions back from an executor that kept their
  descriptors (`AdoptedCudaRegion`, kvhold.protocol.hand_back).

`Mapping.tensor` wraps mapped memory as a torch tensor without copying.

POSIX shm is only reserved by ftruncate: a page gets memory when first touched,
and a touch the shm filesystem cannot back (a container's small /dev/shm) kills
the toucher with SIGBUS. So every shm object is backed at creation
(`back_shm`: posix_fallocate), and the sidecar checks the free space of
/dev/shm against the whole pool first (`check_shm_capacity`); both fail with
`ShmCapacityError`, whose message names the size needed and the remedies.
"""
from __future__ import annotations

import errno
import math
import mmap
import os
from dataclasses import dataclass

import numpy as np
import posix_ipc

HOST_ALIGN = mmap.PAGESIZE
SHM_DIR = "/dev/shm"        # where glibc's shm_open keeps POSIX shm objects


class ShmCapacityError(RuntimeError):
    """The shm filesystem cannot hold what the pool needs."""


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def shm_shortage(needs: dict[str, int], free: int, size: int, during: str = "") -> str:
    """The message for too little shared memory: what is needed, what is there, what to do."""
    total = sum(round_up(n, HOST_ALIGN) for n in needs.values())
    suggest = max(64, math.ceil(total * 1.1 / 2**20 / 64) * 64)      # MiB, with some headroom
    parts = ", ".join(f"{name} {_mib(n)}" for name, n in needs.items())
    return (f"not enough shared memory{during}: the pool needs {_mib(total)} in {SHM_DIR} ({parts}) "
            f"but only {_mib(free)} of its {_mib(size)} is free. Unbacked shared memory would kill "
            f"executors with SIGBUS later. Give {SHM_DIR} more: Docker `docker run --shm-size={suggest}m` "
            f"(its default is 64 MB); Kubernetes: mount an `emptyDir: {{medium: Memory, sizeLimit: "
            f"{suggest}Mi}}` volume at {SHM_DIR}; or ask for less: a smaller --kv-pages / --kv-memory, "
            f"--max-requests or --max-seq-len (or --backend cuda: KV pool and weights in device memory)")


def shm_space() -> tuple[int, int]:
    """(free, size) bytes of the shm filesystem, as an unprivileged process may use it."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def check_shm_capacity(needs: dict[str, int]) -> None:
    """Refuse, before creating anything, a pool that the shm filesystem cannot hold."""
    free, size = shm_space()
    if sum(round_up(n, HOST_ALIGN) for n in needs.values()) > free:
        raise ShmCapacityError(shm_shortage(needs, free, size))


def back_shm(fd: int, size: int, name: str) -> None:
    """Give every page of a fresh shm object its memory now (ENOSPC here, not SIGBUS later)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        free, total = shm_space()
        raise ShmCapacityError(shm_shortage({name: size}, free, total,
                                            during=f" while backing {name}")) from None


@dataclass(frozen=True, slots=True)
class RegionInfo:
    """What a recipient needs besides the fd: travels in the attach reply."""

    name: str
    size: int
    backend: str
    readonly: bool
    device: int = -1          # CUDA ordinal for the cuda backend
    va_hint: int = 0          # where every executor asks to map it (cuda backend)

    def to_wire(self) -> dict:
        return {"name": self.name, "size": self.size, "backend": self.backend,
                "readonly": self.readonly, "device": self.device, "va_hint": self.va_hint}

    @classmethod
    def from_wire(cls, d: dict) -> "RegionInfo":
        return cls(name=str(d["name"]), size=int(d["size"]), backend=str(d["backend"]),
                   readonly=bool(d["readonly"]), device=int(d.get("device", -1)),
                   va_hint=int(d.get("va_hint", 0)))

    def with_access(self, readonly: bool) -> "RegionInfo":
        return RegionInfo(self.name, self.size, self.backend, readonly, self.device, self.va_hint)


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class HostRegion:
    """A POSIX shm region owned by the sidecar."""

    backend = "host"

    def __init__(self, shm_name: str, name: str, size: int, adopt: bool = False):
        """`adopt`: open the existing object of a sidecar that died (kvhold.sidecar.adoption)
        instead of creating one; its size must be the one asked for."""
        if size <= 0:
            raise ValueError(f"region {name}: size must be positive, got {size}")
        self.name = name
        self.shm_name = shm_name
        self.size = round_up(size, HOST_ALIGN)
        if adopt:
            self._shm = posix_ipc.SharedMemory(shm_name)
            found = os.fstat(self._shm.fd).st_size
            if found != self.size:
                self._shm.close_fd()
                raise ValueError(f"region {name}: the existing {shm_name} holds {found} bytes, "
                                 f"this pool needs {self.size}")
            return
        self._shm = posix_ipc.SharedMemory(shm_name, flags=posix_ipc.O_CREX, mode=0o600,
                                           size=self.size)
        try:
            os.fchmod(self._shm.fd, 0o600)
            back_shm(self._shm.fd, self.size, name)
        except BaseException:
            self.unlink()
            raise

    def info(self, readonly: bool) -> RegionInfo:
        return RegionInfo(self.name, self.size, self.backend, readonly)

    def export_fd(self, readonly: bool) -> int:
        """A new descriptor for one recipient; the caller closes it after sending."""
        if not readonly:
            return os.dup(self._shm.fd)
        ro = posix_ipc.SharedMemory(self.shm_name, read_only=True)
        try:
            return os.dup(ro.fd)
        finally:
            ro.close_fd()

    def map_local(self) -> "Mapping":
        """A writable mapping in the owner's own process (tests, inspectors)."""
        return Mapping(mmap.mmap(self._shm.fd, self.size), self.info(False))

    def unlink(self) -> None:
        self._shm.close_fd()
        try:
            self._shm.unlink()
        except posix_ipc.ExistentialError:
            pass


class CudaRegion:
    """Device memory owned by the sidecar through a VMM allocation handle (no context).

    Access rights are the importer's to set (CUDA has no read-only export): executors
    map weights read-only by construction, see CudaMapping.
    """

    backend = "cuda"

    def __init__(self, name: str, size: int, device: int, index: int):
        from kvhold.protocol import cuda_vmm

        if size <= 0:
            raise ValueError(f"region {name}: size must be positive, got {size}")
        self.name = name
        self.device = device
        self.allocation = cuda_vmm.VmmAllocation(size, device)
        self.size = self.allocation.size
        self.va_hint = cuda_vmm.va_hint(index)

    def info(self, readonly: bool) -> RegionInfo:
        return RegionInfo(self.name, self.size, self.backend, readonly, self.device, self.va_hint)

    def export_fd(self, readonly: bool) -> int:
        return self.allocation.export_fd()

    def unlink(self) -> None:
        self.allocation.release()


class AdoptedCudaRegion:
    """A dead sidecar's CUDA region, taken back from an executor that kept its descriptor
    (kvhold.protocol.hand_back). An imported handle cannot be exported again, but the received
    POSIX fd is itself the shareable handle: each recipient gets a dup of it. `handle` is this
    process's import of it (kvhold.protocol.cuda_vmm.adopt_handle), which keeps the memory
    alive, as the creator's handle did, until the region is released."""

    backend = "cuda"

    def __init__(self, name: str, info: RegionInfo, fd: int, handle):
        self.name = name
        self.device = info.device
        self.size = info.size
        self.va_hint = info.va_hint
        self.fd = fd
        self.handle = handle

    def info(self, readonly: bool) -> RegionInfo:
        return RegionInfo(self.name, self.size, self.backend, readonly, self.device, self.va_hint)

    def export_fd(self, readonly: bool) -> int:
        return os.dup(self.fd)

    def unlink(self) -> None:
        if self.handle is not None:
            from kvhold.protocol import cuda_vmm

            cuda_vmm.check(cuda_vmm.driver().cuMemRelease(self.handle), "cuMemRelease")
            self.handle = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class CudaMapping:
    """A CUDA region imported and mapped by an executor; tensors alias device memory."""

    def __init__(self, fd: int, info: RegionInfo):
        import torch

        from kvhold.protocol import cuda_vmm

        torch.cuda.init()
        torch.cuda.set_device(info.device)
        torch.zeros(1, device=f"cuda:{info.device}")   # make torch's primary context current
        self.info = info
        self.vmm = cuda_vmm.VmmMapping(fd, info.size, info.device, info.readonly, info.va_hint)

    @property
    def size(self) -> int:
        return self.info.size

    def tensor(self, dtype, shape, offset: int = 0):
        import torch

        shape = tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"region {self.info.name}: [{offset}, {offset + nbytes}) outside "
                             f"its {self.size} bytes")
        return self.vmm.bytes_tensor()[offset:offset + nbytes].view(dtype).view(shape)

    def numpy(self, dtype, shape, offset: int = 0):
        raise TypeError(f"region {self.info.name} is device memory: use tensor()")

    def seal_readonly(self) -> None:
        self.vmm.set_access(readonly=True)
        self.info = self.info.with_access(True)

    def close(self) -> None:
        pass  # unmapped with the process: views may still be alive


def map_region(fd: int, info: RegionInfo):
    """Map a received region with the backend it names."""
    return CudaMapping(fd, info) if info.backend == "cuda" else Mapping.from_fd(fd, info)


class Mapping:
    """A mapped region in an executor. Views share memory with the sidecar's region."""

    def __init__(self, mm: mmap.mmap, info: RegionInfo):
        self._mm = mm
        self.info = info

    @classmethod
    def from_fd(cls, fd: int, info: RegionInfo) -> "Mapping":
        if info.backend != "host":
            raise ValueError(f"region {info.name}: backend {info.backend!r} needs its own mapper")
        size = os.fstat(fd).st_size
        if size < info.size:
            raise ValueError(f"region {info.name}: fd holds {size} bytes, expected {info.size}")
        prot = mmap.PROT_READ if info.readonly else mmap.PROT_READ | mmap.PROT_WRITE
        return cls(mmap.mmap(fd, info.size, flags=mmap.MAP_SHARED, prot=prot), info)

    @property
    def size(self) -> int:
        return self.info.size

    def _check(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"region {self.info.name}: [{offset}, {offset + nbytes}) "
                             f"outside its {self.size} bytes")

    def numpy(self, dtype, shape, offset: int = 0) -> np.ndarray:
        dtype = np.dtype(dtype)
        self._check(offset, int(np.prod(shape)) * dtype.itemsize)
        return np.ndarray(shape, dtype, buffer=self._mm, offset=offset)

    def tensor(self, dtype, shape, offset: int = 0):
        """A torch tensor over [offset, offset + nbytes) without copying."""
        import warnings

        import torch

        shape = tuple(int(s) for s in shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = int(np.prod(shape)) * itemsize
        self._check(offset, nbytes)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffers are intended
            flat = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=offset)
        return flat.view(dtype).view(shape)

    def seal_readonly(self) -> None:
        """mprotect the whole mapping PROT_READ (a loader, once the weights are written)."""
        import ctypes

        anchor = ctypes.c_char.from_buffer(self._mm)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.mprotect(ctypes.addressof(anchor), self.size, mmap.PROT_READ) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mprotect: {os.strerror(err)}")
        self._anchor = anchor  # keep the buffer exported: the mapping must not move or close

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:
            pass  # live views keep the mapping until the process exits
