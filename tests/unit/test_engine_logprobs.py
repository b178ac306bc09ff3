"""Log-probs computed by the CPU engine (float64) against a direct torch log_softmax of the
model's logits: every generated token's, the top ones at each position, and the prompt tokens'
(computed in prefill chunks); stored in the journal's logprob area with their tokens. Also: a
preemption's recomputation rewrites none, and a pool restart's recomputes them all the same."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from kvhold.executor.engine import Engine
from kvhold.executor.kv_cache import KvCache
from kvhold.executor.llama import SeqSlice, StepInput
from kvhold.protocol.errors import InvalidParams
from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import ExecState, KvGeometry, TableGeometry
from kvhold.protocol.leases import Lease, LeaseTable
from kvhold.protocol.tables import Tables
from kvhold.protocol.sampling import SamplingParams
from tests.unit.helpers import float64_model

PAGE_TOKENS = 16
MAX_SEQ = 128
K = 5


@pytest.fixture(scope="module")
def model(tiny_model):
    return float64_model(tiny_model, MAX_SEQ)


_made: list = []      # the tables the test made, unlinked after it


@pytest.fixture(autouse=True)
def _unlink_tables():
    yield
    while _made:
        _made.pop().unlink()


def pool(model, num_pages=64, max_logprobs=K):
    spec = model.spec
    geometry = TableGeometry(kv=KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float64",
                                           PAGE_TOKENS), num_pages=num_pages, num_slots=8,
                             max_seq_len=MAX_SEQ, num_leases=2, max_logprobs=max_logprobs)
    tables = Tables.create(f"/kvhold-test-lp-{os.getpid()}-{time.monotonic_ns()}", geometry, 1)
    _made.append(tables)
    return tables, KvCache.private(geometry.kv, num_pages)


def engine(model, tables, kv, **kw):
    lease = Lease(tables, 0, LeaseTable(tables).grant(0, os.getpid()))
    e = Engine(model, kv, tables, lease, kw.get("max_batch", 4), kw.get("max_batch_tokens", 40),
               prefill_chunk=kw.get("prefill_chunk", 8))
    e.take_over([], 0)
    return e


def admit(tables, slot, prompt, **kw):
    j = Journal(tables)
    rid = j.new_request_id()
    params = dict(max_tokens=6, seed=7, temperature=0.0, top_p=1.0, top_k=0, ignore_eos=True)
    params.update(kw)
    j.admit(slot, rid, prompt, SamplingParams(**params))
    return rid


def run(e, steps=200):
    for _ in range(steps):
        if not e.has_work:
            return
        e.step()
    e.flush()


def reference(model, tokens):
    """log_softmax of the logits at every position of `tokens` (one plain forward)."""
    kv = KvCache.private(KvGeometry(model.spec.num_layers, model.spec.num_kv_heads, model.spec.head_dim,
                                    "float64", PAGE_TOKENS), 16)
    n = len(tokens)
    pages = list(range(1, -(-n // PAGE_TOKENS) + 1))
    step = StepInput(token_ids=torch.tensor(tokens), positions=torch.arange(n),
                     write_pages=torch.tensor([pages[i // PAGE_TOKENS] for i in range(n)]),
                     write_slots=torch.tensor([i % PAGE_TOKENS for i in range(n)]),
                     seqs=[SeqSlice(start=0, n=n, context=n, pages=torch.tensor(pages))],
                     logits_rows=torch.arange(n))
    return torch.log_softmax(model.forward(step, kv), dim=-1)


def check_row(area, ref_row, token, k):
    """One position of the area against the reference distribution that produced `token`."""
    assert area["logprob"] == np.float32(ref_row[token].item())
    assert area["rank"] == int((ref_row > ref_row[token]).sum()) + 1       # vLLM's rank
    vals, ids = torch.sort(ref_row, descending=True, stable=True)
    assert area["top_ids"][:k].tolist() == ids[:k].tolist()
    assert area["top_logprobs"][:k].tolist() == vals[:k].float().tolist()


PROMPT = [3, 17, 42, 9, 5, 88, 21, 60, 2, 14, 33, 71]   # 12 tokens: two prefill chunks of 8


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generated_and_prompt_logprobs_match_a_direct_log_softmax(model, temperature):
    tables, kv = pool(model)
    e = engine(model, tables, kv)
    rid = admit(tables, 0, PROMPT, logprobs=K, prompt_logprobs=3, temperature=temperature, top_k=20)
    run(e)
    j = Journal(tables)
    entry = j.entry(0)
    assert entry.exec_state == ExecState.FINISHED and entry.request_id == rid
    tokens = j.all_tokens(0, entry.num_tokens).tolist()
    ref = reference(model, tokens)
    area = tables.logprobs[0]
    # raw distribution: temperature and top_k do not change the reported log-probs
    for pos in range(1, entry.num_tokens):
        check_row(area[pos], ref[pos - 1], tokens[pos], K if pos >= len(PROMPT) else 3)
    assert j.lp_done(0, rid) == entry.num_tokens


def test_no_logprobs_asked_writes_none(model):
    tables, kv = pool(model)
    e = engine(model, tables, kv)
    admit(tables, 0, PROMPT)
    run(e)
    assert not tables.logprobs["logprob"].any()


def test_only_generated_logprobs_and_k_zero(model):
    tables, kv = pool(model)
    e = engine(model, tables, kv)
    rid = admit(tables, 0, PROMPT, logprobs=0)
    run(e)
    j = Journal(tables)
    entry = j.entry(0)
    tokens = j.all_tokens(0, entry.num_tokens).tolist()
    ref = reference(model, tokens)
    assert not tables.logprobs[0, :len(PROMPT)]["logprob"].any()
    for pos in range(len(PROMPT), entry.num_tokens):
        check_row(tables.logprobs[0, pos], ref[pos - 1], tokens[pos], 0)
    assert j.lp_done(0, rid) == entry.num_tokens


def test_a_pool_restart_recomputes_the_restored_tokens_logprobs(model):
    """restore_progress: tokens with no KV and no log-probs; the re-prefill computes them."""
    tables, kv = pool(model)
    e = engine(model, tables, kv)
    rid = admit(tables, 0, PROMPT, logprobs=2, max_tokens=8)
    run(e)
    j = Journal(tables)
    entry = j.entry(0)
    want = tables.logprobs[0, :entry.num_tokens].copy()
    generated = j.generated(0, 0, entry.num_generated)

    tables2, kv2 = pool(model)
    j2 = Journal(tables2)
    j2.admit(0, rid, PROMPT, SamplingParams(max_tokens=8, seed=7, temperature=0.0, top_p=1.0, top_k=0, ignore_eos=True,
                                            logprobs=2))
    j2.restore_progress(0, rid, generated[:5])
    assert j2.lp_done(0, rid) == len(PROMPT)
    e2 = engine(model, tables2, kv2)
    run(e2)
    got = tables2.logprobs[0, :entry.num_tokens]
    assert j2.generated(0, 0, j2.entry(0).num_generated) == generated
    assert (got["logprob"][len(PROMPT):] == want["logprob"][len(PROMPT):]).all()
    assert (got["top_ids"][len(PROMPT):, :2] == want["top_ids"][len(PROMPT):, :2]).all()


def test_preemption_recomputes_no_logprob(model):
    """Few pages: requests are preempted and recomputed; their log-probs are those of a run with
    room for all (and lp_done keeps the recomputation from writing them again)."""
    prompts = [[(7 * i + 3 * r) % 200 + 1 for i in range(20)] for r in range(3)]

    def outcome(num_pages):
        tables, kv = pool(model, num_pages=num_pages)
        e = engine(model, tables, kv, max_batch=3)
        for slot, p in enumerate(prompts):
            admit(tables, slot, p, logprobs=K, prompt_logprobs=K, max_tokens=20, temperature=0.7)
        run(e, steps=1000)
        j = Journal(tables)
        n = [j.entry(s).num_tokens for s in range(3)]
        return [tables.logprobs[s, :n[s]].copy() for s in range(3)], e.scheduler.num_preemptions

    roomy, none = outcome(64)
    tight, preempted = outcome(6)
    assert none == 0 and preempted > 0
    for a, b in zip(roomy, tight):
        assert a.tobytes() == b.tobytes()


def test_limits_are_refused_before_anything_is_written(model):
    tables, _ = pool(model)
    with pytest.raises(InvalidParams, match="limit of 5"):
        admit(tables, 0, PROMPT, logprobs=6)
    tables0, _ = pool(model, max_logprobs=0)
    assert tables0.logprobs is None
    with pytest.raises(InvalidParams, match="--max-logprobs 0"):
        admit(tables0, 0, PROMPT, prompt_logprobs=0)
    assert Journal(tables).num_free_slots() == 8
