"""The resume route's input and its replay, without processes: event ids are parsed strictly
(a bad Last-Event-ID or stream id is a 400 naming it, nothing to resume a 404, never a 500),
a stream taken up again sends exactly the events after the one named, the same chunks
the original stream sent (completions and chat, stop strings, usage), stream ids are random,
and a stream is resumed only with the credential that started it."""
import asyncio
import json

import httpx
import pytest

from kvhold.client.client import GenerationResult, TokenEvent
from kvhold.protocol.errors import NotFound
from kvhold.serving.http_api import AppSettings, create_app
from kvhold.serving.metrics import SidecarMetrics
from kvhold.serving.openai_schema import ApiError
from kvhold.serving.stream_resume import owner_of, parse_last_event_id, parse_stream_id

TEXTS = ["Once", " up", "", "on", " a", " ti", "me", " END", " after"]
SID = "0123456789abcdef" * 2               # a stream id: 128 bits in hex
OTHER = "f" * 32
KEY = {"Authorization": "Bearer sk-one"}


@pytest.mark.parametrize("text,want", [(f"{SID}-0", 0), (f"{SID}-17", 17), (f" {SID}-5 ", 5), (None, -1)])
def test_good_event_ids(text, want):
    assert parse_last_event_id(text, SID) == want


@pytest.mark.parametrize("text", ["", SID, f"{SID}-", "-3", f"{SID}-x", f"{SID}-01", f"{SID}--1",
                                  f"{SID.upper()}-1", f"{SID}-1-2", f"{SID}-99999999999", f"0x {SID}-1",
                                  f"{SID}-1\x00", "abc-1", f"{SID}0-1", f"{SID[:-1]}g-1"])
def test_bad_event_ids_are_400_naming_the_header(text):
    with pytest.raises(ApiError) as err:
        parse_last_event_id(text, SID)
    assert err.value.status == 400 and err.value.param == "Last-Event-ID"
    assert err.value.code == "invalid_last_event_id"


def test_an_event_id_of_another_stream_is_400():
    with pytest.raises(ApiError, match=f"names stream {OTHER}, not {SID}") as err:
        parse_last_event_id(f"{OTHER}-3", SID)
    assert err.value.status == 400


@pytest.mark.parametrize("text", [SID, f"cmpl-{SID}", f"chatcmpl-{SID}"])
def test_stream_ids(text):
    assert parse_stream_id(text) == SID


@pytest.mark.parametrize("text", ["", "xyz", "cmpl-", f"{SID}-1", SID.upper(), f"cmpl_{SID}", SID + "0", "abc",
                                  "10000000001"])
def test_bad_stream_ids_are_400(text):
    with pytest.raises(ApiError) as err:
        parse_stream_id(text)
    assert err.value.status == 400 and err.value.code == "invalid_stream_id"


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
        self.attached = []

    async def start(self):
        pass

    async def close(self):
        pass

    async def submit(self, request):
        self.next_id += 1
        return FakeStream(self.next_id, TEXTS)

    async def attach(self, request_id):
        self.attached.append(request_id)
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


def _resume(sid, last=None, headers=None):
    return lambda c: c.get(f"/v1/streams/{sid}", headers={**({"Last-Event-ID": last} if last else {}),
                                                          **(headers or {})})


def _record(kind, rid, created, prompt_tokens, stop=(), include_usage=False, owner=None):
    return {"request_id": rid, "owner": owner or owner_of(None), "kind": kind, "stop": list(stop),
            "include_usage": include_usage, "created": created, "prompt_tokens": prompt_tokens}


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
    sid = events[0][0].split("-")[0]
    assert events[-1] == (None, "[DONE]") and all(i.startswith(f"{sid}-") for i, _ in events[:-1])
    assert json.loads(events[0][1])["id"] == f"cmpl-{sid}"
    numbers = [int(i.rsplit("-", 1)[1]) for i, _ in events[:-1]]
    assert numbers == sorted(set(numbers))               # strictly increasing
    assert records.read(sid, owner_of(None)) is None
    record = _record("completion", rid, json.loads(events[0][1])["created"], 4, body.get("stop", []),
                     "stream_options" in body)
    for k in range(len(events) - 1):
        records.write(sid, record)            # a resumed stream that ends removes it again
        rest = _run(app, [_resume(sid, events[k][0])])[0]
        assert rest.status_code == 200, rest.text
        assert _events(rest.text) == events[k + 1:]
    records.write(sid, record)
    whole = _run(app, [_resume(sid)])[0]
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
    sid = events[0][0].split("-")[0]
    assert events[0][0] == f"{sid}-0" and '"role":"assistant"' in events[0][1]
    app.state.service.records.write(sid, _record("chat", rid, json.loads(events[0][1])["created"], 3))
    rest = _run(app, [_resume(f"chatcmpl-{sid}", events[2][0])])[0]
    assert _events(rest.text) == events[3:]


