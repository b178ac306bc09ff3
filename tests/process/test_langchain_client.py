"""A third-party client as people use it: LangChain's OpenAI integration (langchain-openai)
against `kvhold serve`, chat and completions, streamed, with the active executor SIGKILLed in
the middle of a stream: the text equals an uninterrupted run's and the client sees no error."""
import os
import signal

import pytest

from tests.process.helpers import KEY

langchain_openai = pytest.importorskip("langchain_openai")
pytestmark = pytest.mark.slow            # a server start and three model runs: the slow suite
PROMPT = "Tell me about the pool"


def chat(server, **kw):
    return langchain_openai.ChatOpenAI(base_url=server.base + "/v1", api_key=KEY, model="tiny-v1",
                                       temperature=0.0, max_retries=0, timeout=120,
                                       stream_usage=True, **kw)


def test_chat_invoke_and_stream_agree(server):
    llm = chat(server, max_tokens=24)
    whole = llm.invoke([("system", "You are terse."), ("human", PROMPT)])
    assert whole.content and whole.response_metadata["finish_reason"] in ("length", "stop")
    assert whole.usage_metadata["output_tokens"] <= 24
    streamed = "".join(chunk.content for chunk in llm.stream([("system", "You are terse."),
                                                             ("human", PROMPT)]))
    assert streamed == whole.content


def test_completions_through_langchain(server):
    llm = langchain_openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, model="tiny-v1",
                                  temperature=0.0, max_tokens=16, max_retries=0, timeout=120)
    text = llm.invoke("Once upon a time")
    direct = server.openai().completions.create(model="tiny-v1", prompt="Once upon a time",
                                                max_tokens=16, temperature=0.0)
    assert text == direct.choices[0].text


def test_a_langchain_stream_survives_an_executor_sigkill(server):
    llm = chat(server, max_tokens=96)
    messages = [("human", PROMPT + " at length")]
    reference = llm.invoke(messages).content
    active = server.wait_healthy()["active_pid"]
    pieces, killed = [], False
    for chunk in llm.stream(messages):
        pieces.append(chunk.content)
        if not killed and sum(map(len, pieces)) >= 8:
            os.kill(active, signal.SIGKILL)           # mid-stream: the standby takes over
            killed = True
    assert killed, "the stream ended before the kill"
    assert "".join(pieces) == reference
    assert server.wait_healthy(timeout=90)["active_pid"] != active
