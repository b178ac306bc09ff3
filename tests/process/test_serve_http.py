"""`kvhold serve` end to end: real HTTP clients (openai, httpx) against a real server on loopback.

One server (sidecar + active + standby executors + HTTP) is shared by the module; a second,
without a standby, checks /health during a failover and the SIGTERM drain.
"""
import asyncio
import json
import os
import re
import signal
import time

import httpx
from kvhold.testing.serve_process import http_client
import openai
import pytest

from tests.process.helpers import KEY, MAX_SEQ, Server, completion, unique_prompt_token, wait_stopped, wait_until

CROSSING = dict(prompt="Never lose a stream", max_tokens=80, temperature=0.9, seed=11)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """The module's server: as the shared one, and its executors stop themselves at the 6th step of
    the CROSSING prompt while `server.armed` exists (once), so a kill lands mid-stream whatever
    the client's pace; a lease that outlasts the stop keeps the stopped executor from a hang fence."""
    root = tmp_path_factory.mktemp("rt")
    armed = root / "armed"
    token = unique_prompt_token(tiny_model, [CROSSING], 0)
    env = {"KVHOLD_FAULT": f"step:token={token}@6:stop", "KVHOLD_FAULT_IF": str(armed),
           "KVHOLD_FAULT_ONCE": str(root / "fired")}
    srv = Server(tiny_model, root, root / "serve.log", "--lease-ms", "30000", api_key=KEY, env=env)
    srv.armed = armed
    yield srv
    srv.stop()


