"""How a process that computes with torch on the CPU sets itself up: its thread count, and
glibc's malloc told to keep large blocks.

A CPU step allocates and frees tensors of up to a few MB at every layer (a sequence's
gathered keys and values, the attention scores). glibc serves a block over its mmap
threshold with a fresh mapping and unmaps it at free, so every step faulted in and zeroed
new pages: at a 1,000-token context the demo model's decode step took 2.4 times as long.
A raised mmap threshold, with the heap's trim threshold above it, keeps those blocks in
the heap for the next step. The heap then holds at most TRIM_THRESHOLD of freed memory.
"""
from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3        # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 64 << 20       # blocks up to this size come from the heap
TRIM_THRESHOLD = 128 << 20      # free memory the heap keeps at its top


def keep_large_blocks() -> bool:
    """Raise glibc's mmap and trim thresholds in this process; False where the C library is
    not glibc (nothing changes there)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt        # the C library this process runs on
    except (OSError, AttributeError):
        return False
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.debug("mallopt refused the thresholds: large blocks stay mapped per allocation")
    return ok


def setup(threads: int) -> None:
    """Run torch's CPU operations on `threads` threads, with large blocks kept in the heap."""
    import torch

    torch.set_num_threads(threads)
    keep_large_blocks()
