"""Tool calls through `kvhold serve` as applications make them: the openai SDK with tool_choice
a named function, required and auto (streamed and not: the streamed calls accumulate to the
whole ones); LangChain's tool-calling loop (bind_tools, the call run, its result sent back as a
tool message, a final answer); and a real SIGKILL of the active executor in the middle of a
streamed call, which ends identical to an uninterrupted one."""
import json
from typing import Literal

import pytest

from tests.process.helpers import KEY, Server, wait_until

CITIES = ["Oslo", "Lima", "Pune"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": CITIES},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
CHAT = [{"role": "user", "content": "What is the weather in Oslo?"}]
LONG = ("--max-seq-len", "2048")        # the tools' JSON in the prompt is a few hundred tokens


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("rt")
    srv = Server(tiny_model, root, root / "serve.log", *LONG, api_key=KEY)
    yield srv
    srv.stop()


def prompt_ids(model_dir, messages, tools) -> list[int]:
    """The chat's prompt as the server renders and tokenizes it."""
    from tokenizers import Tokenizer

    from kvhold.serving.chat_template import ChatTemplate

    text = ChatTemplate.for_checkpoint(model_dir).render(messages, tools)
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def check_weather(args: str) -> None:
    d = json.loads(args)
    assert d["city"] in CITIES and 1 <= d["days"] <= 7, d


def accumulate(chunks) -> tuple[str, dict, str | None]:
    """(content, {index: [id, name, arguments]}, finish reason) of a streamed chat, as the SDK's
    users accumulate it."""
    content, calls, finish = "", {}, None
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, [None, "", ""])
            slot[0] = tc.id or slot[0]
            slot[1] += (tc.function.name or "") if tc.function else ""
            slot[2] += (tc.function.arguments or "") if tc.function else ""
        finish = c.choices[0].finish_reason or finish
    return content, calls, finish


def test_a_named_function_is_called_with_arguments_of_its_schema(server):
    client = server.openai()
    kw = dict(model="tiny-v1", messages=CHAT, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and msg.content is None
    [call] = msg.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    check_weather(call.function.arguments)
    content, calls, finish = accumulate(client.chat.completions.create(**kw, stream=True))
    assert content == "" and finish == "stop"
    assert [(n, a) for _, n, a in calls.values()] == [("get_weather", call.function.arguments)]


def test_required_calls_one_or_more_of_the_tools(server):
    client = server.openai()
    kw = dict(model="tiny-v1", messages=CHAT, tools=[WEATHER, TIME], tool_choice="required", max_tokens=120,
              temperature=0.7, seed=3)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls"
    calls = r.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
    for c in calls:
        if c.function.name == "get_weather":
            check_weather(c.function.arguments)
        else:
            assert json.loads(c.function.arguments)["zone"] in ("UTC", "CET")
    assert len({c.id for c in calls}) == len(calls)
    _, streamed, finish = accumulate(client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls"
    assert [(n, a) for _, n, a in streamed.values()] == [(c.function.name, c.function.arguments) for c in calls]


def test_auto_reads_the_calls_the_model_writes(server):
    """The model is made to write a hermes call (guided_regex: the tiny model writes none of its
    own accord), which tool_choice auto finds in the text; plain text stays content."""
    client = server.openai()
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    kw = dict(model="tiny-v1", messages=CHAT, tools=[WEATHER, TIME], max_tokens=80, temperature=0)
    r = client.chat.completions.create(**kw, extra_body={"guided_regex": "Checking\\. " + call.replace(
        "{", "\\{").replace("}", "\\}").replace(".", "\\.")})
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Checking. "
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [("get_time", {"zone": "UTC"})]
    content, calls, finish = accumulate(client.chat.completions.create(**kw, stream=True, extra_body={
        "guided_regex": "Checking\\. " + call.replace("{", "\\{").replace("}", "\\}").replace(".", "\\.")}))
    assert (content, finish) == ("Checking. ", "tool_calls") and len(calls) == 1
    plain = client.chat.completions.create(**kw, extra_body={"guided_choice": ["It is sunny."]})
    assert plain.choices[0].message.content == "It is sunny." and not plain.choices[0].message.tool_calls


def test_a_langchain_tool_calling_loop(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        return {"UTC": "12:00", "CET": "13:00"}[zone]

    llm = langchain_openai.ChatOpenAI(base_url=server.base + "/v1", api_key=KEY, model="tiny-v1", temperature=0,
                                      max_retries=0, timeout=120, max_tokens=80)
    asking = llm.bind_tools([get_time], tool_choice="get_time")
    history = [HumanMessage("What time is it in UTC?")]
    reply = asking.invoke(history)
    assert [c["name"] for c in reply.tool_calls] == ["get_time"], (reply, reply.invalid_tool_calls)
    history.append(reply)
    for c in reply.tool_calls:
        history.append(ToolMessage(get_time.invoke(c["args"]), tool_call_id=c["id"]))
    answer = llm.bind_tools([get_time], tool_choice="none").invoke(history)   # the result went back
    assert isinstance(answer.content, str) and not answer.tool_calls


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
])
def test_bad_tools_are_400s(server, body, param):
    r = server.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_streamed_call_continues_identically_across_an_executor_sigkill(tiny_model, tmp_path, runtime_root):
    armed, fired = tmp_path / "armed", tmp_path / "fired"
    args = {"type": "object", "properties": {"note": {"type": "string", "minLength": 200, "maxLength": 220}},
            "required": ["note"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "write_note", "parameters": args}}]
    token = max(prompt_ids(tiny_model, CHAT, tools))       # any token of the prompt
    # the executor SIGKILLs itself at the 25th step of the armed request: mid-arguments (about 90
    # tokens long), however fast it runs
    env = {"KVHOLD_FAULT": f"step:token={token}@25:kill", "KVHOLD_FAULT_IF": str(armed),
           "KVHOLD_FAULT_ONCE": str(fired)}
    srv = Server(tiny_model, runtime_root, tmp_path / "serve.log", *LONG, env=env)
    try:
        client = srv.openai(timeout=120)
        kw = dict(model="tiny-v1", messages=CHAT, tools=tools, max_tokens=200, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "write_note"}})
        reference = client.chat.completions.create(**kw).choices[0].message.tool_calls[0].function.arguments
        armed.touch()
        content, calls, finish = accumulate(client.chat.completions.create(**kw, stream=True))
        assert fired.exists()
        assert (content, finish) == ("", "stop")
        assert [(n, a) for _, n, a in calls.values()] == [("write_note", reference)]
        assert 200 <= len(json.loads(reference)["note"]) <= 220
        rec = wait_until(lambda: srv.sidecar_status()["recoveries"], 30, what="the recovery record")
        assert len(rec) == 1 and rec[0]["requests_lost"] == 0
    finally:
        srv.stop()
