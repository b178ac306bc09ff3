"""Run by tests/process/test_checksum_triton.py with TRITON_INTERPRET=1 (set before Triton is
imported: the kernels are interpreted on CPU tensors). Prints one JSON line: for each case, the
checksums of the Triton kernels, of TorchChecksum and of the numpy reference, as decimal strings."""
import json
import sys

import numpy as np
import torch

from kvhold.executor.cuda.checksum import BLOCK, TritonChecksum
from kvhold.protocol.checksum import TorchChecksum, page_checksum_np, page_words_np, to_u64, words_checksum_np


def u64(values) -> list[str]:
    return [str(int(v)) for v in values]


def random_pool(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.int64).to(torch.uint8).view(dtype).view(shape)


def case(shape, dtype, seed):
    pool = random_pool(shape, dtype, seed)
    pages, layers, _, tokens = shape[:4]
    rng = np.random.default_rng(seed)
    tri, ref_torch = TritonChecksum(pool), TorchChecksum(pool)
    words = page_words_np(pool.view(torch.uint8).numpy(), pages, layers, tokens)
    index = np.arange(words[0].size, dtype=np.uint64).reshape(words[0].shape)
    ids = torch.from_numpy(rng.permutation(pages)[: max(1, pages - 1)].astype(np.int64))
    counts = torch.from_numpy(rng.integers(0, tokens + 1, size=len(ids)))
    counts[0] = tokens                                       # a full page, then partial ones
    out = {"row_words": tri.row_words, "n_blocks": tri.n_blocks}
    out["pages"] = [u64(to_u64(tri.pages(ids, counts))), u64(to_u64(ref_torch.pages(ids, counts))),
                    u64(page_checksum_np(words[i], int(n)) for i, n in zip(ids, counts))]
    rp = torch.from_numpy(rng.integers(0, pages, size=9))
    starts = torch.from_numpy(rng.integers(0, tokens, size=9))
    ends = torch.minimum(torch.tensor(tokens), starts + torch.from_numpy(rng.integers(0, tokens, size=9)))
    out["ranges"] = [u64(to_u64(tri.ranges(rp, starts, ends))), u64(to_u64(ref_torch.ranges(rp, starts, ends))),
                     u64(words_checksum_np(words[p][:, :, s:e], index[:, :, s:e]) for p, s, e in zip(rp, starts, ends))]
    slots = torch.from_numpy(rng.integers(0, tokens, size=9))
    out["slots"] = [u64(to_u64(tri.slots(rp, slots))), u64(to_u64(tri.slots(rp.to(torch.int32), slots.to(torch.int32)))),
                    u64(to_u64(ref_torch.slots(rp, slots))),
                    u64(words_checksum_np(words[p][:, :, s], index[:, :, s]) for p, s in zip(rp, slots))]
    # bit flips: in a committed row (caught), in the row past the count (not covered)
    page, n = int(ids[0]), 2
    one, cnt = torch.tensor([page]), torch.tensor([n])
    base = int(to_u64(tri.pages(one, cnt))[0])
    raw = pool.view(torch.uint8).view(pages, -1)
    row_bytes = raw.shape[1] // (layers * 2 * tokens)
    flips = []
    for lkv, token, byte, bit in ((0, 0, 0, 0), (0, 1, row_bytes - 1, 7), (2 * layers - 1, 1, 3, 5),
                                  (1, 0, row_bytes // 2, 2), (0, 2, 0, 0), (2 * layers - 1, tokens - 1, 5, 7)):
        at = (lkv * tokens + token) * row_bytes + byte
        raw[page, at] ^= 1 << bit
        flips.append([token < n, int(to_u64(tri.pages(one, cnt))[0]) != base,
                      int(to_u64(tri.ranges(one, torch.tensor([0]), cnt))[0]) != base])
        raw[page, at] ^= 1 << bit
    out["flips"] = flips
    return out


CASES = [((5, 2, 2, 8, 2, 8), torch.bfloat16, 0),      # 4 words a row
         ((4, 3, 2, 16, 1, 4), torch.bfloat16, 1),     # one word a row
         ((3, 1, 2, 4, 2, 64), torch.float16, 2),
         ((4, 2, 2, 16, 3, 2), torch.float32, 3),
         ((3, 1, 2, 4, 16, 128), torch.float64, 4),    # 2,048 words a row: a slot spans two blocks
         ((2, 2, 2, 32, 8, 128), torch.bfloat16, 5)]   # several iterations of the pages loop
result = {"block": BLOCK, "cases": [case(*c) for c in CASES]}
try:
    TritonChecksum(torch.zeros(2, 1, 2, 4, 1, 2, dtype=torch.bfloat16))
except ValueError as exc:
    result["refused"] = str(exc)
print(json.dumps(result))
sys.stdout.flush()
