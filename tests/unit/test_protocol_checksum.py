"""The checksum: its definition (one mix per 64-bit word), torch equals the numpy reference,
increments equal full sums, flips in committed bytes are caught and bytes past them are not
covered, rows that are not whole 64-bit words are refused. The Triton kernels are pinned to the
same bits under Triton's interpreter (tests/process/test_checksum_triton.py)."""
import numpy as np
import pytest
import torch

from kvhold.protocol.checksum import (C1, C2, MAX_PAGE_WORDS, SEED, TorchChecksum, check_page_shape,
                                      page_checksum_np, page_words_np, to_u64, words_checksum_np)
from kvhold.protocol.layout import KvGeometry

M64 = (1 << 64) - 1


def _pool(dtype, pages=4, layers=3, tokens=8, heads=2, dim=8, seed=0):
    """Random bits, not random values: every byte pattern (NaNs included) is a KV byte."""
    g = torch.Generator().manual_seed(seed)
    shape = (pages, layers, 2, tokens, heads, dim)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.int64).to(torch.uint8)
    return raw.view(dtype).view(shape)


def _np_words(pool):
    return page_words_np(pool.view(torch.uint8).numpy(), pool.shape[0], pool.shape[1], pool.shape[3])


def _mix(x: int) -> int:
    """splitmix64's finaliser of x ^ SEED, on Python ints: the definition, written out."""
    x ^= SEED
    x ^= x >> 30
    x = (x * C1) & M64
    x ^= x >> 27
    x = (x * C2) & M64
    return x ^ (x >> 31)


