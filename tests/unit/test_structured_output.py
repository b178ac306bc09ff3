"""Structured output (kvhold.protocol.structured, kvhold.executor.grammar): the output of a
constrained request matches its JSON schema, regex or choices and ends at EOS once complete;
the spec is held by the journal's extras area and refused where it cannot be; an engine taken
over mid-output (its first executor abandoned) continues with the uninterrupted tokens, its
matcher rebuilt from the committed tokens."""
import json
import re

import numpy as np
import pytest
import torch

from kvhold.executor.grammar import Grammars
from kvhold.executor.sampler import sample
from kvhold.executor.sequence import Sequence
from kvhold.protocol import structured
from kvhold.protocol.errors import InvalidParams
from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import KvGeometry, TableGeometry
from kvhold.protocol.sampling import SamplingParams
from tests.unit.helpers import EnginePool, ShmPool, decode_until, float64_model, outputs_alone, run_to_end

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "colour", "n"], "additionalProperties": False}
WORD = "[a-z]{12} [a-z]{12}"


@pytest.fixture(scope="module")
def model(tiny_model):
    return float64_model(tiny_model)


@pytest.fixture(scope="module")
def grammars(tiny_model, model):
    return Grammars.for_model(tiny_model, model.spec.vocab_size, model.spec.eos_token_ids)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def request(i: int, kind: str, spec: str, **params) -> dict:
    return dict(prompt_ids=[30 + 5 * i + j for j in range(7)], max_tokens=60, ignore_eos=False,
                structured=(kind, spec), **params)


def text_of(tokenizer, ids, eos) -> str:
    return tokenizer.decode([t for t in ids if t not in eos])


def test_outputs_match_their_schema_regex_and_choices_and_end_at_eos(model, grammars, tokenizer):
    eos = set(model.spec.eos_token_ids)
    requests = [request(0, "json", json.dumps(SCHEMA)), request(1, "regex", WORD),
                request(2, "choice", json.dumps(["kvhold", "sidecar", "executor"])),
                request(3, "json", structured.ANY_OBJECT, temperature=0.8, seed=3),
                request(4, "grammar", 'root ::= "yes" | "no" | "maybe"')]
    out = outputs_alone(model, requests, grammars=grammars)
    for ids in out:
        assert ids[-1] in eos and len(ids) < 60          # complete, then ended by EOS
    doc = json.loads(text_of(tokenizer, out[0], eos))
    assert set(doc) == {"ok", "colour", "n"} and isinstance(doc["ok"], bool)
    assert doc["colour"] in ("red", "green", "blue") and 0 <= doc["n"] <= 99
    assert re.fullmatch(WORD, text_of(tokenizer, out[1], eos))
    assert text_of(tokenizer, out[2], eos) in ("kvhold", "sidecar", "executor")
    assert isinstance(json.loads(text_of(tokenizer, out[3], eos)), dict)
    assert text_of(tokenizer, out[4], eos) in ("yes", "no", "maybe")
    compact = text_of(tokenizer, out[0], eos)
    assert compact == json.dumps(doc, separators=(",", ":"))     # no whitespace by default


BIAS = tuple((t, -100.0 if t % 3 else 4.0) for t in range(20, 200, 7))


def test_constrained_and_biased_requests_continue_exactly_after_a_takeover(model, grammars):
    requests = [request(0, "json", json.dumps(SCHEMA)), request(1, "regex", WORD),
                request(2, "regex", "[a-z ]{40}", temperature=0.9, seed=11),
                dict(prompt_ids=list(range(40, 47)), max_tokens=40, temperature=0.0, logit_bias=BIAS),
                dict(prompt_ids=list(range(50, 57)), max_tokens=40, temperature=0.7, seed=2, logit_bias=BIAS),
                dict(prompt_ids=list(range(60, 67)), max_tokens=40, temperature=0.0)]
    expected = outputs_alone(model, requests, grammars=grammars)
    free = outputs_alone(model, [{k: v for k, v in r.items() if k not in ("structured", "logit_bias")}
                                 for r in requests])
    assert all(a != b for a, b in zip(expected[:5], free[:5]))        # the grammars and biases matter
    pool = EnginePool(model, 96, grammars=grammars)
    try:
        dead, ids = pool.started(requests)
        decode_until(dead, 6)                     # mid-object, mid-word
        assert all(s.grammar.consumed for s in dead.seqs.values() if s.grammar is not None)
        assert pool.finish_after_takeover(dead, ids) == expected
    finally:
        pool.close()


