"""Exact prefill on the GPU (skipped on CPU): a token position's KV and logits are the same
bits whether a single prefill, chunked prefill (any chunk sizes, any batch mix) or a
decode step computed it (kvhold.executor.cuda_runner, exact prefill)."""
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
    from kvhold.executor import cuda_gemm

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
    bk = cuda_gemm.prefill_tiles(n, k)[2]
    for bm, bn, warps, stages in ((64, 64, 4, 3), (128, 64, 4, 2), (128, 128, 8, 2), (64, 128, 8, 2)):
        res = h.clone() if residual else None
        got = cuda_gemm.skinny(x, w, residual=res, out=res, block_n=bn, block_k=bk, num_warps=warps,
                               num_stages=stages, rows_per_program=bm, group_m=4)
        assert _same(got, want), (bm, bn, warps, stages)


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
    from kvhold.executor.cuda_runner import CudaRunner
    from kvhold.executor.kv_cache import KvCache
    from kvhold.executor.llama import LlamaModel
    from kvhold.protocol.layout import KvGeometry
    from kvhold.protocol.model_spec import ModelSpec
    from tools.bench_engine_setup import load_weights

    spec = ModelSpec.from_dir(tiny_model)
    model = LlamaModel(spec, _bf16_region(load_weights(tiny_model, "cuda")), torch.bfloat16,
                       torch.device("cuda"), 512)
    kv = KvCache.private(KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "bfloat16", PAGE), 128,
                         "cuda")
    r = CudaRunner(model, kv, max_batch=64, prefill_chunk=256, max_pages_per_seq=32)
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


def _by_decode(runner, tokens, pages, first=2):
    """Prefill `first` tokens, then one decode step per token: ({position: logits}, KV)."""
    _clear(runner, pages)
    logits = {first - 1: runner.run(plan([(tokens[:first], 0, first, pages)]))[0].clone()}
    for p in range(first, len(tokens)):
        logits[p] = runner.run(plan([(tokens[:p + 1], p, 1, pages)]))[0].clone()
    return logits, _kv(runner, pages, len(tokens))


@pytest.fixture(scope="module")
def reference(runner):
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
        for i in range(rng.randrange(0, 6)):
            length = rng.randrange(2, 90)
            pages = list(range(page, page + -(-length // PAGE)))
            page += len(pages)
            toks = _tokens(runner, seed=1000 * step + i, length=length)
            n = 1 if rng.random() < 0.6 else rng.randrange(2, length + 1)
            rows.append((toks, length - n, n, pages))
        return rows
    return make


def test_property_any_chunk_sizes_and_batch_mix_give_the_decode_bits(runner, reference):
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
    from kvhold.executor.cuda_runner import CudaRunner
    from kvhold.executor.kv_cache import KvCache
    from kvhold.executor.llama import LlamaModel
    from kvhold.protocol.layout import KvGeometry
    from kvhold.protocol.model_spec import ModelSpec
    from tools.bench_engine_setup import load_weights

    spec = ModelSpec.from_dir(tiny_model)
    model = LlamaModel(spec, load_weights(tiny_model, "cuda"), torch.float32, torch.device("cuda"), 256)
    kv = KvCache.private(KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float32", PAGE), 8, "cuda")
    r = CudaRunner(model, kv, max_batch=8, prefill_chunk=32, max_pages_per_seq=16)
    assert not r.exact and "bf16/fp16" in r.exact_refusal
    off = CudaRunner(model, kv, max_batch=8, prefill_chunk=32, max_pages_per_seq=16, exact=False)
    assert not off.exact and off.exact_refusal is None
