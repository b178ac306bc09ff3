"""`kvhold router` end to end: HTTP (httpx, SSE and plain JSON) through a real router process to
two real sidecars registered in a real etcd. Requests spread over both sidecars, a sidecar
marked drain is avoided, and a sidecar whose whole process group is SIGKILLed mid-stream only
pauses its HTTP streams: they finish with the text of an uninterrupted run. Needs the etcd
binary: skipped with the install hint without it, unless KVHOLD_REQUIRE_ETCD=1."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from kvhold.testing.etcd_process import free_port
from kvhold.testing.sidecar_process import SidecarProcess, submit_requests
from kvhold.testing.serve_process import http_client
from tests.process.helpers import DATA

pytestmark = [pytest.mark.etcd,
              pytest.mark.skipif(os.environ.get("KVHOLD_SKIP_ETCD") == "1", reason="KVHOLD_SKIP_ETCD=1")]
TAG = os.getpid()      # instance names of this run only: another run on the machine has its own
SERVICE = "t-router-http"
FLAGS = ["--kv-pages", "256", "--max-seq-len", "512", "--max-batch-tokens", "64", "--max-batch", "16",
         "--standbys", "0", "--service", SERVICE, "--registry-ttl", "2"]
REQUESTS = [dict(prompt="The sidecar keeps the memory", max_tokens=40, temperature=0.0),
            dict(prompt="Once upon a time", max_tokens=40, temperature=0.8, seed=7),
            dict(prompt="One two three four", max_tokens=40, temperature=0.7, top_k=20, seed=11),
            dict(prompt="Never lose a stream", max_tokens=40, temperature=1.1, seed=5)]
LONG = [dict(r, max_tokens=400) for r in REQUESTS]     # still streaming when the sidecar dies


def reference_texts(sidecar, requests):
    with sidecar.new_client() as client:
        return [s.result().text for s in submit_requests(client, requests)]


@pytest.fixture(scope="module")
def cluster(etcd, tiny_model, tmp_path_factory):
    """Two registered sidecars, a `kvhold router` in front of them, and reference outputs."""
    logs = tmp_path_factory.mktemp("logs")
    flags = ["--model", str(tiny_model), *FLAGS, "--registry", etcd.url]
    sidecars = [SidecarProcess(flags, instance=f"rh{TAG}-{i}", log_path=logs / f"rh{i}.log") for i in range(2)]
    port = free_port()
    router = None
    try:
        for sc in sidecars:
            sc.start()
        router = subprocess.Popen(
            [sys.executable, "-m", "kvhold", "router", "--registry", etcd.url, "--service", SERVICE,
             "--port", str(port), "--model", str(tiny_model), "--max-seq-len", "512",
             "--log-level", "WARNING"], stdout=open(logs / "router.log", "wb"), stderr=subprocess.STDOUT)
        for sc in sidecars:
            sc.wait_steady(standbys=0)
        base = f"http://127.0.0.1:{port}"
        wait_health(base, router, lambda body: body["sidecars_serving"] == 2)
        refs = {"short": reference_texts(sidecars[0], REQUESTS), "long": reference_texts(sidecars[0], LONG)}
        wait_health(base, router, lambda body: body["in_flight"] == 0)    # the registry saw them end
        yield sidecars, base, refs
    finally:
        if router is not None:
            router.send_signal(signal.SIGTERM)
            try:
                router.wait(15)
            except subprocess.TimeoutExpired:
                router.kill()
        for sc in sidecars:
            sc.__exit__()


def wait_health(base, proc, predicate, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc is None or proc.poll() is None, f"router exited with {proc.returncode}"
        try:
            r = http_client().get(base + "/health", timeout=2)
            if predicate(r.json()):
                return r.json()
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError("router health condition not reached")


def metric(base, name) -> dict[str, float]:
    """{sidecar label: value} for one of the router's per-sidecar counters."""
    out = {}
    for line in http_client().get(base + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            label, value = line[len(name) + 1:].split("}")
            out[label.split('"')[1]] = float(value)
    return out


async def complete(http, base, request, stream, on_chunk=None) -> str:
    body = {"model": "tiny-v1", **request, "stream": stream}
    if not stream:
        r = await http.post(base + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    pieces = []
    async with http.stream("POST", base + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            pieces.append(chunk["choices"][0]["text"])
            if on_chunk is not None:
                on_chunk(len(pieces))
    return "".join(pieces)


def run_all(base, requests, streams, on_chunk=None) -> list[str]:
    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(complete(http, base, r, s, on_chunk and (lambda n, i=i: on_chunk(i, n)))
                                          for i, (r, s) in enumerate(zip(requests, streams))))
    return asyncio.run(main())


def test_requests_spread_over_both_sidecars(cluster):
    sidecars, base, refs = cluster
    before = metric(base, "kvhold_router_requests_routed_total")
    texts = run_all(base, REQUESTS + REQUESTS, [False, True] * len(REQUESTS))
    assert texts == refs["short"] + refs["short"]
    after = metric(base, "kvhold_router_requests_routed_total")
    served = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert sum(served.values()) == 2 * len(REQUESTS)
    assert all(any(sc.instance in k and n > 0 for k, n in served.items()) for sc in sidecars), served


def test_a_draining_sidecar_is_avoided(cluster, etcd, tmp_path):
    sidecars, base, refs = cluster
    drained = SidecarProcess(["--workload", "idle", *FLAGS, "--registry", etcd.url, "--health",
                              "replay:" + str(DATA / "health" / "gpu_lost.json"),
                              "--health-interval", "0.05"], instance=f"rh{TAG}-drain",
                             log_path=tmp_path / "drain.log")
    with drained:
        wait_health(base, None, lambda body: body["sidecars_registered"] == 3, timeout=10)
        texts = run_all(base, REQUESTS, [True, False] * (len(REQUESTS) // 2))
        assert http_client().get(base + "/health", timeout=5).json()["sidecars_serving"] == 2
    assert texts == refs["short"]
    assert not any(f"rh{TAG}-drain" in k for k in metric(base, "kvhold_router_requests_routed_total"))


def test_a_sigkilled_sidecar_s_http_streams_pause_and_finish_exactly(cluster):
    sidecars, base, refs = cluster                 # runs last: it kills a sidecar
    counts = [0] * len(LONG)
    killed = []

    def on_chunk(i, n):
        counts[i] = n
        if not killed and min(counts) >= 2:
            # the sidecar serving the most streams now: routing decides which one that is
            busiest = max(sidecars, key=lambda sc: sc.status()["requests"]["in_flight"])
            os.killpg(busiest.proc.pid, signal.SIGKILL)       # the sidecar and its executors
            killed.append(busiest)

    texts = run_all(base, LONG, [True] * len(LONG), on_chunk)
    assert killed, "every stream ended before the kill"
    victim = killed[0]
    assert texts == refs["long"]
    moves = metric(base, "kvhold_router_moves_total")
    assert sum(n for k, n in moves.items() if victim.instance in k) >= 1, moves
    body = wait_health(base, None, lambda b: b["sidecars_registered"] == 1, timeout=8)   # lease expired
    assert body["status"] == "ok"
    assert run_all(base, REQUESTS, [True] * len(REQUESTS)) == refs["short"]
    victim.proc.wait(5)