def test_the_grammar_wins_over_min_tokens_once_only_eos_may_follow(model, grammars):
    params = SamplingParams(seed=1, temperature=0.0, min_tokens=10, structured=("choice", '["ab"]'))
    done = Sequence(slot=0, request_id=1, prompt_len=1, tokens=[5], sampling=params,
                    eos=frozenset(model.spec.eos_token_ids))
    done.grammar = grammars.state(params.structured, 1)
    ids = grammars.tokenizer.tokenize_str("ab")
    done.tokens += ids
    logits = torch.zeros(1, model.spec.vocab_size, dtype=torch.float64)
    assert sample(logits, [done]) == [model.spec.eos_token_ids[0]]      # min_tokens masks EOS, yet EOS


def tables_with_extras(max_extra_bytes: int) -> ShmPool:
    return ShmPool(TableGeometry(kv=KvGeometry(2, 2, 8), num_pages=8, num_slots=4, max_seq_len=64,
                                 num_leases=2, max_extra_bytes=max_extra_bytes))


def test_the_journal_holds_the_spec_and_the_bias_and_refuses_what_does_not_fit():
    pool = tables_with_extras(structured.extra_bytes_for(256))
    try:
        j = Journal(pool.tables)
        spec = json.dumps(SCHEMA)
        j.admit(1, 7, [1, 2, 3], SamplingParams(seed=3, structured=("json", spec), logit_bias={"5": -2, 9: 1.5}))
        j.admit(2, 8, [1, 2, 3], SamplingParams(seed=3))
        assert j.entry(1).sampling.structured == ("json", spec)
        assert j.entry(1).sampling.logit_bias == ((5, -2.0), (9, 1.5))
        assert j.entry(2).sampling.structured is None and j.entry(2).sampling.logit_bias == ()
        with pytest.raises(InvalidParams, match="--max-grammar-bytes"):
            j.admit(3, 9, [1, 2], SamplingParams(seed=3, structured=("regex", "a" * 20000)))
        assert j.is_free(3)
    finally:
        pool.close()
    pool = tables_with_extras(0)
    try:
        with pytest.raises(InvalidParams, match="no room"):
            Journal(pool.tables).admit(0, 7, [1, 2], SamplingParams(seed=3, structured=("regex", "a+")))
    finally:
        pool.close()


def test_logit_bias_forces_and_bans_tokens_for_greedy_and_sampled_rows():
    logits = torch.zeros(3, 50, dtype=torch.float64)
    logits[:, 7] = 5.0
    rows = [Sequence(slot=i, request_id=i, prompt_len=1, tokens=[1], sampling=p) for i, p in enumerate([
        SamplingParams(seed=1, temperature=0.0, logit_bias={"7": -100}),
        SamplingParams(seed=1, temperature=0.0, logit_bias={"30": 100}),
        SamplingParams(seed=1, temperature=1.0, logit_bias={str(t): -100 for t in range(50) if t != 12})])]
    got = sample(logits, rows)
    assert got[0] != 7 and got[1] == 30 and got[2] == 12
    assert logits[0, 7] == 5.0                                  # the caller's logits stay


@pytest.mark.parametrize("value", [{"x": 1}, {"5": 101}, {"5": "1"}, [[1]], {"-1": 0}, 5,
                                   {str(t): 1 for t in range(structured.MAX_LOGIT_BIAS + 1)}])
def test_a_bad_logit_bias_is_invalid_params(value):
    with pytest.raises(InvalidParams, match="logit_bias"):
        SamplingParams(logit_bias=value)


