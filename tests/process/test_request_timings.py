"""Queue and prefill times as vLLM reports them (vllm:request_queue_time_seconds,
vllm:request_prefill_time_seconds), from the journal's marks in a real sidecar: admission
(sidecar) -> the request's first step (executor) -> its first token committed (executor).
With one sequence per step, a second request waits in the queue for the whole of the first.
Then the same through `kvhold serve --sidecar-endpoint`'s /metrics, which promtool accepts."""
import os
import shutil
import subprocess
import time

import httpx
import pytest

from kvhold.protocol.naming import InstancePaths
from kvhold.testing.serve_process import http_client
from tests.process.helpers import FLAGS, ServeProcess, wait_until

TOKENS = 40


def test_queue_time_holds_the_wait_for_a_step_and_reaches_metrics(tiny_model, start_sidecar, runtime_root,
                                                                 tmp_path):
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--max-batch", "1", "--standbys", "0"])
    sc.wait_steady(standbys=0)
    with sc.new_client(timeout=60) as client:
        a = client.generate(prompt="The sidecar keeps the memory", max_tokens=TOKENS, temperature=0.0,
                            ignore_eos=True)
        sent_b = time.monotonic()
        b = client.generate(prompt="Once upon a time", max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
        ra, rb = a.result(), b.result()
        b_done = time.monotonic()
    for r in (ra, rb):
        assert r.queue_s is not None and r.prefill_s is not None and r.queue_s >= 0 and r.prefill_s >= 0
    # b is first scheduled after a finished: its queue time covers a's queue and prefill (and a's
    # decode, which no clock here bounds from below)
    assert rb.queue_s > ra.queue_s + ra.prefill_s
    # both of b's marks fall between this client's sending b and its receiving b's last token
    assert rb.queue_s + rb.prefill_s < b_done - sent_b

    srv = ServeProcess(["--sidecar-endpoint", InstancePaths.for_instance(sc.instance, runtime_root).client_endpoint],
                       runtime_root, log_path=tmp_path / "serve.log").spawn()
    base, proc = srv.base, srv.proc
    try:
        wait_until(lambda: proc.poll() is None and _healthy(base), 60, 0.1, what="the HTTP server")
        r = http_client().post(base + "/v1/completions", json={"model": tiny_model.name, "prompt": "Hello",
                                                      "max_tokens": 5, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        text = http_client().get(base + "/metrics", timeout=5).text
    finally:
        srv.stop()
    name = f'{{model_name="{tiny_model.name}"}}'
    assert _value(text, "kvhold_request_queue_time_seconds_count" + name) == 1
    assert _value(text, "kvhold_request_prefill_time_seconds_count" + name) == 1
    assert _value(text, "kvhold_request_prefill_time_seconds_sum" + name) > 0
    if shutil.which("promtool") is None:     # .ci/run installs it and sets KVHOLD_REQUIRE_PROMTOOL=1
        if os.environ.get("KVHOLD_REQUIRE_PROMTOOL") == "1":
            pytest.fail("promtool is not installed (Debian's prometheus package)")
        pytest.skip("promtool (Debian's prometheus package) is not installed")
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def _healthy(base):
    try:
        return http_client().get(base + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _value(text, series):
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(series + " "))
