"""`kvhold serve --sidecar-endpoint`: the supervised HTTP API in front of a sidecar that runs
already (`kvhold sidecar`). A completion works; the HTTP server, SIGKILLed, is restarted and the
sidecar with its executor is untouched (same pids); a SIGTERM stops serve (exit 0) and leaves
the sidecar running and serving."""
import os
import signal
import subprocess
import sys

import httpx
import pytest

from kvhold.protocol.naming import InstancePaths
from kvhold.testing.serve_process import http_client
from tests.process.helpers import FLAGS, ServeProcess, free_port, http_child, wait_until

COMPLETION = {"model": None, "prompt": "The sidecar keeps the memory", "max_tokens": 12, "temperature": 0,
              "ignore_eos": True}


def healthy(base):
    try:
        return http_client().get(base + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def complete(base, name):
    r = http_client().post(base + "/v1/completions", json={**COMPLETION, "model": name}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 12 and body["choices"][0]["text"]
    return body["choices"][0]["text"]


@pytest.mark.slow      # real kills and a restart: `pytest -m slow`
def test_serve_in_front_of_a_running_sidecar(tiny_model, start_sidecar, runtime_root, tmp_path):
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--standbys", "0", "--lease-ms", "3000"])
    active = sc.wait_steady(standbys=0)
    endpoint = InstancePaths.for_instance(sc.instance, runtime_root).client_endpoint
    srv = ServeProcess(["--sidecar-endpoint", endpoint, "--log-level", "INFO"], runtime_root,
                       log_path=tmp_path / "serve.log").spawn()
    base, proc = srv.base, srv.proc
    try:
        wait_until(lambda: proc.poll() is None and healthy(base), 60, 0.1, what="the HTTP server to serve")
        models = http_client().get(base + "/v1/models", timeout=5).json()["data"]
        name = models[0]["id"]
        assert name == tiny_model.name and models[0]["max_model_len"] == 512   # the sidecar's --max-seq-len
        first = complete(base, name)

        old = http_child(srv)
        os.kill(old, signal.SIGKILL)
        new = wait_until(lambda: (pid := http_child(srv)) != old and pid, 30, 0.05, what="a new HTTP server")
        wait_until(lambda: healthy(base), 60, 0.1, what="the restarted HTTP server to serve")
        assert complete(base, name) == first                       # greedy: the same text again
        status = sc.status()
        assert sc.proc.poll() is None and status["pid"] == sc.proc.pid
        assert [e["pid"] for e in sc.executors(status, "active")] == [active["pid"]]
        assert "restarting it" in (tmp_path / "serve.log").read_text()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not os.path.exists(f"/proc/{new}")                 # reaped by serve before it exited
        status = sc.status()                                       # the sidecar goes on, serving
        assert sc.proc.poll() is None and status["pid"] == sc.proc.pid
        assert [e["pid"] for e in sc.executors(status, "active")] == [active["pid"]]
        with sc.new_client() as client:
            assert len(client.generate(prompt="Hello", max_tokens=5, temperature=0.0).result().token_ids) == 5
    finally:
        srv.stop()


def test_a_sidecar_that_does_not_answer_stops_serve_with_the_reason(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvhold", "serve", "--sidecar-endpoint",
                        f"ipc://{tmp_path}/nobody.sock", "--port", str(free_port()), "--start-timeout", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "did not answer within 1 s" in r.stderr


def test_sidecar_flags_are_refused_at_the_command_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvhold", "serve", "--sidecar-endpoint", f"ipc://{tmp_path}/x.sock",
                        "--standbys", "2"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--standbys: a flag of the sidecar that kvhold serve starts" in r.stderr


@pytest.mark.slow      # a sidecar and two servers: `pytest -m slow`
def test_a_second_serve_in_front_of_the_same_sidecar_is_refused_with_the_reason(tiny_model, start_sidecar,
                                                                                 runtime_root, tmp_path):
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--standbys", "0", "--lease-ms", "3000"])
    sc.wait_steady(standbys=0)
    endpoint = InstancePaths.for_instance(sc.instance, runtime_root).client_endpoint
    first = ServeProcess(["--sidecar-endpoint", endpoint], runtime_root, log_path=tmp_path / "first.log").spawn()
    try:
        wait_until(lambda: first.proc.poll() is None and healthy(first.base), 60, 0.1, what="the first HTTP server")
        name = http_client().get(first.base + "/v1/models", timeout=5).json()["data"][0]["id"]
        r = subprocess.run([sys.executable, "-m", "kvhold", "serve", "--sidecar-endpoint", endpoint,
                            "--port", str(free_port()), "--runtime-root", str(runtime_root)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1, r.stderr[-2000:]
        assert "another kvhold serve is serving in front of the sidecar" in r.stderr, r.stderr[-2000:]
        assert healthy(first.base) and complete(first.base, name)          # the first goes on
        assert first.stop() == 0
        # once the first is gone, another serves
        second = ServeProcess(["--sidecar-endpoint", endpoint], runtime_root, log_path=tmp_path / "second.log").spawn()
        try:
            wait_until(lambda: second.proc.poll() is None and healthy(second.base), 60, 0.1,
                       what="the second HTTP server")
            assert complete(second.base, name)
        finally:
            second.stop()
    finally:
        first.stop()
