"""`min_tokens` (vLLM's extension field) through a real `kvhold serve`: honoured in completions
and chat, and a min_tokens above max_tokens is a 400 naming it."""
from kvhold.client.client import Client

PROMPT = list(range(2, 30))


def test_min_tokens_keeps_a_stop_id_from_ending_the_completion(server):
    with Client.for_instance(server.instance, server.runtime_root, timeout=30) as client:
        stop = client.generate(prompt_ids=PROMPT, max_tokens=4, temperature=0.0).result().token_ids[0]
        expected = client.generate(prompt_ids=PROMPT, max_tokens=12, temperature=0.0, stop_token_ids=[stop],
                                   min_tokens=5).result()
    body = {"model": "tiny-v1", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stop_token_ids": [stop]}
    unmasked = server.post("/v1/completions", body).json()
    assert unmasked["usage"]["completion_tokens"] == 1 and unmasked["choices"][0]["finish_reason"] == "stop"

    r = server.post("/v1/completions", {**body, "min_tokens": 5})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == len(expected.token_ids) >= 5
    assert stop not in expected.token_ids[:5]
    assert r.json()["choices"][0]["text"] == expected.text


def test_min_tokens_in_chat_and_above_max_tokens(server):
    messages = [{"role": "user", "content": "Say something"}]
    r = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 6, "min_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6        # EOS may not end it before
    for path, body in (("/v1/chat/completions", {"messages": messages, "max_tokens": 2, "min_tokens": 3}),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}),
                       ("/v1/completions", {"prompt": "hi", "min_tokens": 17}),          # default max_tokens 16
                       ("/v1/completions", {"prompt": "hi", "min_tokens": -1})):
        r = server.post(path, body)
        err = r.json()["error"]
        assert (r.status_code, err["code"], err["param"]) == (400, "invalid_value", "min_tokens"), (body, err)
