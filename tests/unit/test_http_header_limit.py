"""The header block limit of the HTTP server (kvhold.serving.h11_guard) over a real uvicorn on
loopback: a header block over MAX_HEADER_BYTES is a 400 and the connection closed however it
arrives (in one read, complete; in pieces; pipelined after another request), and one within the
limit is served."""
import re
import socket

import pytest

from kvhold.serving.http_guards import MAX_HEADER_BYTES, HttpGuards
from tests.unit.helpers import uvicorn_in_a_thread


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def port():
    with uvicorn_in_a_thread(_app, **HttpGuards().uvicorn_options()) as p:
        yield p


def _request(size: int) -> bytes:
    """A GET whose header block (request line to the blank line) is `size` bytes."""
    head = b"GET /x HTTP/1.1\r\nHost: t\r\nX-Big: "
    return head + b"a" * (size - len(head) - 4) + b"\r\n\r\n"


def _exchange(port: int, *parts: bytes) -> bytes:
    """Send `parts` (one sendall each), then read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for part in parts:
            sock.sendall(part)
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while data := sock.recv(65536):
            reply += data
    return reply


def _statuses(reply: bytes) -> list[bytes]:
    return re.findall(rb"HTTP/1\.1 (\d{3}) ", reply)


@pytest.mark.parametrize("size", [MAX_HEADER_BYTES + 1, 70_000])
def test_a_complete_header_block_over_the_limit_in_one_read_is_400(port, size):
    assert len(_request(size)) == size
    reply = _exchange(port, _request(size))
    assert _statuses(reply) == [b"400"] and b"connection: close" in reply.lower(), reply[:200]


def test_a_header_block_over_the_limit_in_pieces_is_400(port):
    block = _request(40_000)
    assert _statuses(_exchange(port, block[:9000], block[9000:])) == [b"400"]


def test_a_header_block_at_the_limit_is_served(port):
    assert _statuses(_exchange(port, _request(MAX_HEADER_BYTES))) == [b"200"]


def test_a_pipelined_request_over_the_limit_is_400_after_the_first_is_served(port):
    reply = _exchange(port, _request(200) + _request(50_000))
    assert _statuses(reply) == [b"200", b"400"], reply[:400]