def test_openai_package_completions_and_chat(server):
    client = server.openai()
    assert [m.id for m in client.models.list().data] == ["tiny-v1"]
    full = client.completions.create(model="tiny-v1", prompt="Once upon a time", max_tokens=20,
                                     temperature=0.8, seed=7)
    assert full.choices[0].finish_reason in ("length", "stop")
    assert full.usage.completion_tokens <= 20 and full.usage.prompt_tokens > 0
    chunks = client.completions.create(model="tiny-v1", prompt="Once upon a time", max_tokens=20,
                                       temperature=0.8, seed=7, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model="tiny-v1", messages=messages, max_tokens=12, seed=3)
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    stream = client.chat.completions.create(model="tiny-v1", messages=messages, max_tokens=12, seed=3,
                                            stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    for c in stream:
        if c.usage:
            usage = c.usage
        parts += [ch.delta.content or "" for ch in c.choices]
    assert "".join(parts) == chat.choices[0].message.content
    assert usage.completion_tokens == chat.usage.completion_tokens


def test_httpx_sse_framing_and_stop_strings(server):
    body = {"prompt": "The sidecar keeps the memory", "max_tokens": 30, "temperature": 0, "stream": True}
    with http_client().stream("POST", server.base + "/v1/completions", json=body, headers=server.headers,
                      timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    # each event but [DONE]: its id (request id hex - tokens covered: kvhold.serving.stream_resume), its data
    heads = [e.split("\n", 1) for e in events[:-2]]
    assert all(len(h) == 2 and re.fullmatch(r"id: [0-9a-f]+-[0-9]+", h[0]) for h in heads), heads
    datas = [h[1] for h in heads]
    texts = [json.loads(e[len("data: "):])["choices"][0]["text"] for e in datas]
    full = "".join(texts)
    assert full and all(e.startswith("data: ") for e in datas)
    stop = full.strip()[3:5]
    cut = server.post("/v1/completions", {**body, "stream": False, "stop": [stop]}).json()
    assert cut["choices"][0]["text"] == full[:full.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


BAD = [
    (b"{not json", 400, "invalid_json", None),
    (b"[1, 2]", 400, "invalid_json", None),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model_not_found", "model"),
    ({"model": "tiny-v1"}, 400, "missing_required_parameter", "prompt"),
    ({"prompt": "hi", "max_tokens": MAX_SEQ + 1}, 400, "context_length_exceeded", "max_tokens"),
    ({"prompt": "one two three " * 40, "max_tokens": 400}, 400, "context_length_exceeded", "max_tokens"),
    ({"prompt": [5] * MAX_SEQ}, 400, "context_length_exceeded", "prompt"),
    ({"prompt": "hi", "temperature": -0.5}, 400, "invalid_value", "temperature"),
    ({"prompt": "hi", "n": 65}, 400, "invalid_value", "n"),
    ({"prompt": "hi", "logprobs": 21}, 400, "invalid_value", None),      # above --max-logprobs
    ({"prompt": "hi", "top_p": 0}, 400, "invalid_value", "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
]


@pytest.mark.parametrize("body,status,code,param", BAD)
def test_bad_completion_requests(server, body, status, code, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http_client().post(server.base + "/v1/completions", content=content, headers=server.headers, timeout=10)
    err = r.json()["error"]
    assert (r.status_code, err["code"], err["param"]) == (status, code, param), err
    assert err["type"] and err["message"]


@pytest.mark.parametrize("body,code,param", [
    ({"model": "tiny-v1"}, "missing_required_parameter", "messages"),
    ({"messages": []}, "invalid_value", "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "invalid_value", "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x " * 600}]}, "context_length_exceeded", "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**6},
     "context_length_exceeded", "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "invalid_value", "tools"),
])
def test_bad_chat_requests_and_the_server_keeps_serving(server, body, code, param):
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 400 and (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, param)
    ok = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                              "ignore_eos": True})   # 2 tokens, even if one is EOS
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_api_key_on_every_v1_route(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions")):
            r = httpx.request(method, server.base + path, headers=headers, json={"prompt": "x"}, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base + "/v1", api_key="nope", max_retries=0).models.list()
    assert http_client().get(server.base + "/health").status_code == 200         # probes need no key
    assert http_client().get(server.base + "/metrics").status_code == 200


def test_reset_prefix_cache_behind_the_key(server):
    prompt = [300 + (7 * j) % 200 for j in range(40)] + [5, 6, 7]       # two full pages, then a tail
    body = {"model": "tiny-v1", "prompt": prompt, "max_tokens": 2, "ignore_eos": True}

    def cached() -> int:
        r = server.post("/v1/completions", body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached() == 32                          # found the first request's two full pages
    r = httpx.post(server.base + "/reset_prefix_cache", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert server.post("/reset_prefix_cache", None).status_code == 200
    assert cached() == 0                           # the idle pages were freed
    metrics = http_client().get(server.base + "/metrics").text
    assert 'kvhold_prefix_cache_hits_total{model_name="tiny-v1"}' in metrics
    assert 'kvhold_kv_pages{state="cached"}' in metrics


def test_a_stream_crosses_an_executor_sigkill(server):
    reference = completion(server, **CROSSING).choices[0].text
    active = server.wait_healthy()["active_pid"]
    parts = []
    server.armed.touch()
    for i, chunk in enumerate(completion(server, stream=True, **CROSSING)):
        parts.append(chunk.choices[0].text)
        if i == 0:              # the executor stops itself at the request's 6th step: killed there
            wait_stopped(active, 60)
            server.armed.unlink()
            os.kill(active, signal.SIGKILL)
            os.kill(active, signal.SIGCONT)
    assert "".join(parts) == reference
    assert server.wait_healthy()["active_pid"] != active
    deadline = time.monotonic() + 10   # the recovery record completes with its first-token time
    while True:
        text = http_client().get(server.base + "/metrics").text
        if _metric(text, "kvhold_recovery_seconds_count") >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert _metric(text, "kvhold_recovery_seconds_count") >= 1
    assert _metric(text, 'kvhold_executor_restarts_total{reason="died"}') >= 1
    assert _metric(text, 'kvhold_recovered_requests_total{class="resumable"}') >= 1


def _metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


async def _run_many(server, requests, kill_after=None):
    seen, active = [0], server.wait_healthy()["active_pid"]

    async def one(client, body):
        if not body.get("stream"):
            return (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        parts = []
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    parts.append(json.loads(line[6:])["choices"][0]["text"])
                    seen[0] += 1
                    if seen[0] == kill_after:
                        os.kill(active, signal.SIGKILL)
        return "".join(parts)

    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=server.base, headers=server.headers, timeout=60,
                                 limits=limits) as client:
        return await asyncio.gather(*(one(client, b) for b in requests)), seen[0]


def test_32_concurrent_streams_with_a_kill_lose_nothing(server):
    requests = [dict(model="tiny-v1", prompt=f"Stream {i} of the sidecar journal", max_tokens=40,
                     temperature=0.0 if i % 4 == 0 else 1.0, top_p=0.9, seed=1000 + i) for i in range(32)]
    reference, _ = asyncio.run(_run_many(server, requests))
    streamed, seen = asyncio.run(_run_many(server, [dict(r, stream=True) for r in requests], kill_after=200))
    assert seen > 200
    assert streamed == reference


def test_health_during_failover_and_sigterm_drain(tiny_model, tmp_path, runtime_root):
    # a stream long enough (2,000 tokens, seconds of decode) to be in flight when the SIGTERM lands,
    # however slowly this client reads: the drain ends once the sidecar has generated every token
    srv = Server(tiny_model, runtime_root, tmp_path / "serve.log", "--standbys", "0", "--max-seq-len", "2048")
    try:
        sidecar_pid = srv.sidecar_status()["pid"]
        os.kill(srv.wait_healthy(standbys=0)["active_pid"], signal.SIGKILL)
        seen_503 = seen_200_after = False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not seen_200_after:
            r = srv.health()
            if r.status_code == 503:
                assert "no active executor" in r.json()["reason"]
                seen_503 = True
            seen_200_after = seen_503 and r.status_code == 200
            time.sleep(0.01)
        assert seen_503 and seen_200_after

        body = {"prompt": "Drain me", "max_tokens": 2000, "temperature": 0, "stream": True}
        with http_client().stream("POST", srv.base + "/v1/completions", json=body, timeout=60) as r:
            lines = (line for line in r.iter_lines() if not line.startswith("id: "))
            assert next(lines).startswith("data: {")
            srv.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: srv.health().status_code == 503, what="the drain to start")
            late = srv.post("/v1/completions", {"prompt": "late", "max_tokens": 2})
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
            assert srv.health().status_code == 503
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert srv.proc.wait(30) == 0
        with pytest.raises(ProcessLookupError):
            os.kill(sidecar_pid, 0)
    finally:
        srv.stop()


# ---------------------------------------------------------------- the pieces, without processes
def test_stop_strings_are_held_back_until_known():
    from kvhold.serving.generation import StopMatcher

    m = StopMatcher(["END", "xyz"])
    assert m.push("abc E") == ("abc ", False)          # "E" may start "END": held back
    assert m.push("N") == ("", False)
    assert m.push("Dmore") == ("", True)
    m = StopMatcher(["END"])
    assert m.push("EN") == ("", False) and m.push("d") == ("ENd", False) and m.flush() == ""


def test_chat_template_from_the_checkpoint_and_the_plain_one(tmp_path):
    from kvhold.serving.chat_template import ChatTemplate

    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    plain = ChatTemplate.for_checkpoint(tmp_path)
    assert plain.is_plain and plain.render(msgs) == "system: S\nuser: U\nassistant:"
    hf = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}{{ eos_token }}"
          "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": hf, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    assert ChatTemplate.for_checkpoint(tmp_path).render(msgs) == "<s><|system|>S</s><|user|>U</s><|assistant|>"


def _status(**over):
    st = {"weights": {"state": "sealed"}, "pages": {"free": 10, "committed": 2, "bad": 0},
          "executors": [{"slot": 0, "pid": 5, "role": "active", "epoch": 3, "ready": True,
                         "heartbeat_age_ms": 12.0}],
          "requests": {"in_flight": 1, "admitted_total": 9, "finished": {"length": 8}},
          "events": [{"kind": "fence", "ns": 100, "pid": 4, "reason": "died", "detect_ns": 100,
                      "fenced_ns": 400_000}],
          "recoveries": [{"fenced_epoch": 2, "detect_ns": 100, "validated_ns": 10_000_100,
                          "first_token_ns": 20_000_100, "requests_resumable": 3, "tokens_kept": 40}]}
    return {**st, **over}


def test_serving_state_is_truthful():
    from kvhold.serving.http_api import serving_state

    assert serving_state(_status(), 1000)[0]
    assert not serving_state(_status(weights={"state": "loading"}), 1000)[0]
    assert not serving_state(_status(executors=[]), 1000)[0]
    stale = [dict(_status()["executors"][0], heartbeat_age_ms=1500.0)]
    assert not serving_state(_status(executors=stale), 1000)[0]
    assert not serving_state(_status(health={"action": "drain", "reason": "xid 79"}), 1000)[0]
    assert serving_state(_status(health={"action": "none", "events": []}), 1000)[0]
    closed = {"open": False, "closed_by": {"health": "pool restart required (Xid 48)"}}
    ok, reason = serving_state(_status(admissions=closed), 1000)
    assert not ok and "Xid 48" in reason
    assert serving_state(_status(admissions={"open": True, "closed_by": {}}), 1000)[0]


def test_metrics_count_each_recovery_once():
    from kvhold.serving.metrics import SidecarMetrics

    m = SidecarMetrics()
    m.observe(_status())
    m.observe(_status(health={"action": "restart_executor", "reason": "xid 13", "events": [{}]}))
    text = m.render().decode()
    assert _metric(text, "kvhold_recovery_seconds_count") == 1
    assert _metric(text, "kvhold_recovery_seconds_sum") == pytest.approx(0.02)
    assert _metric(text, 'kvhold_recovery_phase_seconds_count{phase="validate"}') == 1
    assert _metric(text, 'kvhold_recovered_requests_total{class="resumable"}') == 3
    assert _metric(text, 'kvhold_executor_restarts_total{reason="died"}') == 1
    assert _metric(text, 'kvhold_nvml_health_action{action="restart_executor"}') == 1
    assert _metric(text, 'kvhold_kv_pages{state="committed"}') == 2
    m.observe(_status())  # no "health" key: reported as absent, nothing breaks
    assert _metric(m.render().decode(), "kvhold_nvml_health_reported") == 0
