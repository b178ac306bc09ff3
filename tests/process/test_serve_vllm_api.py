"""The routes and options people coming from vLLM use, against a real `kvhold serve`: /version,
GET /v1/models/{id} (the openai client's models.retrieve), /tokenize and /detokenize, an echoed
X-Request-Id, continuous usage stats, cached_tokens, and vLLM's extensions refused by name
unless neutral (never accepted and ignored)."""
import json

import httpx
from kvhold.testing.serve_process import http_client
import openai
import pytest

from tests.process.helpers import Server


def test_version_and_model_retrieval(server):
    from kvhold import __version__
    assert http_client().get(server.base + "/version", timeout=10).json() == {"version": __version__}
    client = server.openai()
    assert client.models.retrieve("tiny-v1").id == "tiny-v1"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_tokenize_round_trips_and_matches_usage(server):
    tok = server.post("/tokenize", {"prompt": "Once upon a time", "add_special_tokens": False}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] > 0
    back = server.post("/detokenize", {"tokens": tok["tokens"]}).json()
    assert back["prompt"] == "Once upon a time"
    done = server.post("/v1/completions", {"prompt": tok["tokens"], "max_tokens": 2}).json()
    assert done["usage"]["prompt_tokens"] == tok["count"]
    assert done["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    chat = server.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 0
    assert server.post("/detokenize", {"tokens": [10**6]}).status_code == 400
    assert server.post("/tokenize", {}).status_code == 400
    assert http_client().post(server.base + "/tokenize", json={"prompt": "x"}, timeout=10).status_code == 401


def test_request_id_is_echoed(server):
    r = http_client().post(server.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                   headers={**server.headers, "X-Request-Id": "abc-123"}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"


def test_continuous_usage_stats_on_every_chunk(server):
    body = {"prompt": "Once upon a time", "max_tokens": 6, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with http_client().stream("POST", server.base + "/v1/completions", json=body, headers=server.headers,
                      timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices and all("usage" in c for c in with_choices)
    counts = [c["usage"]["completion_tokens"] for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("option", [{"length_penalty": 0.5}, {"repetition_penalty": 0}, {"min_p": 1.5},
                                    {"presence_penalty": 3}, {"logit_bias": {"5": 101}},
                                    {"use_beam_search": True}, {"response_format": {"type": "structural_tag"}},
                                    {"stream": True, "stream_options": {"bogus": 1}},
                                    {"stream_options": {"include_usage": True}}])
def test_unimplemented_options_are_refused_by_name(server, option):
    r = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, **option})
    assert r.status_code == 400, r.text
    name = next(iter(option)) if "stream_options" not in option else "stream_options"
    assert r.json()["error"]["param"] == name


def test_penalties_and_min_p_reach_the_sampler(server):
    body = {"prompt": [40 + j for j in range(20)], "max_tokens": 40, "temperature": 0, "ignore_eos": True}

    def tokens(**extra):
        r = server.post("/v1/completions", {**body, **extra, "logprobs": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]

    plain = tokens()
    assert tokens(repetition_penalty=1.5) != plain
    assert tokens(frequency_penalty=1.0, presence_penalty=0.5) != plain
    assert tokens(min_p=0.5) == plain                      # greedy keeps the most likely token


def test_ping_load_and_tokenizer_info_as_vllm_serves_them(server):
    get = lambda path: http_client().get(server.base + path, headers=server.headers, timeout=10)  # noqa: E731
    assert get("/ping").status_code == 200
    assert http_client().post(server.base + "/ping", headers=server.headers, timeout=10).status_code == 200
    assert get("/load").json() == {"server_load": 0}
    info = get("/tokenizer_info").json()
    assert info["tokenizer_class"] and info["eos_token"] == "</s>" and info["bos_token"] == "<s>"
    assert info["chat_template"] and info["model_max_length"] > 0
    # lm-eval's remote tokenizer: the eos token's id through /tokenize
    ids = server.post("/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1


def test_neutral_values_of_vllm_extensions_are_accepted(server):
    r = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1.0,
                                        "min_p": 0.0, "min_tokens": 0})
    assert r.status_code == 200, r.text


def test_the_port_answers_during_start_up_with_503_starting(tiny_model, tmp_path, runtime_root):
    import time

    from tests.process.helpers import ServeProcess

    srv = ServeProcess(["--log-level", "WARNING"], runtime_root, model=tiny_model).spawn()
    port = srv.port
    seen = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                r = http_client().get(f"http://127.0.0.1:{port}/health", timeout=5)
                seen.append((r.status_code, r.json()["status"]))
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    finally:
        srv.stop(60)
    assert (503, "starting") in seen and seen[-1] == (200, "ok"), seen[-5:]
    assert seen.index((503, "starting")) < len(seen) - 1


def test_a_paused_stream_gets_sse_keepalive_comments(tiny_model, tmp_path, runtime_root):
    """The active executor frozen (SIGSTOP, within its lease): the stream is silent, and SSE
    comments keep its connection alive; it then goes on to the same text."""
    import os
    import signal
    import time

    srv = Server(tiny_model, runtime_root, tmp_path / "serve.log", "--sse-keepalive", "0.3", "--lease-ms", "30000",
                 "--max-seq-len", "1024")
    try:
        # long enough that the stream is still in flight when the stop lands, however fast it runs
        body = {"prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
                "stream": True}
        reference = srv.post("/v1/completions", dict(body, stream=False)).json()["choices"][0]["text"]
        active = srv.wait_healthy()["active_pid"]
        comments, text = 0, []
        with http_client().stream("POST", srv.base + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
                    if len(text) == 3:
                        os.kill(active, signal.SIGSTOP)
                        stopped = time.monotonic()
                        break
            try:
                for line in lines:
                    if line.startswith("data: {"):       # sent before the stop took hold
                        text.append(json.loads(line[6:])["choices"][0]["text"])
                    if line == ": keepalive":
                        comments += 1
                        if time.monotonic() - stopped > 1.5:
                            break
            finally:
                os.kill(active, signal.SIGCONT)
            for line in lines:
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        assert comments >= 3
        assert "".join(text) == reference
    finally:
        srv.stop()


def _one(server, prompt, **kw):
    body = {"prompt": prompt, "max_tokens": 8, "ignore_eos": True, **kw}
    return server.post("/v1/completions", body).json()["choices"][0]["text"]


def _streamed(server, body) -> tuple[dict, dict]:
    texts, usage = {}, None
    with http_client().stream("POST", server.base + "/v1/completions", json={**body, "stream": True},
                      headers=server.headers, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                obj = json.loads(line[6:])
                for c in obj["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                usage = obj.get("usage") or usage
    return texts, usage


def test_batched_prompts_each_as_its_own_choice(server):
    prompts = ["Once upon a time", "The sidecar keeps"]
    body = {"prompt": prompts, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = server.post("/v1/completions", body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    want = [_one(server, p, temperature=0) for p in prompts]
    assert [c["text"] for c in r["choices"]] == want
    assert r["usage"]["completion_tokens"] == 16
    ids = server.post("/tokenize", {"prompt": prompts[0]}).json()["tokens"]
    r2 = server.post("/v1/completions", {**body, "prompt": [ids, ids]}).json()
    assert r2["choices"][0]["text"] == r2["choices"][1]["text"]
    texts, usage = _streamed(server, {**body, "stream_options": {"include_usage": True}})
    assert [texts[0], texts[1]] == want and usage["completion_tokens"] == 16


def test_n_choices_sample_with_seed_plus_their_index(server):
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.9, "seed": 5,
            "ignore_eos": True, "n": 3}
    r = server.post("/v1/completions", body).json()
    got = [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]
    assert got == [_one(server, "Once upon a time", temperature=0.9, seed=5 + j) for j in range(3)]
    assert len(set(got)) > 1
    assert r["usage"]["prompt_tokens"] == server.post("/tokenize", {"prompt": "Once upon a time"}).json()["count"]
    texts, _ = _streamed(server, body)
    assert [texts[j] for j in range(3)] == got
    chat = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 4, "temperature": 0.9, "n": 2}).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    greedy = server.post("/v1/completions", {**body, "temperature": 0}).json()["choices"]
    assert len(greedy) == 3 and len({c["text"] for c in greedy}) == 1      # identical, as vLLM's
    assert server.post("/v1/completions", {**body, "n": 65}).status_code == 400


def test_prompt_logprobs_as_vllm_returns_them(server):
    body = {"prompt": "The sidecar keeps the memory", "max_tokens": 2, "temperature": 0}
    r = server.post("/v1/completions", {**body, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    lps = r.json()["choices"][0]["prompt_logprobs"]
    ids = server.post("/tokenize", {"prompt": body["prompt"]}).json()["tokens"]
    assert len(lps) == len(ids) and lps[0] is None
    echo = server.post("/v1/completions", {**body, "echo": True, "logprobs": 2}).json()["choices"][0]["logprobs"]
    for pos, (tid, entry) in enumerate(zip(ids[1:], lps[1:]), 1):
        mine = entry[str(tid)]
        assert mine["logprob"] == echo["token_logprobs"][pos]
        ranks = sorted(v["rank"] for v in entry.values())
        if mine["rank"] <= 2:                 # one of the two most likely: two entries
            assert ranks == [1, 2]
        else:                                 # the two most likely, and the token itself
            assert ranks == [1, 2, mine["rank"]]
    chat = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                "prompt_logprobs": 1})
    assert chat.status_code == 200 and chat.json()["prompt_logprobs"][0] is None, chat.text
    refused = server.post("/v1/completions", {**body, "prompt_logprobs": 1, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_iteration_tokens_count_the_engine_steps(server):
    """vLLM's iteration_tokens_total: each engine step's tokens, prefill and decode."""
    import re

    from tests.process.helpers import wait_until

    def steps() -> tuple[float, float]:
        text = http_client().get(server.base + "/metrics", timeout=10).text
        count = re.search(r'^kvhold_iteration_tokens_count\{model_name="[^"]+"\} (\S+)$', text, re.M)
        total = re.search(r'^kvhold_iteration_tokens_sum\{model_name="[^"]+"\} (\S+)$', text, re.M)
        return (float(count.group(1)), float(total.group(1))) if count and total else (0.0, 0.0)
    before = steps()
    prompt = [499 - j for j in range(30)]           # no other test's: nothing of it is in the prefix cache
    r = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    # 8 steps at least (a prefill that samples the first token, then 7 decodes), 30 + 7 tokens
    after = wait_until(lambda: (s := steps())[0] >= before[0] + 8 and s, 30, 0.2, what="the steps counted")
    assert after[1] - before[1] >= 37
