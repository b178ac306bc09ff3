"""The HTTP layer's error answers over a real uvicorn server on loopback, without a sidecar: a
bug in a backend is a 500 that keeps the keep-alive connection; a request the SDK cannot send
in one frame is a 413; a body over the limit is a 413 before it is read."""
import http.client
import json

import pytest

from kvhold.protocol.errors import ErrorCode, Overloaded, SidecarUnavailable
from kvhold.protocol.wire import WireError
from kvhold.serving.http_api import AppSettings, create_app
from kvhold.serving.metrics import SidecarMetrics
from kvhold.serving.openai_schema import MAX_BODY_BYTES
from tests.unit.helpers import uvicorn_in_a_thread


class _FailingBackend:
    """A backend whose submit raises what it is told to (the fault under test)."""
    resumes_streams = False

    def __init__(self):
        self.metrics = SidecarMetrics()
        self.error: Exception = RuntimeError("a bug")

    async def start(self):
        pass

    async def close(self):
        pass

    async def submit(self, request):
        raise self.error

    async def health(self):
        return True, {"status": "ok"}

    async def render_metrics(self):
        return self.metrics.render()


@pytest.fixture(scope="module")
def served():
    backend = _FailingBackend()
    app = create_app(AppSettings(endpoint="", model_dir=None, served_model_name="m", context_len=64), backend)
    with uvicorn_in_a_thread(app) as port:
        yield port, backend


def _post(conn, body: bytes):
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def test_a_bug_is_a_500_and_the_connection_keeps_serving(served):
    port, backend = served
    backend.error = RuntimeError("a bug")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    for _ in range(3):
        status, body = _post(conn, b'{"prompt": "hi"}')
        assert (status, body["error"]["message"]) == (500, "internal error: RuntimeError")
        conn.request("GET", "/v1/models")                       # the same connection
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["data"]
    conn.close()


def test_a_request_too_large_for_one_frame_is_a_413(served):
    port, backend = served
    backend.error = WireError(ErrorCode.TOO_LARGE, "generate encodes to 9000000 bytes")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    status, body = _post(conn, b'{"prompt": "hi"}')
    assert (status, body["error"]["code"]) == (413, "request_too_large")
    big = b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}'
    status, body = _post(conn, big)
    assert (status, body["error"]["code"]) == (413, "request_too_large")
    assert str(MAX_BODY_BYTES) in body["error"]["message"]
    conn.request("GET", "/v1/models")
    assert conn.getresponse().status == 200
    conn.close()


@pytest.mark.parametrize("error, status", [
    (SidecarUnavailable("the connection to the sidecar was lost before it answered"), 503),
    (Overloaded("too many requests waiting"), 429)])
def test_a_refusal_for_now_says_when_to_try_again(served, error, status):
    port, backend = served
    backend.error = error
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", "/v1/completions", body=b'{"prompt": "hi"}', headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    assert r.status == status and r.getheader("Retry-After") == "1"
    conn.close()
