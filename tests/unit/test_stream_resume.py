"""The resume route's input and its replay, without processes: event ids are parsed strictly
(a bad Last-Event-ID or request id is a 400 naming it, nothing to resume a 404, never a 500),
and a stream taken up again sends exactly the events after the one named, the same chunks
the original stream sent (completions and chat, stop strings, usage)."""
import asyncio
import json

import httpx
import pytest

from kvhold.client.client import GenerationResult, TokenEvent
from kvhold.protocol.errors import NotFound
from kvhold.serving.http_api import AppSettings, create_app
from kvhold.serving.metrics import SidecarMetrics
from kvhold.serving.openai_schema import ApiError
from kvhold.serving.stream_resume import parse_last_event_id, parse_request_id

TEXTS = ["Once", " up", "", "on", " a", " ti", "me", " END", " after"]


@pytest.mark.parametrize("text,want", [("abc-0", 0), ("abc-17", 17), (" abc-5 ", 5), (None, -1)])
def test_good_event_ids(text, want):
    assert parse_last_event_id(text, 0xabc) == want


@pytest.mark.parametrize("text", ["", "abc", "abc-", "-3", "abc-x", "abc-01", "abc--1", "ABC-1", "abc-1-2",
                                  "abc-99999999999", "0x abc-1", "abc-1\x00", "g12-1", "1" * 17 + "-1"])
def test_bad_event_ids_are_400_naming_the_header(text):
    with pytest.raises(ApiError) as err:
        parse_last_event_id(text, 0xabc)
    assert err.value.status == 400 and err.value.param == "Last-Event-ID"
    assert err.value.code == "invalid_last_event_id"


def test_an_event_id_of_another_request_is_400():
    with pytest.raises(ApiError, match="names request abd, not abc") as err:
        parse_last_event_id("abd-3", 0xabc)
    assert err.value.status == 400


@pytest.mark.parametrize("text,want", [("abc", 0xabc), ("cmpl-abc", 0xabc), ("chatcmpl-10000000001", 0x10000000001)])
def test_request_ids(text, want):
    assert parse_request_id(text) == want


@pytest.mark.parametrize("text", ["", "xyz", "cmpl-", "abc-1", "ABC", "cmpl_abc", "1" * 17])
def test_bad_request_ids_are_400(text):
    with pytest.raises(ApiError) as err:
        parse_request_id(text)
    assert err.value.status == 400 and err.value.code == "invalid_request_id"


# ---------------------------------------------------------------- the route, over a stand-in backend
class FakeStream:
    def __init__(self, request_id, texts, prompt_tokens=4):
        self.request_id, self.prompt_tokens, self.texts = request_id, prompt_tokens, texts
        self.finished, self.i = False, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.i >= len(self.texts):
            raise StopAsyncIteration
        self.i += 1
        return TokenEvent(self.i - 1, self.i, self.texts[self.i - 1])

    async def result(self):
        self.finished = True
        return GenerationResult(self.request_id, list(range(len(self.texts))), "".join(self.texts), "length",
                                self.prompt_tokens, len(self.texts))

    async def cancel(self):
        self.finished = True


class FakeBackend:
    resumes_streams = True

    def __init__(self, attach_error=None):
        self.metrics = SidecarMetrics()
        self.attach_error = attach_error
        self.next_id = 0x10000000001

    async def start(self):
        pass

    async def close(self):
        pass

    async def submit(self, request):
        self.next_id += 1
        return FakeStream(self.next_id, TEXTS)

    async def attach(self, request_id):
        if self.attach_error is not None:
            raise self.attach_error
        return FakeStream(request_id, TEXTS, prompt_tokens=0)


def _app(tmp_path, backend):
    return create_app(AppSettings(endpoint="ipc:///nonexistent", model_dir=None, served_model_name="m",
                                  context_len=64, stream_dir=tmp_path / "streams"), backend=backend)


def _run(app, calls):
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [await call(client) for call in calls]
    return asyncio.run(run())


def _events(text: str) -> list[tuple[str | None, str]]:
    out = []
    for block in text.split("\n\n")[:-1]:
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines.get("id"), lines["data"]))
    return out


def _post(body):
    return lambda c: c.post("/v1/completions", json=body)


def _resume(rid, last=None):
    rid = f"{rid:x}" if isinstance(rid, int) else rid
    return lambda c: c.get(f"/v1/streams/{rid}", headers={"Last-Event-ID": last} if last else {})


