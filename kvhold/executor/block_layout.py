"""Engine KV block layouts, seen as kvhold's canonical [B, layer, k/v, token, kv_head, head_dim].

An engine that owns its KV pool stores blocks its own way; a `BlockLayout` adapter reads
blocks out of it and writes blocks into it in the canonical shape the KV mirror
(kvhold.executor.kv_mirror) copies to and from kvhold pages. Reads return copies; writes
cast to the engine's dtype only where the dtypes already agree (the mirror checks).
`RowCopy` is the mirror's per-step copy: token rows of engine blocks -> kvhold pages.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


class BlockLayout:
    """An engine's KV blocks seen as kvhold's canonical [B, layer, k/v, token, kv_head, head_dim].

    `head_major` engines store each (layer, k/v) block as [kv_head][token][head_dim]
    ("HND") instead of [token][kv_head][head_dim] ("NHD").
    """

    def __init__(self, num_blocks: int, block_tokens: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, head_major: bool):
        self.num_blocks, self.block_tokens, self.num_layers = num_blocks, block_tokens, num_layers
        self.num_kv_heads, self.head_dim, self.head_major = num_kv_heads, head_dim, head_major
        self.dtype, self.device = dtype, device

    def _inner(self) -> tuple[int, int, int]:
        t, h, d = self.block_tokens, self.num_kv_heads, self.head_dim
        return (h, t, d) if self.head_major else (t, h, d)

    def _canonical(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(-3, -2) if self.head_major else x

    def read(self, blocks: torch.Tensor) -> torch.Tensor:
        """A copy of `blocks` (1-D long tensor), canonical shape [B, L, 2, T, H, D]."""
        raise NotImplementedError

    def read_rows(self, blocks: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """A copy of token row `rows[i]` of block `blocks[i]` (1-D long tensors), [N, L, 2, H, D].

        What the mirror copies each step: only the newly committed rows, not whole blocks."""
        data = self.read(blocks)
        return data[torch.arange(len(blocks), device=data.device), :, :, rows]

    def write(self, blocks: torch.Tensor, data: torch.Tensor) -> None:
        """Store canonical `data` [B, L, 2, T, H, D] into `blocks`."""
        raise NotImplementedError


class PerLayerBlocks(BlockLayout):
    """One tensor per layer, [num_blocks, 2, T, H, D] (NHD) or [num_blocks, 2, H, T, D] (HND):
    vLLM-style caches and TensorRT-LLM's `KVCacheManager.get_buffers(layer)`."""

    def __init__(self, caches: Sequence[torch.Tensor], num_kv_heads: int, head_dim: int,
                 block_tokens: int, head_major: bool = False):
        first = caches[0]
        super().__init__(first.shape[0], block_tokens, len(caches), num_kv_heads, head_dim,
                         first.dtype, first.device, head_major)
        want = (first.shape[0], 2, *self._inner())
        for layer, c in enumerate(caches):
            if tuple(c.shape) != want or c.dtype != first.dtype:
                raise ValueError(f"layer {layer} cache is {tuple(c.shape)} {c.dtype}, expected {want}")
        self.caches = list(caches)

    def read(self, blocks):
        return self._canonical(torch.stack([c[blocks] for c in self.caches], dim=1))

    def read_rows(self, blocks, rows):
        if self.head_major:                                    # [n, 2, H, T, D]
            return torch.stack([c[blocks, :, :, rows] for c in self.caches], dim=1)
        return torch.stack([c[blocks, :, rows] for c in self.caches], dim=1)

    def write(self, blocks, data):
        for layer, c in enumerate(self.caches):
            c[blocks] = self._canonical(data[:, layer]).to(c.dtype)


