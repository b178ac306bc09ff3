"""The HTTP server's guards: the API key also covers the API's description (/docs, /redoc,
/openapi.json), and slow clients (headers or body dribbled in) are cut off after a timeout
while everyone else is served."""
import asyncio
import concurrent.futures
import itertools
import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from kvhold.serving.http_api import AppSettings, create_app
from kvhold.testing.serve_process import http_client

pytestmark = pytest.mark.slow     # real restarts and timeouts: `pytest -m slow` (CI runs it)

KEY = "sk-guards"
DESCRIPTION = ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect")


def _get_all(api_key, headers):
    app = create_app(AppSettings(endpoint="ipc:///nonexistent", model_dir=None, served_model_name="m",
                                 context_len=64, api_key=api_key))

    async def run():
        transport = httpx.ASGITransport(app=app)   # the description needs no sidecar
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return {p: (await client.get(p, headers=headers)) for p in DESCRIPTION}
    return asyncio.run(run())


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_the_api_description_needs_the_key_when_one_is_set(headers):
    for path, r in _get_all(KEY, headers).items():
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path


def test_the_api_description_is_served_with_the_key_or_without_one():
    for answers in (_get_all(KEY, {"Authorization": f"Bearer {KEY}"}), _get_all(None, {})):
        assert all(r.status_code == 200 for r in answers.values()), answers
        assert "/v1/completions" in answers["/openapi.json"].json()["paths"]
        assert "swagger" in answers["/docs"].text.lower() and "redoc" in answers["/redoc"].text.lower()


HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 1.0, 1.5


@pytest.fixture(scope="module")
def guarded(tiny_model, tmp_path_factory):
    from tests.process.helpers import Server

    root = tmp_path_factory.mktemp("rt")
    srv = Server(tiny_model, root, root / "serve.log", "--standbys", "0",
                 "--http-header-timeout", str(HEADER_TIMEOUT_S), "--http-body-timeout", str(BODY_TIMEOUT_S),
                 api_key=KEY)
    yield srv
    srv.stop()


def _connect(srv) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=10)


def _dribble_until_closed(sock, chunks, every_s=0.25, limit_s=15.0):
    """Send `chunks` one by one, `every_s` apart, until the server closes; (seconds, reply)."""
    t0 = time.monotonic()
    reply = b""
    sock.settimeout(every_s)
    for chunk in itertools.cycle(chunks):
        assert time.monotonic() - t0 < limit_s, f"still open after {limit_s} s; got {reply!r}"
        try:
            sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - t0, reply
        try:
            data = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return time.monotonic() - t0, reply
        if not data:
            return time.monotonic() - t0, reply
        reply += data


def _served(srv):
    """Another client, meanwhile, gets a real completion."""
    r = http_client().post(srv.base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def test_slow_headers_are_cut_off_and_others_served(guarded):
    silent = _connect(guarded)                                  # connects, never says a word
    slow = _connect(guarded)
    slow.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        loris = pool.submit(_dribble_until_closed, slow, [b"X-Slow: ", b"a", b"b"])
        _served(guarded)
        took, reply = loris.result()
    assert HEADER_TIMEOUT_S - 0.1 <= took < HEADER_TIMEOUT_S + 5, took
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    silent.settimeout(10)
    t0 = time.monotonic()
    assert silent.recv(65536).startswith(b"HTTP/1.1 408 ") and silent.recv(65536) == b""
    assert time.monotonic() - t0 < HEADER_TIMEOUT_S + 5
    _served(guarded)


def test_a_kept_alive_connection_gets_the_header_deadline_for_each_request(guarded):
    sock = _connect(guarded)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(10)
    first = b""
    while b"\r\n\r\n" not in first:
        first += sock.recv(65536)
    head, _, body = first.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 200 ") and len(body) == length
    sock.sendall(b"GET /health HTTP/1.1\r\n")                 # the next request, slowly
    took, reply = _dribble_until_closed(sock, [b"X", b"-"])
    assert took < HEADER_TIMEOUT_S + 5 and reply.startswith(b"HTTP/1.1 408 "), (took, reply)


def test_a_slow_body_gets_408_and_others_are_served(guarded):
    body = json.dumps({"prompt": "hello", "max_tokens": 4}).encode()
    sock = _connect(guarded)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        loris = pool.submit(_dribble_until_closed, sock, [bytes([c]) for c in body[5:-1]])
        _served(guarded)
        took, reply = loris.result()
    assert BODY_TIMEOUT_S - 0.1 <= took < BODY_TIMEOUT_S + 5, took
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower(), reply
    assert json.loads(payload)["error"]["code"] == "request_timeout"
    _served(guarded)


def test_an_oversized_header_block_is_refused(guarded):
    sock = _connect(guarded)    # more than 16 KiB of header block, and not finished yet
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000)
    took, reply = _dribble_until_closed(sock, [b"a"])
    assert reply.startswith(b"HTTP/1.1 400 ") and took < HEADER_TIMEOUT_S, (took, reply)
    _served(guarded)


def test_timeouts_must_be_positive(tiny_model, tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvhold", "serve", "--model", str(tiny_model),
                          "--http-body-timeout", "0",
                          "--runtime-root", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--http-body-timeout must be > 0" in out.stderr, out.stderr
