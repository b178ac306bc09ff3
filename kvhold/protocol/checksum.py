"""The one KV-page checksum definition, in numpy (reference) and torch (CPU and CUDA).

Definition. View a page's bytes as little-endian uint64 words d_j, where j is the
word's index (in 64-bit words) inside its page. The checksum of a set of words is

    sum_j  mix(d_j XOR (j << 40))   mod 2**64
    mix(x) = splitmix64 finaliser of (x XOR SEED)

One mix per 64-bit word: on an H200 a whole-page pass of this definition ran as fast as
reading the pages (2.70 against 2.67 ms for 5,700 Llama-3-8B pages), where one mix per
32-bit word was bound by the 64-bit multiplies (3.96 ms) (tools/probe_checksum.py,
bench/results/checksum_cuda.json).

What it catches. For a fixed index j, d -> mix(d XOR (j << 40)) is a bijection of 64-bit
values (an XOR with a constant, then splitmix64's finaliser, itself a bijection), so
changing any single word, any bit of it, always changes the sum. The index term binds
each word to its place: a page holds at most 2**24 words (MAX_PAGE_WORDS, 128 MiB;
checked wherever a page shape is accepted, by `check_page_shape`: KvGeometry,
TorchChecksum, TritonChecksum), so every j < 2**24 and j << 40 neither overflows nor
repeats: each index XORs its own key into the top 24 bits, and exchanging two different
words, or writing a row to another slot, changes the mix inputs. Changes to several words
cancel only if the differences of their mixed values sum to zero, about 2**-64 for
independent contents. Unlike a 32-bit word beside its index, d XOR (j << 40) is not
injective in (d, j): the one structured blind spot is two words at j and k that each take
the other's old value XORed with (j XOR k) << 40, which feeds mix the same two inputs.
Because the sum is modular and order-free, every device and every reduction order gives
the same bits, and the checksum of a page grows by adding the hash of each newly committed
token slot: commits hash only the new bytes, validation re-hashes whole pages.

Committed bytes of a page holding n tokens, for the layout
[layer][k/v][token][kv_head][head_dim], are the first n token rows of every
(layer, k/v) block; a row (kv_heads x head_dim x element size) must therefore be a
whole number of 64-bit words. torch's int64 arithmetic wraps on overflow on CPU and
CUDA alike (two's complement); the tests pin torch against the numpy reference.
"""
from __future__ import annotations

import numpy as np

SEED = 0x9E3779B97F4A7C15
C1 = 0xBF58476D1CE4E5B9
C2 = 0x94D049BB133111EB
WORD_BYTES = 8                  # the checksum's unit: one little-endian uint64
INDEX_SHIFT = 40                # a word's in-page index is XORed in at bit 40
MAX_PAGE_WORDS = 1 << (64 - INDEX_SHIFT)
_M64 = (1 << 64) - 1


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= (1 << 63) else c


def check_page_shape(row_bytes: int, page_bytes: int) -> None:
    """Refuse a page the definition does not cover: rows must be whole 64-bit words and a
    page fewer than MAX_PAGE_WORDS words (ValueError)."""
    if row_bytes % WORD_BYTES:
        raise ValueError(f"a KV row must be a whole number of 64-bit words (the checksum's unit); "
                         f"kv_heads x head_dim x element size = {row_bytes} bytes")
    if page_bytes // WORD_BYTES > MAX_PAGE_WORDS:
        raise ValueError(f"a KV page of {page_bytes} bytes exceeds the checksum's "
                         f"{MAX_PAGE_WORDS * WORD_BYTES} (2**24 64-bit words, each indexed in the top 24 bits)")


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
    """Checksum of uint64 `words` whose in-page word indices (in 64-bit words) are `index`
    (same shape)."""
    if words.dtype != np.uint64:
        raise TypeError(f"the checksum reads uint64 words, not {words.dtype}")
    x = words ^ (index.astype(np.uint64) << np.uint64(INDEX_SHIFT))
    with np.errstate(over="ignore"):
        return int(mix_np(x).sum(dtype=np.uint64))


def page_checksum_np(page: np.ndarray, num_tokens: int) -> int:
    """Checksum of the first `num_tokens` token rows of one page.

    `page` is a uint64 view of a page shaped [layers, 2, page_tokens, words_per_row].
    """
    index = np.arange(page.size, dtype=np.uint64).reshape(page.shape)
    return words_checksum_np(page[:, :, :num_tokens], index[:, :, :num_tokens])


def page_words_np(pool: np.ndarray, num_pages: int, num_layers: int, page_tokens: int) -> np.ndarray:
    """The uint64 view [pages, layers, 2, page_tokens, words_per_row] of a pool's bytes (any dtype,
    C-contiguous), what the numpy reference reads."""
    raw = np.ascontiguousarray(pool).reshape(-1).view(np.uint8)
    return raw.view(np.uint64).reshape(num_pages, num_layers, 2, page_tokens, -1)


# ------------------------------------------------------------------------ torch
class TorchChecksum:
    """Checksums over a KV pool tensor shaped [pages, layers, 2, page_tokens, ...].

    Works on any device; results are int64 tensors holding the uint64 bits.
    `max_chunk_bytes` bounds the temporaries of whole-page validation.
    """

    def __init__(self, pool, max_chunk_bytes: int = 256 << 20):
        import torch

        self.torch = torch
        row_bytes = pool.element_size() * int(np.prod(pool.shape[4:], dtype=np.int64))
        check_page_shape(row_bytes, row_bytes * int(np.prod(pool.shape[1:4], dtype=np.int64)))
        flat = pool.reshape(*pool.shape[:4], -1)
        self.words = flat.view(torch.int64)                  # [P, L, 2, T, W]
        _, layers, two, tokens, row_words = self.words.shape
        self.page_shape = (layers, two, tokens, row_words)
        self.page_words = layers * two * tokens * row_words
        # the constant each word is XORed with before the finaliser's multiplies: j << 40 ^ SEED
        keys = (np.arange(self.page_words, dtype=np.uint64) << np.uint64(INDEX_SHIFT)) ^ np.uint64(SEED)
        self.index_key = torch.from_numpy(keys.view(np.int64)).to(pool.device).reshape(self.page_shape)
        self.token_pos = torch.arange(tokens, device=pool.device).view(1, 1, 1, tokens, 1)
        self.chunk_pages = max(1, max_chunk_bytes // (self.page_words * 8 * 3))

    def _hash_words(self, words, index_key):
        """mix(word XOR index << 40) for every word, in place on `words`: a fresh int64
        tensor (a gather), never a view of the pool."""
        t = self.torch
        x = words
        x.bitwise_xor_(index_key)
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
            h = self._hash_words(self.words[ids], self.index_key)          # advanced index: a copy
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
        words = self.words[page_ids, :, :, slots]                   # [B, L, 2, W], a copy
        index = self.index_key[:, :, slots].permute(2, 0, 1, 3)     # [B, L, 2, W]
        return self._hash_words(words, index).flatten(1).sum(dim=1)


def to_u64(values) -> np.ndarray:
    """int64 tensor/array of checksum bits -> numpy uint64."""
    arr = values.cpu().numpy() if hasattr(values, "cpu") else np.asarray(values)
    return arr.astype(np.int64, copy=False).view(np.uint64)
