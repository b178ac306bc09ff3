"""vLLM's penalties and min_p (kvhold.executor.sampler): the sampler's logits against a plain
reference of vLLM's formulas, per row whatever the batch; the fields checked with the others
and held by the journal's record and the durable record; an engine run in this process and
taken over mid-decode (its first executor abandoned) gives the uninterrupted tokens."""

import numpy as np
import pytest
import torch

from kvhold.executor.sampler import _penalize, sample
from kvhold.executor.sequence import Sequence
from kvhold.protocol.errors import InvalidParams
from kvhold.protocol.sampling import SamplingParams
from kvhold.sidecar.durable_journal import decode_record, encode_record, record_sampling
from tests.unit.helpers import EnginePool, decode_until, float64_model, outputs_alone

VOCAB = 12
PROMPT = [3, 4, 4, 9]


def seq(generated, **params) -> Sequence:
    return Sequence(slot=0, request_id=1, prompt_len=len(PROMPT), tokens=PROMPT + list(generated),
                    sampling=SamplingParams(seed=5, **params))


def reference(logits: np.ndarray, prompt, generated, presence=0.0, frequency=0.0, repetition=1.0) -> np.ndarray:
    """vLLM's apply_penalties, one row, by the book."""
    out = logits.copy()
    for t in set(prompt) | set(generated):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(generated):
        n = list(generated).count(t)
        out[t] -= frequency * n + presence
    return out


@pytest.mark.parametrize("params", [dict(presence_penalty=0.7), dict(frequency_penalty=1.3),
                                    dict(repetition_penalty=1.8), dict(repetition_penalty=0.6),
                                    dict(presence_penalty=-0.5, frequency_penalty=0.4, repetition_penalty=1.2)])
def test_penalties_follow_vllms_formulas(params):
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2, size=(1, VOCAB))
    generated = [4, 7, 7, 1, 7]
    got = _penalize(torch.tensor(logits), [seq(generated, **params)])[0].numpy()
    want = reference(logits[0], PROMPT, generated, params.get("presence_penalty", 0.0),
                     params.get("frequency_penalty", 0.0), params.get("repetition_penalty", 1.0))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_a_penalty_changes_the_greedy_token_and_only_its_row():
    logits = torch.zeros(2, VOCAB, dtype=torch.float64)
    logits[:, 7] = 3.0
    logits[:, 2] = 2.5
    plain, penalized = seq([7, 7], temperature=0.0), seq([7, 7], temperature=0.0, frequency_penalty=0.5)
    assert sample(logits, [plain, penalized]) == [7, 2]          # 3 - 2 x 0.5 < 2.5
    assert logits[1, 7] == 3.0                                  # the caller's logits stay


def test_a_row_is_penalized_the_same_in_any_batch():
    rng = np.random.default_rng(7)
    logits = torch.tensor(rng.normal(0, 1.5, size=(6, VOCAB)))
    seqs = [seq([1, 2, 2, i % VOCAB], temperature=0.9, presence_penalty=0.3 * i, repetition_penalty=1.1,
                min_p=0.05 * i) for i in range(6)]
    together = sample(logits, seqs)
    assert [sample(logits[i:i + 1], [s])[0] for i, s in enumerate(seqs)] == together


def test_min_p_drops_the_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04] + [1e-6] * (VOCAB - 5)], dtype=torch.float64))
    picked = {sample(logits, [seq(range(g), temperature=1.0, min_p=0.25)])[0] for g in range(300)}
    assert picked == {0, 1}                                     # p >= 0.25 x 0.5 only
    picked = {sample(logits, [seq(range(g), temperature=1.0)])[0] for g in range(300)}
    assert len(picked) > 2


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                         ("repetition_penalty", 0.0), ("repetition_penalty", 1e-50),
                                         ("min_p", -0.1), ("min_p", 1.1), ("presence_penalty", float("nan"))])
def test_out_of_range_values_are_refused_by_name(field, value):
    with pytest.raises(InvalidParams, match=field):
        SamplingParams(**{field: value})


def test_the_journal_and_the_durable_record_hold_the_penalties(journal):
    p = SamplingParams(max_tokens=20, temperature=0.5, seed=3, presence_penalty=0.25, frequency_penalty=-1.5,
                       repetition_penalty=1.25, min_p=0.125)
    journal.admit(1, (1 << 40) | 5, [1, 2, 3], p)
    assert journal.entry(1).sampling == p
    body = {"request_id": (1 << 40) | 5, "generation": 1, "client": "7501", "prompt_ids": [1, 2, 3],
            "generated": [], "sampling": p.to_dict()}
    assert record_sampling(decode_record(encode_record(body))) == p
    older = dict(body, sampling={k: v for k, v in p.to_dict().items()              # an earlier build's
                                 if k not in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                                              "min_p")})
    assert not record_sampling(decode_record(encode_record(older))).penalized
    journal.tables.requests["repetition_penalty"][1] = 0       # an earlier build's shared record
    assert journal.entry(1).sampling.repetition_penalty == 1.0


@pytest.fixture(scope="module")
def model(tiny_model):
    return float64_model(tiny_model)


def test_penalized_requests_continue_exactly_after_a_takeover(model):
    requests = [dict(prompt_ids=[20 + 7 * i + j for j in range(9)], max_tokens=40, ignore_eos=True, **params)
                for i, params in enumerate([dict(temperature=0.0, repetition_penalty=1.3),
                                            dict(temperature=0.0, frequency_penalty=0.8, presence_penalty=0.4),
                                            dict(temperature=0.9, seed=4, min_p=0.1, presence_penalty=1.0),
                                            dict(temperature=0.0)])]

    expected = outputs_alone(model, requests, 64)
    plain = outputs_alone(model, [{k: v for k, v in r.items() if "penalty" not in k and k != "min_p"}
                                  for r in requests], 64)
    assert [a != b for a, b in zip(expected, plain)][:3] == [True, True, True]   # the penalties matter
    pool = EnginePool(model, 64)
    try:
        dead, ids = pool.started(requests)
        decode_until(dead, 17)
        assert pool.finish_after_takeover(dead, ids) == expected
    finally:
        pool.close()