@pytest.mark.parametrize("pair, message", [
    (("json", "{bad"), "not valid JSON"), (("json", '{"type": "objectx"}'), "invalid JSON schema"),
    (("json", "[1]"), "JSON object"), (("regex", "a(b"), "invalid regular expression"),
    (("choice", "[]"), "non-empty list"), (("grammar", "root ::= ("), "does not parse"),
])
def test_a_spec_that_does_not_compile_is_invalid_params_naming_it(pair, message):
    with pytest.raises(InvalidParams, match=message):
        structured.check(pair)


@pytest.mark.parametrize("pair, message", [
    (("grammar", 'start: <[100000]> "a"'), "Token range end too large"),
    (("grammar", "start: <|no_such_token|>"), "unknown special token"),
])
def test_a_spec_that_compiles_but_fails_on_the_vocabulary_is_invalid_params(grammars, pair, message):
    structured.check(pair)                                       # compiles alone
    with pytest.raises(InvalidParams, match=f"cannot be matched with this model's vocabulary: .*{message}"):
        structured.check_on_vocabulary(pair, grammars.tokenizer)
    structured.check_on_vocabulary(("grammar", 'start: <[5]> "a"'), grammars.tokenizer)


@pytest.mark.parametrize("value", [("xml", "<a/>"), ("json",), ("regex", ""), "regex", ("regex", 5)])
def test_the_pair_is_checked_with_the_other_params(value):
    with pytest.raises(InvalidParams):
        SamplingParams(structured=value)


def test_the_wire_and_durable_forms_keep_the_pair():
    p = SamplingParams(seed=2, structured=["regex", "a+"], logit_bias={"3": 1, "2": -1})
    assert p.structured == ("regex", "a+") and p.logit_bias == ((2, -1.0), (3, 1.0))
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert structured.unpack_extras(structured.pack_extras(p.structured, p.logit_bias)) == {
        "structured": ("regex", "a+"), "logit_bias": ((2, -1.0), (3, 1.0))}
    assert np.frombuffer(structured.pack_extras(None), np.uint8).size == 0


def test_a_matcher_that_fails_in_the_executor_ends_its_request_with_an_error(model, grammars):
    """A spec that compiles without the vocabulary but exceeds the matcher's limits on it (more
    choices than a row of its parser holds) ends with ERROR, never with a silent stop."""
    from kvhold.protocol.layout import FinishReason

    many = json.dumps([f"w{i}" for i in range(2500)])
    structured.check(("choice", many))                     # admission's check passes
    pool = EnginePool(model, 96, grammars=grammars)
    try:
        engine, ids = pool.started([request(0, "choice", many), request(1, "regex", WORD)])
        run_to_end(engine)
        reasons = [int(pool.tables.requests["finish_reason"][int((pool.tables.requests["request_id"] == rid)
                                                                  .nonzero()[0][0])]) for rid in ids]
        assert reasons[0] == FinishReason.ERROR and reasons[1] == FinishReason.STOP
    finally:
        pool.close()


def test_defaults_set_no_field_a_bridge_refuses():
    from kvhold.protocol.settings import BRIDGE_UNSUPPORTED

    assert SamplingParams().first_set(BRIDGE_UNSUPPORTED) is None
    assert SamplingParams(logit_bias={"3": 1}).first_set(BRIDGE_UNSUPPORTED) == "logit_bias"
    with pytest.raises(InvalidParams, match="token ids"):
        SamplingParams(logit_bias={"\u00b2": 1})           # a digit, not an ASCII one


def test_an_llguidance_older_than_kvhold_needs_refuses_structured_requests_naming_the_version(monkeypatch):
    """llguidance before 1.9 takes one eos id where kvhold passes the model's list: every structured
    request would fail inside the engine. The installed one is new enough, and an older one is
    refused at admission as a 4xx that says which version to install."""
    assert structured.engine_version() >= structured.MIN_LLGUIDANCE
    structured.check(("regex", "[a-z]+"))
    monkeypatch.setattr(structured, "engine_version", lambda: (1, 6))
    with pytest.raises(InvalidParams, match=r"llguidance 1\.6 is older than 1\.9.*llguidance>=1\.9"):
        structured.check(("regex", "[a-z]+"))
