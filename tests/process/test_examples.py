"""examples/fastapi_app.py (the async SDK inside one's own FastAPI app) against a real sidecar,
an executor SIGKILLed mid-stream included."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from kvhold.testing.serve_process import http_client
import pytest

from tests.process.helpers import free_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fastapi_app.py"


@pytest.fixture
def example_app(tiny_model, start_sidecar, runtime_root, tmp_path):
    sc = start_sidecar(["--model", str(tiny_model), "--max-seq-len", "256"])
    sc.wait_steady()
    port = free_port()
    env = dict(os.environ, KVHOLD_INSTANCE=sc.instance, KVHOLD_RUNTIME_DIR=str(runtime_root),
               PYTHONPATH=os.pathsep.join([str(EXAMPLE.parents[1]), os.environ.get("PYTHONPATH", "")]))
    log = open(tmp_path / "example.log", "wb")
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--port", str(port)], env=env,
                            stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, (tmp_path / "example.log").read_text()
        try:
            http_client().get(base + "/docs", timeout=2)
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    yield sc, base
    proc.terminate()
    proc.wait(10)
    log.close()


def test_example_app_generates_and_streams_across_a_crash(example_app):
    sc, base = example_app
    body = {"prompt": "Once upon a time", "max_tokens": 60, "temperature": 0.9, "seed": 4}
    with sc.new_client() as client:
        expected = client.generate(body["prompt"], **{k: v for k, v in body.items() if k != "prompt"}).result()
    full = http_client().post(base + "/generate", json=body, timeout=30).json()
    assert full["token_ids"] == expected.token_ids and full["text"] == expected.text

    active = sc.wait_steady()["pid"]
    ids = []
    with http_client().stream("POST", base + "/stream", json=body, timeout=30) as r:
        for line in r.iter_lines():
            item = json.loads(line)
            if "token_id" in item:
                ids.append(item["token_id"])
                if len(ids) == 10:
                    os.kill(active, signal.SIGKILL)
    assert ids == expected.token_ids and item["finish_reason"] == expected.finish_reason
    # The stream may have been served ahead of the kill: wait for the death to be seen, then a new active.
    assert sc.wait_for(lambda st: [e for e in sc.executors(st, "active") if e["pid"] != active], timeout=60)

    bad = http_client().post(base + "/generate", json={"prompt": "x", "temperature": -1}, timeout=10)
    assert bad.status_code == 400 and bad.json()["code"] == "INVALID_PARAMS"
