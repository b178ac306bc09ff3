"""One definition of a request's fields and their ranges (kvhold.protocol.sampling), used by
admission and by the journals: what is accepted can be journaled and restored; what is not is
refused before anything is written; a durable record with any value in any field (and a
valid checksum) never stops a restore: it is restored or moved to failed/ with its reason."""
import json
import os
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvhold.protocol import messages as m
from kvhold.protocol.errors import ErrorCode, InvalidParams
from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import KvGeometry, TableGeometry
from kvhold.protocol.sampling import LIMITS, TOKEN_ID_MAX, RequestInput, SamplingParams
from kvhold.sidecar.durable_journal import DurableJournal
from kvhold.frontend.frontend import Frontend
from kvhold.frontend.restore import Restore
from kvhold.sidecar.timeline import RecoveryTimeline
from kvhold.testing.frontend_host import FrontendHost
from tests.unit.helpers import FINGERPRINT, GENERATION, POISON, ints, records, valid_record, write_record

GEOMETRY = TableGeometry(kv=KvGeometry(2, 2, 8, "float32", 4), num_pages=16, num_slots=4,
                         max_seq_len=64, num_leases=4)
VOCAB = 512


def _frontend(tables, durable):
    return Frontend(tables, types.SimpleNamespace(vocab_size=VOCAB), None, runs_model=True,
                    durable=durable, fingerprint=FINGERPRINT, timeline=RecoveryTimeline(), host=FrontendHost())


@pytest.fixture
def table_generation():
    return GENERATION


# ------------------------------------------------------------------ admission
BAD_PARAMS = [dict(top_k=2**31), dict(top_k=2**64), dict(top_k=-1), dict(temperature="0.5"),
              dict(temperature=float("nan")), dict(temperature=1e39), dict(top_p=0.0), dict(top_p=1e-46),
              dict(top_p=1.5), dict(seed=-1), dict(seed=2**63), dict(max_tokens=-5), dict(max_tokens=0),
              dict(max_tokens=2**32), dict(stop_token_ids=list(range(9))), dict(stop_token_ids=[2**31]),
              dict(stop_token_ids=[-1]), dict(stop_token_ids=[True]), dict(ignore_eos=1), dict(max_tokens=True),
              dict(max_tokens=10**5000), dict(bogus=1)]


@pytest.mark.parametrize("params", BAD_PARAMS, ids=lambda p: next(iter(p)))
def test_a_bad_field_is_refused_at_admission_and_nothing_is_journaled(tables, tmp_path, params):
    durable = DurableJournal(tmp_path / "journal")
    fe = _frontend(tables, durable)
    reply = fe.handle(b"uclient", m.Generate(tag=1, params={"max_tokens": 2, **params}, prompt_ids=[1, 2]))
    assert isinstance(reply, m.Error) and reply.code == ErrorCode.INVALID_PARAMS, reply
    assert reply.message and len(reply.message) < 300
    assert not list(durable.dir.glob("req-*")) and Journal(tables).num_free_slots() == GEOMETRY.num_slots
    with pytest.raises(InvalidParams):                      # the SDK refuses it the same way
        RequestInput.check(prompt_ids=[1, 2], params={"max_tokens": 2, **params})


@pytest.mark.parametrize("params", [dict(logprobs=0), dict(logprobs=2), dict(prompt_logprobs=0)],
                         ids=lambda p: f"{next(iter(p))}={next(iter(p.values()))}")
def test_log_probs_without_a_logprob_area_are_refused_at_admission_naming_the_field(tables, tmp_path, params):
    """No logprob area (--max-logprobs 0, or a workload that computes none): k = 0 (the token's
    own log-prob, no top ones) is refused as any k is, INVALID_PARAMS naming the field, never
    an internal error from the journal's own check."""
    assert tables.geometry.max_logprobs == 0 and tables.logprobs is None
    durable = DurableJournal(tmp_path / "journal")
    reply = _frontend(tables, durable).handle(b"uclient", m.Generate(tag=1, params={"max_tokens": 2, **params},
                                                                     prompt_ids=[1, 2]))
    assert isinstance(reply, m.Error) and reply.code == ErrorCode.INVALID_PARAMS, reply
    assert reply.message.startswith(f"{next(iter(params))}: this server computes no log-probs"), reply.message
    assert not list(durable.dir.glob("req-*")) and Journal(tables).num_free_slots() == tables.geometry.num_slots


@pytest.mark.parametrize("kw", [dict(prompt="\ud800 lone"), dict(prompt_ids=[1, 2**64]), dict(prompt_ids=[1, 2**31]),
                                dict(prompt_ids=[1, VOCAB]), dict(prompt_ids=[1, -1]), dict(prompt_ids=[]),
                                dict(prompt=""), dict(prompt_ids=[1], prefix_generated=[2**40])])
