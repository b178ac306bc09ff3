"""A real CUDA fault for crash tests: a kernel that corrupts KV pages, then stores out of bounds.

The classic engine crash is a kernel bug: it writes through a bad index into memory it
can reach (here the start of some KV pages of the shared pool, which already carry
published checksums: the runner names the last sealed page of every other row) and then through an address no allocation covers. The GPU raises
an illegal-address fault (Xid 13/31/43); the launch returns at once, and the error
surfaces at the process's next synchronisation with its context lost for good. Every
later call in that context fails: nothing the executor does afterwards can publish a
token or a checksum, and the pages the kernel wrote are caught by their checksums at
the takeover (docs/ARCHITECTURE.md, sections 5 and 8).

Used by the `cuda_illegal` fault action (kvhold.executor.faults); never on a normal path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SCRIBBLE = 64      # elements overwritten at the start of each named page


@triton.jit
def _scribble_then_fault_kernel(pool_ptr, pages_ptr, n_pages, page_elems, null_offset, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for i in range(n_pages):
        page = tl.load(pages_ptr + i).to(tl.int64)
        tl.store(pool_ptr + page * page_elems + offs, tl.full((BLOCK,), 3.0e4, tl.float32).to(
            pool_ptr.dtype.element_ty))
    # pool_ptr - pool's own address (in elements) + 16: an address near zero, mapped by no one.
    tl.store(pool_ptr + null_offset + offs, tl.zeros((BLOCK,), tl.float32).to(pool_ptr.dtype.element_ty))


def scribble_then_fault(pool: torch.Tensor, pages: list[int]) -> None:
    """Queue the faulting kernel on the current stream; returns before the fault surfaces."""
    if not pool.is_cuda:
        raise RuntimeError("the cuda_illegal fault needs a CUDA executor")
    page_elems = pool[0].numel()
    idx = torch.tensor(sorted(set(pages)) or [0], dtype=torch.int64, device=pool.device)
    null_offset = -(pool.data_ptr() // pool.element_size()) + 16
    _scribble_then_fault_kernel[(1,)](pool, idx, idx.numel(), page_elems, null_offset, BLOCK=SCRIBBLE)