class PooledBlocks(BlockLayout):
    """One tensor for all layers, [num_blocks, num_layers, 2, T*H*D]: TensorRT-LLM's primary
    pool (`KVCacheManager.get_unique_primary_pool()`), NHD or HND inside a block."""

    def __init__(self, pool: torch.Tensor, num_kv_heads: int, head_dim: int, block_tokens: int,
                 head_major: bool = False):
        n, layers, two, size = pool.shape
        super().__init__(n, block_tokens, layers, num_kv_heads, head_dim, pool.dtype, pool.device,
                         head_major)
        if two != 2 or size != block_tokens * num_kv_heads * head_dim:
            raise ValueError(f"pool {tuple(pool.shape)} does not hold blocks of {block_tokens} tokens "
                             f"x {num_kv_heads} heads x {head_dim}")
        self.view = pool.view(n, layers, 2, *self._inner())

    def read(self, blocks):
        return self._canonical(self.view[blocks])

    def read_rows(self, blocks, rows):
        if self.head_major:                                    # [n, L, 2, H, T, D]
            return self.view[blocks, :, :, :, rows]
        return self.view[blocks, :, :, rows]

    def write(self, blocks, data):
        self.view[blocks] = self._canonical(data).to(self.view.dtype)


class RowCopy:
    """Copies row `rows[i]` of engine block `blocks[i]` into the same row of kvhold page
    `pages[i]`, for all i at once: one transfer of the indices, one gather from the engine's
    blocks, one scatter into kvhold's pool [pages, L, 2, T, H, D]. Nothing waits for the copy;
    `wait()` returns once the last one has landed in kvhold's pool.

    On CUDA the indices go through a pinned staging buffer (a non-blocking transfer, the buffer
    reused once the previous transfer has left it, as kvhold.executor.cuda.runner stages a step's
    inputs) and an event marks the end of the copy. On the CPU everything is synchronous and the
    indices are the caller's arrays, not copied."""

    def __init__(self, layout: BlockLayout, pool: torch.Tensor):
        if pool.device.type == "cuda" and pool.device != layout.device:
            raise ValueError(f"engine blocks on {layout.device} cannot be mirrored into a pool on {pool.device}")
        self.layout, self.pool = layout, pool
        self.cuda = layout.device.type == "cuda"
        self._host: torch.Tensor | None = None      # pinned int64 staging buffer (CUDA)
        self._staged = self._copied = None          # events: buffer free again, copy landed (CUDA)

    def __call__(self, indices: np.ndarray) -> None:
        """Queue the copy; `indices` is int64 [3, N]: blocks, pages, rows."""
        idx = self._indices(indices)
        data = self.layout.read_rows(idx[0], idx[2])                    # [N, L, 2, H, D]
        if self.pool.device != idx.device:                              # a host pool: synchronous
            idx, data = idx.to(self.pool.device), data.to(self.pool.device)
        self.pool[idx[1], :, :, idx[2]] = data
        if self.pool.device.type == "cuda":
            self._copied.record(torch.cuda.current_stream(self.pool.device))

    def wait(self) -> None:
        """Return once every queued copy is in kvhold's pool (the bytes a publish vouches for)."""
        if self._copied is not None:
            self._copied.synchronize()

    def _indices(self, indices: np.ndarray) -> torch.Tensor:
        """`indices` on the engine's device."""
        n = indices.shape[1]
        if not self.cuda:
            return torch.from_numpy(indices)
        if self._host is None or self._host.numel() < 3 * n:
            if self._staged is not None:
                self._staged.synchronize()           # the old buffer may still be read by a transfer
            else:
                self._staged, self._copied = torch.cuda.Event(), torch.cuda.Event()
            self._host = torch.empty(3 * max(64, 1 << (n - 1).bit_length()), dtype=torch.long,
                                     pin_memory=True)
        self._staged.synchronize()                   # the previous transfer has left the buffer
        host = self._host[:3 * n].view(3, n)
        host.numpy()[:] = indices
        idx = host.to(self.layout.device, non_blocking=True)
        self._staged.record(torch.cuda.current_stream(self.layout.device))
        return idx

    def warm_up(self) -> None:
        """Load the transfer, gather and scatter kernels, writing a scratch page only."""
        idx = self._indices(np.zeros((3, 1), dtype=np.int64))
        data = self.layout.read_rows(idx[0], idx[2]).to(self.pool.device)
        scratch = torch.empty_like(self.pool[:1])
        idx = idx.to(self.pool.device)
        scratch[idx[1], :, :, idx[2]] = data
        if self.cuda:
            torch.cuda.current_stream(self.layout.device).synchronize()