def _definition(page_bytes: bytes, layers: int, tokens: int, n: int) -> int:
    """sum_j mix(d_j ^ (j << 40)) over the committed 64-bit words of one page, from its bytes."""
    words = [int.from_bytes(page_bytes[8 * j:8 * j + 8], "little") for j in range(len(page_bytes) // 8)]
    row_words = len(words) // (layers * 2 * tokens)
    total = 0
    for block in range(layers * 2):
        for j in range(block * tokens * row_words, (block * tokens + n) * row_words):
            total += _mix(words[j] ^ (j << 40))
    return total & M64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_reference_and_torch_follow_the_definition(dtype):
    pool = _pool(dtype, pages=3, layers=2, tokens=4, heads=2, dim=4, seed=1)
    cs = TorchChecksum(pool)
    counts = [4, 3, 0]
    want = [_definition(pool[p].contiguous().view(torch.uint8).numpy().tobytes(), 2, 4, n)
            for p, n in enumerate(counts)]
    words = _np_words(pool)
    assert [page_checksum_np(words[p], n) for p, n in enumerate(counts)] == want
    assert list(to_u64(cs.pages(torch.arange(3), torch.tensor(counts)))) == want
    assert want[2] == 0  # an empty page sums to zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_torch_matches_numpy_reference(dtype):
    pool = _pool(dtype)
    cs = TorchChecksum(pool)
    ids = torch.tensor([0, 1, 2, 3])
    counts = torch.tensor([8, 5, 1, 0])
    got = to_u64(cs.pages(ids, counts))
    words = _np_words(pool)
    want = [page_checksum_np(words[i], int(n)) for i, n in zip(ids, counts)]
    assert list(got) == want
    assert want[3] == 0


def test_torch_ranges_and_slots_match_numpy_reference_on_random_pages():
    rng = np.random.default_rng(5)
    pool = _pool(torch.bfloat16, pages=6, layers=3, tokens=16, heads=2, dim=8, seed=2)
    cs = TorchChecksum(pool)
    words = _np_words(pool)
    index = np.arange(words[0].size, dtype=np.uint64).reshape(words[0].shape)
    pages = rng.integers(0, 6, size=12)
    starts = rng.integers(0, 16, size=12)
    ends = np.minimum(16, starts + rng.integers(0, 6, size=12))       # empty ranges included
    got = to_u64(cs.ranges(torch.from_numpy(pages), torch.from_numpy(starts), torch.from_numpy(ends)))
    want = [words_checksum_np(words[p][:, :, s:e], index[:, :, s:e]) for p, s, e in zip(pages, starts, ends)]
    assert list(got) == want
    slots = rng.integers(0, 16, size=12)
    got = to_u64(cs.slots(torch.from_numpy(pages), torch.from_numpy(slots)))
    assert list(got) == [words_checksum_np(words[p][:, :, s], index[:, :, s]) for p, s in zip(pages, slots)]


def test_incremental_slots_equal_full_page():
    pool = _pool(torch.float32)
    cs = TorchChecksum(pool)
    total = torch.zeros((), dtype=torch.int64)
    for slot in range(6):
        total = total + cs.slots(torch.tensor([2]), torch.tensor([slot]))[0]
    assert to_u64(total.view(1))[0] == to_u64(cs.pages(torch.tensor([2]), torch.tensor([6])))[0]
    parts = cs.ranges(torch.tensor([2, 2]), torch.tensor([0, 4]), torch.tensor([4, 6]))
    assert to_u64(parts.sum().view(1))[0] == to_u64(total.view(1))[0]


def test_every_bit_of_the_committed_bytes_is_covered_and_none_past_them():
    """One bf16 page, 2 layers x K/V x 4 tokens x one 64-bit row, 3 tokens committed: each
    of the 1,536 committed bits flips the checksum (torch and the reference), each of the 512
    bits of the uncommitted row leaves it as it was."""
    pool = _pool(torch.bfloat16, pages=1, layers=2, tokens=4, heads=1, dim=4, seed=3)
    cs = TorchChecksum(pool)
    ids, counts = torch.tensor([0]), torch.tensor([3])
    base = to_u64(cs.pages(ids, counts))[0]
    raw = pool.view(torch.uint8).view(-1)           # the pool's own bytes
    page_bytes, row_bytes = raw.numel(), 8
    for byte in range(page_bytes):
        committed = (byte // row_bytes) % 4 < 3
        for bit in range(8):
            raw[byte] ^= 1 << bit
            got = to_u64(cs.pages(ids, counts))[0]
            ref = page_checksum_np(_np_words(pool)[0], 3)
            raw[byte] ^= 1 << bit
            assert (got != base) == committed and got == ref, (byte, bit)
    assert to_u64(cs.pages(ids, counts))[0] == base


def test_swapped_rows_and_uncommitted_bytes():
    pool = _pool(torch.float32)
    cs = TorchChecksum(pool)
    ids, counts = torch.tensor([1]), torch.tensor([4])
    base = to_u64(cs.pages(ids, counts))[0]
    pool[1, :, :, 7] = 123.0          # beyond the committed count: not covered
    pool[1, :, :, 4:] = 0.0
    assert to_u64(cs.pages(ids, counts))[0] == base
    a, b = pool[1, 0, 0, 0].clone(), pool[1, 0, 0, 1].clone()
    pool[1, 0, 0, 0], pool[1, 0, 0, 1] = b, a   # same bytes, wrong places
    assert to_u64(cs.pages(ids, counts))[0] != base
    pool[1, 0, 0, 0], pool[1, 0, 0, 1] = a, b
    pool[1, 1, 1], pool[1, 1, 0] = pool[1, 1, 0].clone(), pool[1, 1, 1].clone()   # keys and values
    assert to_u64(cs.pages(ids, counts))[0] != base


def test_chunked_validation_equals_unchunked():
    pool = _pool(torch.float32, pages=9)
    small = TorchChecksum(pool, max_chunk_bytes=1)
    big = TorchChecksum(pool)
    ids = torch.arange(9)
    counts = torch.arange(9) % 9
    assert list(to_u64(small.pages(ids, counts))) == list(to_u64(big.pages(ids, counts)))


def test_validation_does_not_write_the_pool():
    pool = _pool(torch.float64, pages=3)
    before = pool.clone()
    cs = TorchChecksum(pool)
    cs.pages(torch.arange(3), torch.tensor([8, 3, 0]))
    cs.ranges(torch.tensor([0, 2]), torch.tensor([1, 0]), torch.tensor([5, 8]))
    cs.slots(torch.tensor([1]), torch.tensor([2]))
    assert torch.equal(pool.view(torch.uint8), before.view(torch.uint8))


def test_rows_must_be_whole_64_bit_words():
    for dtype, heads, dim in ((torch.bfloat16, 1, 2), (torch.float32, 1, 1), (torch.float16, 3, 2),
                              (torch.float32, 3, 1)):
        with pytest.raises(ValueError, match="whole number of 64-bit words"):
            TorchChecksum(torch.zeros(2, 1, 2, 4, heads, dim, dtype=dtype))
    TorchChecksum(torch.zeros(2, 1, 2, 4, 1, 4, dtype=torch.bfloat16))        # 8 bytes: one word
    TorchChecksum(torch.zeros(2, 1, 2, 4, 2, 1, dtype=torch.float32))
    with pytest.raises(ValueError, match="64-bit words"):
        KvGeometry(2, 1, 2, "bfloat16")                                       # 4-byte rows
    with pytest.raises(ValueError, match="64-bit words"):
        KvGeometry(2, 3, 1, "float32")
    assert KvGeometry(2, 1, 4, "bfloat16").row_bytes == 8


def test_page_index_bound():
    """Each word's index is XORed in at bit 40: a page holds at most 2**24 words (128 MiB)."""
    assert MAX_PAGE_WORDS == 1 << 24
    check_page_shape(8, MAX_PAGE_WORDS * 8)
    with pytest.raises(ValueError, match="exceeds"):
        check_page_shape(8, MAX_PAGE_WORDS * 8 + 8)
    with pytest.raises(ValueError, match="exceeds"):
        KvGeometry(64, 64, 128, "float32", 128)                             # 512 MiB pages
    KvGeometry(32, 8, 128, "bfloat16", 16)                                    # Llama-3-8B: 2 MiB


def test_the_reference_reads_64_bit_words_only():
    with pytest.raises(TypeError):
        words_checksum_np(np.zeros(4, dtype=np.uint32), np.arange(4))


def test_exchanging_two_different_words_is_caught_and_the_named_blind_spot_is_real():
    """Every exchange of two different committed 64-bit words of a page changes the checksum;
    the structured case the module docstring names (each takes the other's value XORed with
    (j XOR k) << 40) does not, as documented."""
    pool = _pool(torch.float32, pages=1, layers=1, tokens=2, heads=2, dim=4, seed=4)   # 16 words
    cs = TorchChecksum(pool)
    ids, counts = torch.tensor([0]), torch.tensor([2])
    base = to_u64(cs.pages(ids, counts))[0]
    flat = pool.view(torch.int64).view(-1)
    for j in range(flat.numel()):
        for k in range(j + 1, flat.numel()):
            a, b = flat[j].item(), flat[k].item()
            flat[j], flat[k] = b, a
            assert a == b or to_u64(cs.pages(ids, counts))[0] != base, (j, k)
            flat[j], flat[k] = a, b
    j, k = 3, 9
    a, b = flat[j].item(), flat[k].item()
    flat[j], flat[k] = b ^ ((j ^ k) << 40), a ^ ((j ^ k) << 40)
    assert to_u64(cs.pages(ids, counts))[0] == base