@pytest.mark.parametrize("body", [
    {"prompt": "hi", "max_tokens": 9, "stream": True},
    {"prompt": "hi", "max_tokens": 9, "stream": True, "stop": [" END"],
     "stream_options": {"include_usage": True}},
])
def test_a_resumed_completion_stream_is_the_rest_of_the_original(tmp_path, body):
    backend = FakeBackend()
    app = _app(tmp_path, backend)
    # the original stream ends normally and removes its record: write it back as a server that
    # died mid-stream leaves it
    records = app.state.service.records
    original = _run(app, [_post(body)])[0]
    rid = backend.next_id
    events = _events(original.text)
    assert events[-1] == (None, "[DONE]") and all(i.startswith(f"{rid:x}-") for i, _ in events[:-1])
    numbers = [int(i.rsplit("-", 1)[1]) for i, _ in events[:-1]]
    assert numbers == sorted(set(numbers))               # strictly increasing
    assert records.read(rid) is None
    record = {"kind": "completion", "stop": body.get("stop", []), "include_usage": "stream_options" in body,
              "created": json.loads(events[0][1])["created"], "prompt_tokens": 4}
    for k in range(len(events) - 1):
        records.write(rid, record)            # a resumed stream that ends removes it again
        rest = _run(app, [_resume(rid, events[k][0])])[0]
        assert rest.status_code == 200, rest.text
        assert _events(rest.text) == events[k + 1:]
    records.write(rid, record)
    whole = _run(app, [_resume(rid)])[0]
    assert _events(whole.text) == events


def test_a_resumed_chat_stream_is_the_rest_of_the_original(tmp_path):
    backend = FakeBackend()
    app = _app(tmp_path, backend)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "stream": True}
    app.state.service.text.tokenizer = type("T", (), {"encode_batch_fast": lambda self, texts, add_special_tokens: [
        type("E", (), {"ids": [1, 2, 3]})()]})()
    original = _run(app, [lambda c: c.post("/v1/chat/completions", json=body)])[0]
    events = _events(original.text)
    rid = backend.next_id
    assert events[0][0] == f"{rid:x}-0" and '"role":"assistant"' in events[0][1]
    record = {"kind": "chat", "stop": [], "include_usage": False,
              "created": json.loads(events[0][1])["created"], "prompt_tokens": 3}
    app.state.service.records.write(rid, record)
    rest = _run(app, [_resume(f"chatcmpl-{rid:x}", events[2][0])])[0]
    assert _events(rest.text) == events[3:]


def test_bad_resumes_are_4xx_with_a_clear_message(tmp_path):
    app = _app(tmp_path, FakeBackend(attach_error=NotFound("request 0xabc was cancelled: no client claimed it")))
    app.state.service.records.write(0xabc, {"kind": "completion", "stop": [], "include_usage": False,
                                            "created": 1, "prompt_tokens": 2})
    answers = _run(app, [_resume("xyz"), _resume("abc", "garbage"), _resume("abc", "abd-1"),
                         _resume("abd", "abd-1"), _resume("abc", "abc-1")])
    codes = [(r.status_code, r.json()["error"]["code"]) for r in answers]
    assert codes == [(400, "invalid_request_id"), (400, "invalid_last_event_id"), (400, "invalid_last_event_id"),
                     (404, "stream_not_found"), (404, "stream_not_found")]
    assert "Last-Event-ID 'garbage'" in answers[1].json()["error"]["message"]
    assert "cancelled: no client claimed it" in answers[4].json()["error"]["message"]
    assert app.state.service.records.read(0xabc) is None      # the sidecar has it no longer


def test_a_backend_that_cannot_resume_says_so(tmp_path):
    backend = FakeBackend()
    backend.resumes_streams = False       # a backend that does not resume (kvhold router's)
    app = _app(tmp_path, backend)
    r = _run(app, [_resume("abc", "abc-1"), _post({"prompt": "hi", "max_tokens": 3, "stream": True})])
    assert r[0].status_code == 501 and r[0].json()["error"]["code"] == "resume_unsupported"
    assert all(i is None for i, _ in _events(r[1].text))       # no ids: nothing could resume them


def test_the_resume_route_is_in_the_openapi_schema(tmp_path):
    schema = _run(_app(tmp_path, FakeBackend()), [lambda c: c.get("/openapi.json")])[0].json()
    route = schema["paths"]["/v1/streams/{request_id}"]["get"]
    assert any(p["name"] == "Last-Event-ID" and p["in"] == "header" for p in route["parameters"])
    assert "text/event-stream" in route["responses"]["200"]["content"]
