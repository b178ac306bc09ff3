"""Log-probs over the OpenAI-compatible HTTP API against a real server: completions (`logprobs`,
`echo`) and chat (`logprobs`, `top_logprobs`) in OpenAI's formats, streamed and not, the same
values both ways, and the 400s (above --max-logprobs, top_logprobs without logprobs)."""
import json

from kvhold.testing.serve_process import http_client
import pytest

PROMPT = "Once upon a time there was"


def sse_chunks(srv, path, body):
    with http_client().stream("POST", srv.base + path, json={**body, "stream": True}, headers=srv.headers,
                      timeout=60) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def merged(parts):
    """Completions logprobs objects of a stream's chunks, joined."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in parts:
        for k in out:
            out[k] += p[k]
    return out


def check_completion_logprobs(lp, k, text):
    n = len(lp["tokens"])
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    offsets = [0]
    for t in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp["text_offset"] == offsets
    if text is not None:
        assert "".join(lp["tokens"]) == text
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        if value is None:
            assert top is None
            continue
        assert value <= 0 and top[tok] == value
        assert k <= len(top) <= k + 1            # the k most likely, and the chosen one
        ranked = sorted(top.values(), reverse=True)
        assert value in ranked and max(ranked) <= 0


def test_completion_logprobs_streamed_and_not(server):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 3, "ignore_eos": True}
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == r.json()["usage"]["completion_tokens"] == 12
    check_completion_logprobs(lp, 3, choice["text"])
    chunks = sse_chunks(server, "/v1/completions", body)
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert merged(parts) == lp
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]


def test_echo_with_logprobs_scores_the_prompt(server):
    plain = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                            "logprobs": 2}).json()
    r = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                        "logprobs": 2, "echo": True})
    assert r.status_code == 200, r.text
    body = r.json()
    choice, usage = body["choices"][0], body["usage"]
    assert choice["text"] == PROMPT + plain["choices"][0]["text"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == usage["prompt_tokens"] + usage["completion_tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None    # as OpenAI and vLLM
    assert all(v is not None for v in lp["token_logprobs"][1:])
    # the prompt's tokens are those the model saw: a BOS the tokenizer adds is one (as in vLLM)
    check_completion_logprobs(lp, 2, None)
    assert "".join(lp["tokens"]).endswith(choice["text"])
    p = usage["prompt_tokens"]
    gen = plain["choices"][0]["logprobs"]
    assert lp["token_logprobs"][p:] == gen["token_logprobs"] and lp["top_logprobs"][p:] == gen["top_logprobs"]
    # lm-eval's loglikelihood request: max_tokens 1, echo, logprobs 1, streamed the same
    chunks = sse_chunks(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                                    "logprobs": 2, "echo": True})
    assert chunks[0]["choices"][0]["text"] == PROMPT
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert merged(parts) == lp


def test_echo_with_max_tokens_zero_scores_the_prompt_alone(server):
    body = {"prompt": PROMPT, "temperature": 0, "logprobs": 2, "echo": True}
    one = server.post("/v1/completions", {**body, "max_tokens": 1}).json()
    r = server.post("/v1/completions", {**body, "max_tokens": 0})
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == one["usage"]["prompt_tokens"]
    p = usage["prompt_tokens"]
    lp, lp_one = choice["logprobs"], one["choices"][0]["logprobs"]
    assert lp["tokens"] == lp_one["tokens"][:p] and lp["token_logprobs"] == lp_one["token_logprobs"][:p]
    assert lp["top_logprobs"] == lp_one["top_logprobs"][:p]
    chunks = sse_chunks(server, "/v1/completions", {**body, "max_tokens": 0})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == PROMPT
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert merged(parts) == lp
    refused = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_echo_of_token_ids_and_logprobs_zero(server):
    ids = [5, 17, 42, 9]
    r = server.post("/v1/completions", {"prompt": ids, "max_tokens": 2, "temperature": 0, "logprobs": 0,
                                        "echo": True})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 6 and lp["token_logprobs"][0] is None
    assert all(len(t) == 1 for t in lp["top_logprobs"][1:])          # only the chosen token


def test_chat_logprobs_streamed_and_not(server):
    body = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 10,
            "temperature": 0, "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 10
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    for e in content:
        assert e["logprob"] <= 0 and e["bytes"] == list(e["token"].encode())
        assert len(e["top_logprobs"]) == 2
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
        assert e["top_logprobs"][0]["logprob"] >= e["logprob"]
    assert content[0]["top_logprobs"][0]["token"] == content[0]["token"]   # greedy: the most likely
    chunks = sse_chunks(server, "/v1/chat/completions", body)
    streamed = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content
    plain = server.post("/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": None}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_openai_package_reads_them(server):
    client = server.openai()
    out = client.completions.create(model="tiny-v1", prompt=PROMPT, max_tokens=4, temperature=0,
                                    logprobs=2, echo=True)
    assert out.choices[0].logprobs.token_logprobs[0] is None
    chat = client.chat.completions.create(model="tiny-v1", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=1)
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 1


@pytest.mark.parametrize("path,body,param,words", [
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, None, "limit of 20 (--max-logprobs)"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 3, "echo": True, "n": 2, "temperature": 0.5,
                         "max_tokens": 2}, None, None),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs",
     "not available with stream"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs", "greater than or equal"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs", "needs logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, None, "limit of 20"),
])
def test_logprob_requests_refused_or_served(server, path, body, param, words):
    r = server.post(path, body)
    if words is None:            # several choices with echo and log-probs are served
        assert r.status_code == 200, r.text
        assert all(c["logprobs"]["token_logprobs"][0] is None for c in r.json()["choices"])
        return
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param, err
    assert words in err["message"]
