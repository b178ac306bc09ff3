"""Structured output through `kvhold serve`, as the openai SDK and vLLM's clients ask for it:
response_format json_schema and json_object, vLLM's guided_json, guided_regex, guided_choice,
guided_grammar and structured_outputs; streamed and not; a spec that does not compile, two at
once or one over --max-grammar-bytes is a 400 naming the field, and costs no other request;
logit_bias forces and bans tokens."""
import json
import re

import openai
import pytest

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "colour", "n"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Answer in JSON."}]


def check(doc: dict) -> None:
    assert set(doc) == {"ok", "colour", "n"} and isinstance(doc["ok"], bool)
    assert doc["colour"] in ("red", "green") and 0 <= doc["n"] <= 9


def test_the_openai_sdk_gets_json_of_its_schema_streamed_and_not(server):
    client = server.openai()
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="tiny-v1", messages=CHAT, response_format=fmt, max_tokens=80,
                                       temperature=0)
    assert r.choices[0].finish_reason == "stop"
    text = r.choices[0].message.content
    check(json.loads(text))
    assert text == json.dumps(json.loads(text), separators=(",", ":"))       # compact
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny-v1", messages=CHAT, response_format=fmt, max_tokens=80, temperature=0, stream=True)
        if c.choices)
    assert streamed == text
    sampled = client.chat.completions.create(model="tiny-v1", messages=CHAT, max_tokens=120, temperature=1.0,
                                             seed=5, response_format={"type": "json_object"})
    assert isinstance(json.loads(sampled.choices[0].message.content), dict)


@pytest.mark.parametrize("field, value, ok", [
    ("guided_choice", ["kvhold", "sidecar"], lambda t: t in ("kvhold", "sidecar")),
    ("guided_regex", "[a-z]{5}-[0-9]{3}", lambda t: re.fullmatch("[a-z]{5}-[0-9]{3}", t)),
    ("guided_json", SCHEMA, lambda t: check(json.loads(t)) is None),
    ("guided_grammar", 'root ::= "yes" | "no"', lambda t: t in ("yes", "no")),
    ("structured_outputs", {"choice": ["up", "down"]}, lambda t: t in ("up", "down")),
])
def test_vllms_guided_fields_constrain_completions(server, field, value, ok):
    r = server.post("/v1/completions", {"prompt": "The sidecar keeps", "max_tokens": 60, "temperature": 0,
                                        field: value})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert ok(text), text


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_json": {"type": "objectx"}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_regex": "a" * 70000}, None),                      # over --max-grammar-bytes (64 KiB)
])
def test_a_bad_spec_is_a_400_naming_it_and_the_server_serves_on(server, body, param):
    r = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    else:
        assert "--max-grammar-bytes" in error["message"], error
    assert server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("grammar", ['start: <[100000]> "a"', "start: <|no_such_token|>"])
def test_a_grammar_that_compiles_but_not_on_the_models_vocabulary_is_a_400(server, grammar):
    r = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 4, "guided_grammar": grammar})
    assert r.status_code == 400, r.text
    assert "vocabulary" in r.json()["error"]["message"]
    assert server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_logit_bias_forces_and_bans_tokens(server):
    body = {"prompt": "The sidecar keeps", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0}

    def tokens(**extra):
        r = server.post("/v1/completions", {**body, **extra})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]

    plain = tokens()
    forced = server.post("/tokenize", {"prompt": " memory", "add_special_tokens": False}).json()["tokens"][-1]
    text = server.post("/detokenize", {"tokens": [forced]}).json()["prompt"]
    assert tokens(logit_bias={str(forced): 100}) == [text] * 6 != plain
    first = server.post("/tokenize", {"prompt": plain[0], "add_special_tokens": False}).json()["tokens"]
    assert len(first) == 1 and tokens(logit_bias={str(first[0]): -100})[0] != plain[0]
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        server.openai().completions.create(model="tiny-v1", prompt="hi", max_tokens=2, logit_bias={"999999": 1})


def test_the_sdk_surfaces_the_400(server):
    with pytest.raises(openai.BadRequestError, match="invalid JSON schema"):
        server.openai().chat.completions.create(
            model="tiny-v1", messages=CHAT, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}})
