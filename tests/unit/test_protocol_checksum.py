"""The checksum: torch equals the numpy reference, increments equal full sums, flips are caught."""
import numpy as np
import pytest
import torch

from kvhold.protocol.checksum import TorchChecksum, page_checksum_np, to_u64


def _pool(dtype, pages=4, layers=3, tokens=8, heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(pages, layers, 2, tokens, heads, dim, generator=g).to(dtype)


def _np_words(pool):
    raw = pool.contiguous().view(torch.uint8).numpy()
    return raw.reshape(pool.shape[0], pool.shape[1], 2, pool.shape[3], -1).view(np.uint32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_matches_numpy_reference(dtype):
    pool = _pool(dtype)
    cs = TorchChecksum(pool)
    ids = torch.tensor([0, 1, 2, 3])
    counts = torch.tensor([8, 5, 1, 0])
    got = to_u64(cs.pages(ids, counts))
    words = _np_words(pool)
    want = [page_checksum_np(words[i], int(n)) for i, n in zip(ids, counts)]
    assert list(got) == want
    assert want[3] == 0  # an empty page sums to zero


def test_incremental_slots_equal_full_page():
    pool = _pool(torch.float32)
    cs = TorchChecksum(pool)
    total = torch.zeros((), dtype=torch.int64)
    for slot in range(6):
        total = total + cs.slots(torch.tensor([2]), torch.tensor([slot]))[0]
    assert to_u64(total.view(1))[0] == to_u64(cs.pages(torch.tensor([2]), torch.tensor([6])))[0]


def test_every_single_bit_flip_is_detected():
    pool = _pool(torch.float32, pages=1, layers=1, tokens=2, heads=1, dim=4)
    cs = TorchChecksum(pool)
    ids, counts = torch.tensor([0]), torch.tensor([2])
    base = to_u64(cs.pages(ids, counts))[0]
    flat = pool.view(torch.int32).view(-1)
    for word in range(flat.numel()):
        for bit in range(32):
            flat[word] ^= (1 << bit) if bit < 31 else -(1 << 31)
            assert to_u64(cs.pages(ids, counts))[0] != base, (word, bit)
            flat[word] ^= (1 << bit) if bit < 31 else -(1 << 31)
    assert to_u64(cs.pages(ids, counts))[0] == base


def test_swapped_rows_and_uncommitted_bytes():
    pool = _pool(torch.float32)
    cs = TorchChecksum(pool)
    ids, counts = torch.tensor([1]), torch.tensor([4])
    base = to_u64(cs.pages(ids, counts))[0]
    pool[1, :, :, 7] = 123.0          # beyond the committed count: not covered
    assert to_u64(cs.pages(ids, counts))[0] == base
    a, b = pool[1, 0, 0, 0].clone(), pool[1, 0, 0, 1].clone()
    pool[1, 0, 0, 0], pool[1, 0, 0, 1] = b, a   # same bytes, wrong places
    assert to_u64(cs.pages(ids, counts))[0] != base


def test_chunked_validation_equals_unchunked():
    pool = _pool(torch.float32, pages=9)
    small = TorchChecksum(pool, max_chunk_bytes=1)
    big = TorchChecksum(pool)
    ids = torch.arange(9)
    counts = torch.arange(9) % 9
    assert list(to_u64(small.pages(ids, counts))) == list(to_u64(big.pages(ids, counts)))
