"""Tool calls (kvhold.serving.tool_calls): each family's parser reads the calls its models emit and
leaves text that is not a well-formed call as content; streamed, content goes out until a call's
marker could be starting, and is held from there; required's and named's outputs become calls;
tool_choice and tools are checked with 400s naming the field."""
import json

import pytest

from kvhold.serving.openai_schema import ApiError, ChatRequest
from kvhold.serving.tool_calls import (ToolCall, ToolMode, ToolOutput, call_id, parse_hermes, parse_llama3_json,
                                       parse_mistral, parser_for_template, required_schema)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_hermes_calls_and_the_content_before_them():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' \
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls = parse_hermes(text)
    assert content == "Let me look.\n"         # what comes before the first call, as streamed
    assert calls == [ToolCall("get_weather", '{"city": "Oslo"}'), ToolCall("get_time", "{}")]
    assert parse_hermes("no calls here") == ("no calls here", [])
    assert parse_hermes("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])


def test_llama3_json_calls_as_the_whole_output():
    assert parse_llama3_json('{"name": "get_weather", "parameters": {"city": "Oslo"}}') == \
        ("", [ToolCall("get_weather", '{"city": "Oslo"}')])
    two = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}'
    assert [c.name for c in parse_llama3_json(two)[1]] == ["a", "b"]
    assert parse_llama3_json("The answer is {1}") == ("The answer is {1}", [])
    assert parse_llama3_json('{"no": "name"}') == ('{"no": "name"}', [])


def test_mistral_calls_after_the_marker():
    content, calls = parse_mistral('Sure. [TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "UTC"}}]')
    assert content == "Sure. " and calls == [ToolCall("get_time", '{"tz": "UTC"}')]
    assert parse_mistral("[TOOL_CALLS] oops")[1] == []


def test_the_parser_follows_the_template():
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("<|python_tag|>{{ x }}") == "llama3_json"
    assert parser_for_template("{{ messages }}") == "hermes"


def stream(mode: ToolMode, pieces: list[str]):
    out = ToolOutput(mode)
    sent = [out.push(p) for p in pieces]
    rest, calls = out.finish()
    return "".join(sent), rest, calls, out


def test_streamed_content_stops_where_a_marker_could_start():
    pieces = ["Hello ", "there <tool", '_call>{"name": "get_time", ', '"arguments": {}}</tool_call>']
    sent, rest, calls, out = stream(ToolMode("auto", parser="hermes"), pieces)
    assert sent == "Hello there " and calls == [ToolCall("get_time", "{}")] and rest == ""
    assert out.finish_reason(calls, "stop") == "tool_calls"
    sent, rest, calls, _ = stream(ToolMode("auto", parser="hermes"), ["a <tool", "box> b"])
    assert sent + rest == "a <toolbox> b" and calls == []          # held, then not a marker
    sent, rest, calls, _ = stream(ToolMode("auto", parser="llama3_json"), [" ", "Plain", " text"])
    assert sent == " Plain text" and not calls
    sent, rest, calls, _ = stream(ToolMode("auto", parser="llama3_json"), ['{"name": "a", ', '"parameters": {}}'])
    assert sent == "" and calls == [ToolCall("a", "{}")]


def test_named_and_required_outputs_are_calls():
    _, _, calls, out = stream(ToolMode("named", "get_weather"), ['{"city":', '"Oslo"}'])
    assert calls == [ToolCall("get_weather", '{"city":"Oslo"}')] and out.finish_reason(calls, "stop") == "stop"
    _, _, calls, out = stream(ToolMode("required"), ['[{"name":"get_time","parameters":{}}]'])
    assert calls == [ToolCall("get_time", "{}")] and out.finish_reason(calls, "stop") == "tool_calls"
    assert out.finish_reason(calls, "length") == "length"


def test_call_ids_are_stable_per_response_and_index():
    assert call_id("chatcmpl-x-0", 1) == call_id("chatcmpl-x-0", 1) != call_id("chatcmpl-x-0", 2)


def chat(**kw) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def test_the_modes_of_a_chat_request():
    assert chat().tool_mode("hermes").mode == "none"
    assert chat(tools=[WEATHER]).tool_mode("mistral") == ToolMode("auto", parser="mistral")
    assert chat(tools=[WEATHER], tool_choice="required").tool_mode("hermes").mode == "required"
    named = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.tool_mode("hermes") == ToolMode("named", "get_time")
    assert named.structured() == ("json", json.dumps({"type": "object"}))
    required = chat(tools=[WEATHER, TIME], tool_choice="required")
    assert json.loads(required.structured()[1]) == required_schema([WEATHER, TIME])


@pytest.mark.parametrize("kw, param", [
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]), "tools"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
])
def test_bad_tools_are_400s_naming_the_field(kw, param):
    with pytest.raises(ApiError) as err:
        chat(**kw).refuse_unsupported()
    assert err.value.status == 400 and err.value.body()["error"]["param"] == param


def test_messages_reach_the_template_in_transformers_form():
    from kvhold.serving.openai_schema import ChatMessage

    m = ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}])
    assert m.for_template() == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]}
    assert ChatMessage(role="tool", content="12:00", tool_call_id="call_1").for_template()["tool_call_id"] == "call_1"


def test_required_keeps_each_tools_definitions_and_parallel_false_allows_one_call():
    loc = {"type": "function", "function": {"name": "where", "parameters": {
        "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
        "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}}}}}}
    req = chat(tools=[loc, WEATHER], tool_choice="required", parallel_tool_calls=False)
    req.refuse_unsupported()                      # compiles: the reference resolves
    schema = json.loads(req.structured()[1])
    assert schema["maxItems"] == 1 and "t0_Loc" in schema["$defs"]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"]["properties"]["loc"] == {"$ref": "#/$defs/t0_Loc"}
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    _, _, calls, _ = stream(ToolMode("auto", parser="hermes", parallel=False), [two])
    assert [c.name for c in calls] == ["a"]
    _, rest, calls, _ = stream(ToolMode("required"), ['[{"name":"get_ti'])      # cut short
    assert calls == [] and rest == '[{"name":"get_ti'
