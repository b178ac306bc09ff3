"""The one KV-page checksum definition, in numpy (reference) and torch (CPU and CUDA).

Definition. View a page's bytes as little-endian uint32 words w_i, where i is the
word's index inside its page. The checksum of a set of words is

    sum_i  mix(w_i | (i << 32))   mod 2**64
    mix(x) = splitmix64 finaliser of (x XOR SEED)

mix is a bijection of 64-bit values, so changing any single word (any bit flip)
always changes the sum; independent corruptions cancel with probability 2**-64.
The index term binds each word to its place, so a torn write that leaves stale
or zero words, or rows written to the wrong slot, is caught too. Because the sum
is modular and order-free, every device and every reduction order gives the same
bits, and the checksum of a page grows by adding the hash of each newly committed
token slot: commits hash only the new bytes, validation re-hashes whole pages.

Committed bytes of a page holding n tokens, for the layout
[layer][k/v][token][kv_head][head_dim], are the first n token rows of every
(layer, k/v) block. torch's int64 arithmetic wraps on overflow on CPU and CUDA
alike (two's complement); the tests pin torch against the numpy reference.
"""
from __future__ import annotations

import numpy as np

SEED = 0x9E3779B97F4A7C15
C1 = 0xBF58476D1CE4E5B9
C2 = 0x94D049BB133111EB
_M64 = (1 << 64) - 1


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= (1 << 63) else c


# ---------------------------------------------------------------- numpy reference
def mix_np(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64, copy=True)
    x ^= np.uint64(SEED)
    x ^= x >> np.uint64(30)
    x *= np.uint64(C1)
    x ^= x >> np.uint64(27)
    x *= np.uint64(C2)
    x ^= x >> np.uint64(31)
    return x


def words_checksum_np(words: np.ndarray, index: np.ndarray) -> int:
    """Checksum of uint32 `words` whose in-page word indices are `index` (same shape)."""
    x = words.astype(np.uint64) | (index.astype(np.uint64) << np.uint64(32))
    with np.errstate(over="ignore"):
        return int(mix_np(x).sum(dtype=np.uint64))


def page_checksum_np(page: np.ndarray, num_tokens: int) -> int:
    """Checksum of the first `num_tokens` token rows of one page.

    `page` is a uint32 view of a page shaped [layers, 2, page_tokens, words_per_row].
    """
    layers, two, page_tokens, row_words = page.shape
    index = np.arange(page.size, dtype=np.uint64).reshape(page.shape)
    return words_checksum_np(page[:, :, :num_tokens], index[:, :, :num_tokens])


# ------------------------------------------------------------------------ torch
class TorchChecksum:
    """Checksums over a KV pool tensor shaped [pages, layers, 2, page_tokens, ...].

    Works on any device; results are int64 tensors holding the uint64 bits.
    `max_chunk_bytes` bounds the temporaries of whole-page validation.
    """

    def __init__(self, pool, max_chunk_bytes: int = 256 << 20):
        import torch

        self.torch = torch
        if pool.element_size() * pool.shape[-1] % 4:
            raise ValueError("a KV row must be a whole number of 32-bit words")
        flat = pool.reshape(*pool.shape[:4], -1)
        self.words = flat.view(torch.int32)                  # [P, L, 2, T, W]
        _, layers, two, tokens, row_words = self.words.shape
        self.page_shape = (layers, two, tokens, row_words)
        self.page_words = layers * two * tokens * row_words
        self.index_hi = (torch.arange(self.page_words, dtype=torch.int64, device=pool.device)
                         .reshape(self.page_shape) << 32)
        self.token_pos = torch.arange(tokens, device=pool.device).view(1, 1, 1, tokens, 1)
        self.chunk_pages = max(1, max_chunk_bytes // (self.page_words * 8 * 3))

    def _hash_words(self, words, index_hi):
        """mix(word | index << 32) for every word, in place on one int64 buffer."""
        t = self.torch
        x = words.to(t.int64)
        x.bitwise_and_(0xFFFFFFFF).bitwise_or_(index_hi).bitwise_xor_(_signed(SEED))
        tmp = t.empty_like(x)
        for shift, mult in ((30, C1), (27, C2), (31, None)):
            t.bitwise_right_shift(x, shift, out=tmp)
            x.bitwise_xor_(tmp.bitwise_and_((1 << (64 - shift)) - 1))   # logical shift
            if mult is not None:
                x.mul_(_signed(mult))
        return x

    def pages(self, page_ids, num_tokens):
        """Checksums of whole committed ranges: page_ids, num_tokens are 1-D int64 tensors."""
        t = self.torch
        out = t.empty(len(page_ids), dtype=t.int64, device=self.words.device)
        for start in range(0, len(page_ids), self.chunk_pages):
            ids = page_ids[start:start + self.chunk_pages]
            counts = num_tokens[start:start + self.chunk_pages].view(-1, 1, 1, 1, 1)
            h = self._hash_words(self.words[ids], self.index_hi)
            h.masked_fill_(self.token_pos >= counts, 0)
            out[start:start + len(ids)] = h.flatten(1).sum(dim=1)
        return out

    def ranges(self, page_ids, starts, ends):
        """Hash of the token rows [starts[i], ends[i]) of pages page_ids[i]."""
        t = self.torch
        lens = (ends - starts).to(t.int64)
        owner = t.arange(len(page_ids), device=lens.device).repeat_interleave(lens)
        slot = starts.to(t.int64).repeat_interleave(lens)
        slot = slot + t.arange(len(slot), device=lens.device) - (t.cumsum(lens, 0) - lens).repeat_interleave(lens)
        hashes = self.slots(page_ids.to(t.int64).repeat_interleave(lens), slot)
        out = t.zeros(len(page_ids), dtype=t.int64, device=lens.device)
        return out.index_add_(0, owner, hashes)

    def slots(self, page_ids, slots):
        """Hash of single token slots (page_ids[i], slots[i]); adding them to a page's
        checksum extends its committed range by those slots."""
        words = self.words[page_ids, :, :, slots]                   # [B, L, 2, W]
        index = self.index_hi[:, :, slots].permute(2, 0, 1, 3)      # [B, L, 2, W]
        return self._hash_words(words, index).flatten(1).sum(dim=1)


def to_u64(values) -> np.ndarray:
    """int64 tensor/array of checksum bits -> numpy uint64."""
    arr = values.cpu().numpy() if hasattr(values, "cpu") else np.asarray(values)
    return arr.astype(np.int64, copy=False).view(np.uint64)