def test_bad_resumes_are_4xx_with_a_clear_message(tmp_path):
    app = _app(tmp_path, FakeBackend(attach_error=NotFound("request 0xabc was cancelled: no client claimed it")))
    app.state.service.records.write(SID, _record("completion", 0xabc, 1, 2))
    answers = _run(app, [_resume("xyz"), _resume("abc"), _resume(SID, "garbage"), _resume(SID, f"{OTHER}-1"),
                         _resume(OTHER, f"{OTHER}-1"), _resume(SID, f"{SID}-1")])
    codes = [(r.status_code, r.json()["error"]["code"]) for r in answers]
    assert codes == [(400, "invalid_stream_id"), (400, "invalid_stream_id"), (400, "invalid_last_event_id"),
                     (400, "invalid_last_event_id"), (404, "stream_not_found"), (404, "stream_not_found")]
    assert "Last-Event-ID 'garbage'" in answers[2].json()["error"]["message"]
    assert "cancelled: no client claimed it" in answers[5].json()["error"]["message"]
    assert app.state.service.records.read(SID, owner_of(None)) is None      # the sidecar has it no longer


def test_stream_ids_are_random_and_not_the_request_ids(tmp_path):
    backend = FakeBackend()
    app = _app(tmp_path, backend)
    body = {"prompt": "hi", "max_tokens": 9, "stream": True}
    answers = _run(app, [_post(body), _post(body), _post(dict(body, stream=False))])
    sids = [_events(r.text)[0][0].split("-")[0] for r in answers[:2]] + [answers[2].json()["id"][len("cmpl-"):]]
    assert len(set(sids)) == 3 and all(len(s) == 32 for s in sids)
    assert not any(f"{rid:x}" in s for s in sids for rid in range(backend.next_id - 2, backend.next_id + 1))


def test_a_stream_is_resumed_only_with_the_credential_that_started_it(tmp_path):
    backend = FakeBackend()
    app = _app(tmp_path, backend)
    original = _run(app, [lambda c: c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 9, "stream": True},
                                           headers=KEY)])[0]
    events = _events(original.text)
    sid = events[0][0].split("-")[0]
    record = _record("completion", backend.next_id, json.loads(events[0][1])["created"], 4, owner=owner_of("Bearer sk-one"))
    app.state.service.records.write(sid, record)       # as a server that died mid-stream leaves it
    attached = backend.attached = []
    strangers = _run(app, [_resume(sid, events[2][0]), _resume(sid, events[2][0], {"Authorization": "Bearer sk-two"}),
                           _resume(sid, None, {"Authorization": "sk-one"})])
    assert [(r.status_code, r.json()["error"]["code"]) for r in strangers] == [(404, "stream_not_found")] * 3
    assert attached == []                               # the sidecar was not asked: the stream is untouched
    owner = _run(app, [_resume(sid, events[2][0], {"Authorization": "bearer  sk-one"})])[0]
    assert owner.status_code == 200 and _events(owner.text) == events[3:]
    assert attached == [backend.next_id]


def test_a_backend_that_cannot_resume_says_so(tmp_path):
    backend = FakeBackend()
    backend.resumes_streams = False       # a backend that does not resume (kvhold router's)
    app = _app(tmp_path, backend)
    r = _run(app, [_resume(SID, f"{SID}-1"), _post({"prompt": "hi", "max_tokens": 3, "stream": True})])
    assert r[0].status_code == 501 and r[0].json()["error"]["code"] == "resume_unsupported"
    assert all(i is None for i, _ in _events(r[1].text))       # no ids: nothing could resume them


def test_the_resume_route_is_in_the_openapi_schema(tmp_path):
    schema = _run(_app(tmp_path, FakeBackend()), [lambda c: c.get("/openapi.json")])[0].json()
    route = schema["paths"]["/v1/streams/{stream_id}"]["get"]
    assert any(p["name"] == "Last-Event-ID" and p["in"] == "header" for p in route["parameters"])
    assert "text/event-stream" in route["responses"]["200"]["content"]
