"""min_tokens, vLLM's meaning: a request's stop ids and EOS (unless ignore_eos) cannot end it
before min_tokens generated tokens. The sampler masks them, by the request and the position
only; the field travels with the request's one record (wire, journal, durable record)."""

import msgpack
import pytest
import torch

from kvhold.executor.sampler import sample
from kvhold.executor.sequence import Sequence
from kvhold.protocol import messages as m
from kvhold.protocol.errors import ErrorCode, InvalidParams
from kvhold.protocol.sampling import SamplingParams
from kvhold.protocol.wire import PROTOCOL_VERSION, WireError, decode, encode
from kvhold.sidecar.durable_journal import decode_record, encode_record, record_sampling

EOS, STOP, VOCAB = 2, 5, 16


def seq(generated: int, eos=frozenset({EOS}), **params) -> Sequence:
    s = Sequence(slot=0, request_id=1, prompt_len=3, tokens=[7, 8, 9] + [1] * generated,
                 sampling=SamplingParams(seed=11, **params))
    s.eos = eos
    return s


def favouring(*tokens: int, rows: int = 1) -> torch.Tensor:
    """Logits under which `tokens` are by far the most likely (the first the most)."""
    logits = torch.zeros(rows, VOCAB, dtype=torch.float64)
    for rank, t in enumerate(tokens):
        logits[:, t] = 20.0 - rank
    return logits


@pytest.mark.parametrize("temperature", [0.0, 0.8, 1.5])
def test_the_sampler_never_picks_eos_or_a_stop_id_before_min_tokens(temperature):
    params = dict(max_tokens=12, min_tokens=6, temperature=temperature, stop_token_ids=(STOP,))
    logits = favouring(EOS, STOP)
    for generated in range(12):
        picks = set()
        for seed in range(40):
            s = seq(generated)
            s.sampling = SamplingParams(seed=seed, **params)
            picks.add(sample(logits, [s])[0])
        if generated < 6:
            assert not picks & {EOS, STOP}, (generated, picks)
        elif temperature == 0:
            assert picks == {EOS}                     # free again: the most likely token
        else:
            assert EOS in picks


def test_ignore_eos_masks_only_the_stop_ids():
    logits = favouring(EOS, STOP, 9)
    s = seq(0, max_tokens=8, min_tokens=4, temperature=0.0, stop_token_ids=(STOP,), ignore_eos=True)
    assert s.masked_ids() == (STOP,) and sample(logits, [s]) == [EOS]
    s = seq(0, max_tokens=8, min_tokens=4, temperature=0.0, stop_token_ids=(STOP,))
    assert s.masked_ids() == (EOS, STOP) and sample(logits, [s]) == [9]
    assert seq(4, max_tokens=8, min_tokens=4, stop_token_ids=(STOP,)).masked_ids() == ()


def test_the_mask_is_per_row_deterministic_and_leaves_the_logits_alone():
    logits = favouring(EOS, STOP, 9, rows=3)
    raw = logits.clone()
    rows = [seq(1, max_tokens=8, min_tokens=4, temperature=0.9, stop_token_ids=(STOP,)),
            seq(1, max_tokens=8, temperature=0.0),
            seq(5, max_tokens=8, min_tokens=4, temperature=0.0)]
    together = sample(logits, rows)
    assert torch.equal(logits, raw)                   # log-probs read the raw distribution
    assert together == [sample(logits[i:i + 1], [rows[i]])[0] for i in range(3)]
    assert together[0] not in (EOS, STOP) and together[1:] == [EOS, EOS]


def test_min_tokens_is_checked_with_the_other_fields():
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4
    for bad in (dict(max_tokens=4, min_tokens=5), dict(min_tokens=-1), dict(min_tokens=True),
                dict(min_tokens=1.5)):
        with pytest.raises(InvalidParams, match="min_tokens"):
            SamplingParams.from_dict(bad)
    frame = msgpack.packb([PROTOCOL_VERSION, "generate", {"tag": 7, "params": {"max_tokens": 2, "min_tokens": 3},
                                                          "prompt_ids": [1, 2]}])
    with pytest.raises(WireError, match="min_tokens") as info:
        decode(frame)
    assert info.value.code == ErrorCode.INVALID_PARAMS
    msg = m.Generate(tag=1, params=SamplingParams(max_tokens=9, min_tokens=3, stop_token_ids=(4,)), prompt="x")
    assert decode(encode(msg)) == msg


def test_the_journal_and_the_durable_record_hold_min_tokens(journal):
    p = SamplingParams(max_tokens=20, min_tokens=7, temperature=0.5, seed=3, stop_token_ids=(4, 6),
                       ignore_eos=True)
    journal.admit(1, (1 << 40) | 5, [1, 2, 3], p)
    e = journal.entry(1)
    assert e.sampling == p and e.max_tokens == 20
    body = {"request_id": (1 << 40) | 5, "generation": 1, "client": "7501", "prompt_ids": [1, 2, 3],
            "generated": [], "sampling": p.to_dict()}
    assert record_sampling(decode_record(encode_record(body))) == p
    flat = {k: v for k, v in body.items() if k != "sampling"}     # an earlier build's record
    flat.update(max_tokens=20, seed=3, temperature=0.5, top_p=1.0, top_k=0, stop_ids=[4, 6], ignore_eos=True)
    assert record_sampling(decode_record(encode_record(flat))) == SamplingParams(
        max_tokens=20, temperature=0.5, seed=3, stop_token_ids=(4, 6), ignore_eos=True)
    with pytest.raises(ValueError, match="seed"):
        record_sampling(dict(body, sampling=dict(p.to_dict(), seed=None)))