def test_a_bad_prompt_is_refused_by_the_sdk_check(kw):
    with pytest.raises(InvalidParams):
        RequestInput.check(params=dict(max_tokens=4), vocab_size=VOCAB, **kw)


floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 1), st.integers(-3, 3))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(max_tokens=ints, temperature=floats, top_p=floats, top_k=ints, seed=ints,
       stop=st.lists(ints, max_size=10), ignore_eos=st.booleans())
def test_whatever_the_check_accepts_the_journal_holds_exactly(tables, max_tokens, temperature, top_p, top_k,
                                                              seed, stop, ignore_eos):
    try:
        p = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                           stop_token_ids=tuple(stop), ignore_eos=ignore_eos)
    except InvalidParams:
        return
    journal = Journal(tables)
    slot = journal.free_slot()
    journal.admit(slot, (2 << 40) | 1, [1, 2], p)
    e = journal.entry(slot)
    journal.release(slot)
    assert (e.max_tokens, e.sampling.top_k, e.sampling.seed, e.sampling.stop_token_ids, e.sampling.ignore_eos) == (
        p.max_tokens, p.top_k, p.seed, p.stop_token_ids, p.ignore_eos)
    assert e.sampling.temperature == float(np.float32(p.temperature)) and np.isfinite(e.sampling.temperature)
    assert 0 < e.sampling.top_p == float(np.float32(p.top_p)) <= 1


def test_the_http_bounds_are_the_protocol_bounds():
    from kvhold.serving.openai_schema import CompletionRequest

    props = CompletionRequest.model_json_schema()["properties"]
    top_k = next(s for s in props["top_k"]["anyOf"] if s.get("type") == "integer")
    assert top_k["maximum"] == LIMITS["top_k"].hi
    prompt_ids = next(s for s in props["prompt"]["anyOf"] if s.get("type") == "array"
                      and s["items"].get("type") == "integer")
    assert prompt_ids["items"]["maximum"] == TOKEN_ID_MAX


# ------------------------------------------------------------------ restore
def restore_into(tables, directory) -> tuple[Frontend, Restore]:
    durable = DurableJournal(directory)
    fe = _frontend(tables, durable)
    r = Restore(fe, durable, fingerprint=FINGERPRINT, vocab_size=VOCAB, generation=GENERATION,
                started_ns=0, send_client=fe.host.send_client)
    fe.restored = r
    r.restore()
    return fe, r


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_record_is_restored_or_failed_and_the_others_come_back(tables, tmp_path_factory, data):
    directory = tmp_path_factory.mktemp("journal")
    ids = [((GENERATION - 1) << 40) | i for i in range(1, 4)]
    bodies = {rid: data.draw(records(rid)) for rid in ids[:2]}
    for rid, body in bodies.items():
        write_record(directory, rid, body)
    write_record(directory, ids[2], valid_record(ids[2]))       # untouched: always comes back
    for slot in Journal(tables).live_slots():                    # hypothesis reuses the fixture
        Journal(tables).release(int(slot))

    fe, r = restore_into(tables, directory)                      # never raises

    restored = set(fe.streams)
    assert ids[2] in restored
    assert restored | set(r.failed) == set(ids) and not restored & set(r.failed)
    assert sorted(p.name for p in directory.glob("req-*.json")) == sorted(f"req-{i:016x}.json" for i in restored)
    for rid in r.failed:
        assert (directory / "failed" / f"req-{rid:016x}.reason").read_text().strip()
    journal = Journal(tables)
    assert len(journal.live_slots()) == len(restored)
    for rid in restored:
        body = bodies.get(rid) or valid_record(rid)
        e = journal.entry(fe.streams[rid].slot)
        assert (e.request_id, e.max_tokens, e.sampling.top_k, e.sampling.seed) == (rid, body["max_tokens"], body["top_k"], body["seed"])
        assert e.num_generated == len(body["generated"])


@pytest.mark.parametrize("field,value,reason", POISON)
def test_a_record_with_a_bad_value_is_failed_with_its_reason(tables, tmp_path, field, value, reason):
    rid = ((GENERATION - 1) << 40) | 1
    body = dict(valid_record(rid), **{field: value})
    write_record(tmp_path, value if field == "request_id" else rid, body)
    write_record(tmp_path, rid + 1, valid_record(rid + 1))
    fe, r = restore_into(tables, tmp_path)
    assert list(fe.streams) == [rid + 1]
    (failed,) = r.failed.values()
    assert reason in failed.reason, failed.reason
    assert json.loads((tmp_path / "failed" / os.path.basename(failed.path)).read_text())["body"][field] == value
