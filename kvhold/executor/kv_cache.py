"""KvCache: the paged KV pool in the sidecar's kv region, as one torch tensor.

Layout [page][layer][k/v][token][kv_head][head_dim], exactly the geometry in the
tables header, so the checksum (kvhold.protocol.checksum) and every executor agree on where
each byte lives. Writes scatter new keys/values into (page, slot) positions;
reads gather a sequence's pages back into contiguous [tokens, kv_heads, head_dim]
tensors. Attention always reads keys and values back from the pool, also for the
tokens of the current step, so a token's attention inputs are the same bytes
whether it was computed in a prefill chunk or in a decode step.
"""
from __future__ import annotations

import torch

from kvhold.protocol.layout import KvGeometry

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float64": torch.float64}


class KvCache:
    def __init__(self, pool: torch.Tensor, geometry: KvGeometry):
        expected = (pool.shape[0], *geometry.page_shape)
        if tuple(pool.shape) != expected:
            raise ValueError(f"KV pool shape {tuple(pool.shape)} does not match geometry {expected}")
        self.pool = pool
        self.geometry = geometry
        self.page_tokens = geometry.page_tokens

    @classmethod
    def from_mapping(cls, mapping, geometry: KvGeometry, num_pages: int) -> "KvCache":
        dtype = TORCH_DTYPES[geometry.dtype]
        return cls(mapping.tensor(dtype, (num_pages, *geometry.page_shape)), geometry)

    @classmethod
    def private(cls, geometry: KvGeometry, num_pages: int, device="cpu") -> "KvCache":
        """A small pool in this process's own memory (warm-up, tests)."""
        dtype = TORCH_DTYPES[geometry.dtype]
        return cls(torch.zeros((num_pages, *geometry.page_shape), dtype=dtype, device=device), geometry)

    @property
    def num_pages(self) -> int:
        return self.pool.shape[0]

    def write(self, layer: int, pages: torch.Tensor, slots: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, kv_heads, head_dim] at (pages[t], slots[t])."""
        self.pool[pages, layer, 0, slots] = k.to(self.pool.dtype)
        self.pool[pages, layer, 1, slots] = v.to(self.pool.dtype)

    def gather(self, layer: int, pages: torch.Tensor, num_tokens: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first num_tokens positions of a sequence's pages."""
        h, d = self.pool.shape[-2:]
        k = self.pool[pages, layer, 0].view(-1, h, d)[:num_tokens]   # [n_pages * T, H, D], one copy
        v = self.pool[pages, layer, 1].view(-1, h, d)[:num_tokens]
        return k.to(dtype), v.to(dtype)

    def copy_tokens(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the first num_tokens slots of page src into page dst (all layers, k and v)."""
        self.pool[dst, :, :, :num_tokens] = self.pool[src, :, :, :num_tokens]
