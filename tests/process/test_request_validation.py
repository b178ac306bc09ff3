"""Bad requests against a real `kvhold serve`: every one is refused with a 4xx before anything
is journaled, the keep-alive connection it came on keeps serving, and a restart after any of
them comes up; the HTTP API fuzzed from its own OpenAPI schema never answers 5xx."""
import http.client
import json
import signal

import pytest

from tests.process.test_serve_http import MAX_SEQ, Server

# (body, status, code, param): each of these once reached the sidecar or the SDK unchecked
BAD = [
    ({"prompt": "hi", "max_tokens": 2, "top_k": 2**31}, 400, "invalid_value", "top_k"),
    ({"prompt": "hi", "max_tokens": 2, "top_k": 2**64}, 400, "invalid_value", "top_k"),
    ({"prompt": [5, 2**64], "max_tokens": 2}, 400, "invalid_value", "prompt"),
    ({"prompt": [5, 2**31], "max_tokens": 2}, 400, "invalid_value", "prompt"),
    ({"prompt": "hi", "max_tokens": 2, "stop_token_ids": [2**64]}, 400, "invalid_value", "stop_token_ids.0"),
    ({"prompt": "hi", "max_tokens": 2, "stop_token_ids": list(range(9))}, 400, "invalid_value", "stop_token_ids"),
    (b'{"prompt": "\\ud800 lone", "max_tokens": 2}', 400, "invalid_value", "prompt"),
    (b'{"prompt": "hi", "user": "\\udfff"}', 400, "invalid_value", "user"),
    (b'{"prompt": "hi", "stream_options": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "invalid_json", None),
    (b'{"prompt": "hi", "logit_bias": ' + b'{"a":' * 200 + b"1" + b"}" * 200 + b"}", 400, "invalid_json", None),
]


def _send(conn: http.client.HTTPConnection, path: str, body, headers=None):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=raw, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    return r.status, json.loads(r.read()), r.getheader("connection")


@pytest.fixture
def journaled_server(tiny_model, runtime_root, tmp_path):
    journal = tmp_path / "journal"
    started = []

    def start():
        srv = Server(tiny_model, runtime_root, tmp_path / f"serve-{len(started)}.log", "--standbys", "0",
                     "--journal-dir", str(journal))
        started.append(srv)
        return srv
    yield start, journal
    for srv in started:
        srv.stop()


def test_bad_values_get_4xx_on_one_kept_alive_connection_and_a_restart_comes_up(journaled_server):
    start, journal = journaled_server
    srv = start()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    try:
        for body, status, code, param in BAD:
            got, answer, connection = _send(conn, "/v1/completions", body)
            err = answer["error"]
            assert (got, err["code"], err["param"]) == (status, code, param), (body[:80], err)
            assert err["message"] and connection != "close"
            # the same connection serves the next request
            got, answer, _ = _send(conn, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
            assert got == 200 and answer["usage"]["completion_tokens"] == 2
        huge = {"prompt": "x" * (10 << 20), "max_tokens": 2}
        got, answer, connection = _send(conn, "/v1/completions", huge)
        assert (got, answer["error"]["code"]) == (413, "request_too_large") and connection != "close"
        got, _, _ = _send(conn, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert got == 200
    finally:
        conn.close()
    assert not list(journal.glob("req-*.json"))        # nothing refused was journaled
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(60) == 0
    again = start()                                     # waits until healthy
    assert again.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
