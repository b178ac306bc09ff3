"""Exact prefill on the GPU (skipped on CPU): a token position's KV and logits are the same
bits whether a single prefill, chunked prefill (any chunk sizes, any batch mix) or a
decode step computed it (kvhold.executor.cuda.runner, exact prefill)."""
import random

import pytest
import torch

from tests.gpu.helpers import plan

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PAGE = 16
LENGTH = 150                 # tokens of the sequence under test
TARGET_PAGES = list(range(1, 1 + -(-LENGTH // PAGE)))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


# ------------------------------------------------------------------ the GEMM
@pytest.mark.parametrize("n,k,residual", [(6144, 4096, False), (4096, 14336, True), (28672, 4096, False),
                                          (4096, 4096, True)])
def test_a_gemm_row_is_the_same_bits_at_any_row_count_and_prefill_tile(n, k, residual):
    from kvhold.executor.cuda import gemm as cuda_gemm

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    m = 600
    x = torch.randn((m, k), generator=gen, device="cuda", dtype=torch.bfloat16)
    w = torch.randn((n, k), generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
    h = torch.randn((m, n), generator=gen, device="cuda", dtype=torch.bfloat16)

    def decode(rows):                 # what a decode step gives these rows (64 at a time)
        out = []
        for i in range(0, rows.stop - rows.start, 64):
            r = slice(rows.start + i, min(rows.stop, rows.start + i + 64))
            res = h[r].clone() if residual else None
            out.append(cuda_gemm.skinny(x[r], w, residual=res, out=res))
        return torch.cat(out)

    want = decode(slice(0, m))
    for rows in (600, 129, 128, 65, 64, 17, 1):
        res = h[:rows].clone() if residual else None
        got = cuda_gemm.exact_linear(x[:rows], w, residual=res, out=res)
        assert _same(got, want[:rows]), rows
    for bm, bn, bk, warps, stages in ((64, 64, 128, 4, 3), (128, 64, 64, 4, 2), (128, 128, 32, 8, 2),
                                      (64, 128, 256, 8, 2), (256, 128, 64, 8, 3), (16, 32, 256, 4, 4)):
        res = h.clone() if residual else None
        got = cuda_gemm.skinny(x, w, residual=res, out=res, block_n=bn, block_k=bk, num_warps=warps,
                               num_stages=stages, rows_per_program=bm, group_m=4)
        assert _same(got, want), (bm, bn, warps, stages)


# ------------------------------------------------------------------ attention
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 128), (28, 4, 128), (4, 2, 32)])
def test_prefill_attention_rows_are_the_decode_kernels_bits_packed_or_not_at_any_tiles(heads, kv_heads, dim):
    from kvhold.executor.cuda.attention import rope_decode_attention, rope_prefill_attention

    gen = torch.Generator(device="cuda").manual_seed(heads)
    length, layers, pages = 1000, 2, list(range(80, 17, -1))        # scattered pages, descending
    pool = torch.zeros((90, layers, 2, PAGE, kv_heads, dim), device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(length, device="cuda", dtype=torch.float64)
    inv = 1 / 500000 ** (torch.arange(0, dim, 2, device="cuda", dtype=torch.float64) / dim)
    emb = torch.cat([torch.outer(pos, inv)] * 2, dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    qkv = torch.randn((length, (heads + 2 * kv_heads) * dim), generator=gen, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(length, device="cuda")
    page_of = torch.tensor([pages[p // PAGE] for p in range(length)], device="cuda")
    slot_of = positions % PAGE
    table = torch.tensor(pages, device="cuda", dtype=torch.int32)[None, :]
    scale = dim ** -0.5
    # decode: one position per step, 16 rows (the others padding)
    want = torch.empty((length, heads, dim), device="cuda", dtype=torch.bfloat16)
    for p in range(length):
        r = slice(p, p + 1)
        ctx = torch.tensor([p + 1], device="cuda", dtype=torch.int32)
        want[p] = rope_decode_attention(qkv[r], cos, sin, positions[r], page_of[r], slot_of[r], pool, 1,
                                        table, ctx, scale, heads, kv_heads)[0]
    want_kv = pool.clone()
    for packed, tiles in ((False, 1), (True, 1), (True, 2), (True, 4)):
        pool.zero_()
        got = []
        for a, b in ((0, 300), (300, 301), (301, 777), (777, length)):
            n = b - a
            ctx = (positions[a:b] + 1).to(torch.int32)
            got.append(rope_prefill_attention(qkv[a:b], cos, sin, positions[a:b], page_of[a:b], slot_of[a:b], pool, 1,
                                              table.expand(n, -1), ctx, torch.zeros_like(ctx), scale, heads, kv_heads,
                                              packed=packed, tiles=tiles))
        assert _same(pool, want_kv), (packed, tiles)
        got = torch.cat(got)
        bad = (_bits(got) != _bits(want)).reshape(length, -1).any(dim=1).nonzero().flatten().tolist()
        assert not bad, (packed, tiles, bad[:10], len(bad))


# ------------------------------------------------------------------ the whole model
def _bf16_region(weights):
    buf = torch.empty(sum(t.numel() for t in weights.values()), dtype=torch.bfloat16, device="cuda")
    out, offset = {}, 0
    for name, t in weights.items():
        out[name] = buf[offset:offset + t.numel()].view(t.shape)
        out[name].copy_(t)
        offset += t.numel()
    return out


@pytest.fixture(scope="module")
def runner(tiny_model):
    from kvhold.executor.cuda.runner import CudaRunner
    from kvhold.executor.kv_cache import KvCache
    from kvhold.executor.llama import LlamaModel
    from kvhold.protocol.layout import KvGeometry
    from kvhold.protocol.model_spec import ModelSpec
    from tools.bench_engine_setup import load_weights

    spec = ModelSpec.from_dir(tiny_model)
    model = LlamaModel(spec, _bf16_region(load_weights(tiny_model, "cuda")), torch.bfloat16,
                       torch.device("cuda"), 512)
    kv = KvCache.private(KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "bfloat16", PAGE), 400,
                         "cuda")
    r = CudaRunner(model, kv, max_batch=64, prefill_chunk=256, max_pages_per_seq=32, exact=True)
    assert r.exact, r.exact_refusal
    r.prepare()
    return r


def _tokens(runner, seed=0, length=LENGTH):
    rng = random.Random(seed)
    return [rng.randrange(3, runner.model.spec.vocab_size) for _ in range(length)]


def _kv(runner, pages, length):
    """[length, layers, 2, kv_heads, head_dim] of the sequence's positions, from the pool."""
    pool = runner.kv.pool
    return torch.stack([pool[pages[p // PAGE], :, :, p % PAGE] for p in range(length)]).clone()


def _clear(runner, pages):
    runner.kv.pool[pages] = 0


def _by_decode(runner, tokens, pages, first=1):
    """Prefill `first` tokens, then one decode step per token: ({position: logits}, KV). With
    the default every position has its logits here, so a chunking may end a chunk anywhere
    (a first chunk of one token included)."""
    _clear(runner, pages)
    logits = {first - 1: runner.run(plan([(tokens[:first], 0, first, pages)]))[0].clone()}
    for p in range(first, len(tokens)):
        logits[p] = runner.run(plan([(tokens[:p + 1], p, 1, pages)]))[0].clone()
    return logits, _kv(runner, pages, len(tokens))


@pytest.fixture(scope="module", params=[False, True], ids=["attention_per_row", "attention_packed"])
def reference(request, runner):
    """The sequence by decode steps, with the prefill attention one row per program or packed
    (kvhold.executor.cuda.attention.rope_prefill_attention) for the tests that use it."""
    from kvhold.executor.cuda import attention as cuda_attention

    saved = cuda_attention.PREFILL_PACKED
    cuda_attention.PREFILL_PACKED = request.param
    request.addfinalizer(lambda: setattr(cuda_attention, "PREFILL_PACKED", saved))
    tokens = _tokens(runner)
    logits, kv = _by_decode(runner, tokens, TARGET_PAGES)
    return tokens, logits, kv


def _chunked(runner, tokens, pages, sizes, companions=None):
    """Prefill in chunks of `sizes` (each step optionally batched with companion rows):
    ({end position: logits}, KV)."""
    _clear(runner, pages)
    logits, done = {}, 0
    for step, n in enumerate(sizes):
        others = companions(step) if companions else []
        target = (tokens[:done + n], done, n, pages)
        order = others[:len(others) // 2] + [target] + others[len(others) // 2:]
        out = runner.run(plan(order))
        # every row of `order` samples (its chunk ends at its last token): the target's is its index
        logits[done + n - 1] = out[order.index(target)].clone()
        done += n
    assert done == len(tokens)
    return logits, _kv(runner, pages, len(tokens))


def test_a_single_prefill_writes_the_kv_and_logits_that_decode_steps_do(runner, reference):
    tokens, want_logits, want_kv = reference
    logits, kv = _chunked(runner, tokens, TARGET_PAGES, [len(tokens)])
    assert _same(kv, want_kv)
    assert _same(logits[len(tokens) - 1], want_logits[len(tokens) - 1])


@pytest.mark.parametrize("sizes", [[64] * 2 + [22], [16] * 9 + [6], [1, 3, 70, 60, 16], [100, 50], [2] * 75,
                                   [65, 1, 1, 83]])
def test_chunked_prefill_writes_the_kv_and_logits_that_decode_steps_do(runner, reference, sizes):
    tokens, want_logits, want_kv = reference
    logits, kv = _chunked(runner, tokens, TARGET_PAGES, sizes)
    assert _same(kv, want_kv)
    for pos, row in logits.items():
        assert _same(row, want_logits[pos]), pos


def _companions(runner, rng):
    """Per step: other sequences' rows (decode rows and prefill chunks) on their own pages."""
    def make(step):
        rows, page = [], 40
        many = rng.random() < 0.3          # then a decode batch in the 32- or 64-row bucket
        for i in range(rng.randrange(20, 50) if many else rng.randrange(0, 6)):
            length = rng.randrange(2, 40 if many else 90)
            pages = list(range(page, page + -(-length // PAGE)))
            page += len(pages)
            toks = _tokens(runner, seed=1000 * step + i, length=length)
            n = 1 if rng.random() < 0.6 else rng.randrange(2, length + 1)
            rows.append((toks, length - n, n, pages))
        return rows
    return make


def test_property_any_chunk_sizes_and_batch_mix_give_the_decode_bits(runner, reference):
    pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    tokens, want_logits, want_kv = reference

    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.lists(st.integers(1, 120), min_size=1, max_size=20), st.integers(0, 2 ** 31))
    def check(sizes, seed):
        left, cut = len(tokens), []
        for s in sizes:
            if left == 0:
                break
            cut.append(min(s, left))
            left -= cut[-1]
        if left:
            cut.append(left)
        logits, kv = _chunked(runner, tokens, TARGET_PAGES, cut, _companions(runner, random.Random(seed)))
        assert _same(kv, want_kv), cut
        for pos, row in logits.items():
            assert _same(row, want_logits[pos]), (cut, pos)

    check()


def test_decode_rows_after_an_exact_prefill_match_an_uninterrupted_decode(runner, reference):
    """A recompute: positions 0..99 re-prefilled in one chunk, then decode continues."""
    tokens, want_logits, want_kv = reference
    _chunked(runner, tokens[:100], TARGET_PAGES, [100])
    for p in range(100, len(tokens)):
        out = runner.run(plan([(tokens[:p + 1], p, 1, TARGET_PAGES)]))[0]
        assert _same(out, want_logits[p]), p
    assert _same(_kv(runner, TARGET_PAGES, len(tokens)), want_kv)


def test_exact_prefill_is_refused_by_name_where_decode_is_not_batch_invariant(tiny_model):
    from kvhold.executor.cuda.runner import CudaRunner
    from kvhold.executor.kv_cache import KvCache
    from kvhold.executor.llama import LlamaModel
    from kvhold.protocol.layout import KvGeometry
    from kvhold.protocol.model_spec import ModelSpec
    from tools.bench_engine_setup import load_weights

    spec = ModelSpec.from_dir(tiny_model)
    model = LlamaModel(spec, load_weights(tiny_model, "cuda"), torch.float32, torch.device("cuda"), 256)
    kv = KvCache.private(KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float32", PAGE), 8, "cuda")
    r = CudaRunner(model, kv, max_batch=8, prefill_chunk=32, max_pages_per_seq=16, exact=True)
    assert not r.exact and "bf16/fp16" in r.exact_refusal
    off = CudaRunner(model, kv, max_batch=8, prefill_chunk=32, max_pages_per_seq=16, exact=False)
    assert not off.exact and off.exact_refusal is None
