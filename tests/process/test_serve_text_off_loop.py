"""Request text does not hold the HTTP server's event loop: while a large body is parsed,
templated and tokenized on the worker threads, /health answers and a stream started meanwhile
gets its tokens; text over the sidecar's --max-prompt-bytes is a 413 on every route that
tokenizes, before any of that work (kvhold.serving.text_work)."""
import json
import threading

from kvhold.testing.serve_process import http_client
import pytest

from tests.process.helpers import KEY, Server

pytestmark = pytest.mark.slow      # its own server and seconds of tokenization: `pytest -m slow`

LIMIT = 6 << 20
TEXT = "hello world " * ((LIMIT - 4096) // 12)       # seconds of tokenizing, just under the limit
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def big(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("rt")
    srv = Server(tiny_model, root, root / "serve.log", "--standbys", "0", "--max-prompt-bytes", str(LIMIT),
                 api_key=KEY)
    yield srv
    srv.stop()


@pytest.mark.parametrize("path, body", [
    ("/tokenize", {"prompt": TEXT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 4}),
])
def test_health_and_a_new_stream_answer_while_a_large_body_is_tokenized(big, path, body):
    order, lock = [], threading.Lock()
    sent = threading.Event()

    def note(what):
        with lock:
            order.append(what)

    def content():
        yield json.dumps(body).encode()
        sent.set()                     # every byte of the body is written

    def large():
        r = http_client().post(big.base + path, content=content(), headers=HEADERS, timeout=300)
        note(("large", r.status_code))

    worker = threading.Thread(target=large)
    worker.start()
    try:
        assert sent.wait(120)
        # asked once the large body is in: answered before the large one's answer, or the loop was held
        assert http_client().get(big.base + "/health", timeout=300).status_code == 200
        note("health")
        stream = {"prompt": "The sidecar", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
        with http_client().stream("POST", big.base + "/v1/completions", json=stream, headers=HEADERS, timeout=300) as r:
            assert r.status_code == 200
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
            note("stream token")
            assert json.loads(first[6:])["choices"][0]["text"] is not None
    finally:
        worker.join(300)
    # the chat's prompt is far longer than the context: a 400 that names it, once tokenized
    assert order == ["health", "stream token", ("large", 200 if path == "/tokenize" else 400)], order


@pytest.mark.parametrize("path, body", [
    ("/tokenize", {"prompt": "x" * (LIMIT + 1)}),
    ("/tokenize", {"messages": [{"role": "user", "content": "é" * (LIMIT // 2 + 1)}]}),   # over in UTF-8 bytes
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (LIMIT // 2)},
                                           {"role": "user", "content": "y" * (LIMIT // 2 + 1)}]}),
    ("/v1/completions", {"prompt": "x" * (LIMIT + 1), "max_tokens": 4}),
])
def test_text_over_the_prompt_limit_is_413_on_every_route(big, path, body):
    r = http_client().post(big.base + path, json=body, headers=HEADERS, timeout=300)
    assert r.status_code == 413, r.text[:300]
    assert r.json()["error"]["code"] == "prompt_too_large"
    assert "--max-prompt-bytes" in r.json()["error"]["message"]
    assert http_client().get(big.base + "/health", timeout=60).status_code == 200
