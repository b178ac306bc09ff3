"""The client SDK against a real sidecar: streams, typed errors, cancel, ownership, liveness."""
import os
import signal
import time

import pytest
import zmq

from kvhold.protocol import messages as m, wire
from kvhold.protocol.errors import (ErrorCode, InvalidParams, InvalidTokenId, NotFound, PromptTooLong,
                        SidecarUnavailable)
from tests.process.helpers import wait_stopped


@pytest.fixture
def client(sidecar):
    with sidecar.new_client(timeout=20) as c:
        yield c


def test_stream_indices_text_and_usage(client):
    stream = client.generate("The quick brown fox", max_tokens=12, temperature=0.0)
    events = list(stream)
    result = stream.result()
    assert [e.index for e in events] == list(range(12))
    assert [e.token_id for e in events] == result.token_ids
    assert result.finish_reason == "length" and result.completion_tokens == 12
    assert result.prompt_tokens > 0
    assert result.text.startswith("".join(e.text for e in events))  # + any held-back tail


def test_same_seed_same_output_and_stop_tokens(client):
    a = client.generate("Once upon a time", max_tokens=20, temperature=0.9, seed=5).result()
    b = client.generate("Once upon a time", max_tokens=20, temperature=0.9, seed=5).result()
    assert a.token_ids == b.token_ids
    stop = a.token_ids[4]
    c = client.generate("Once upon a time", max_tokens=20, temperature=0.9, seed=5,
                        stop_token_ids=[stop]).result()
    assert c.finish_reason == "stop" and c.token_ids == a.token_ids[:a.token_ids.index(stop) + 1]


@pytest.mark.parametrize("kwargs,exc", [
    (dict(prompt="hi", max_tokens=0), InvalidParams),
    (dict(prompt="hi", max_tokens=-3), InvalidParams),
    (dict(prompt="hi", temperature=-1.0), InvalidParams),
    (dict(prompt="hi", top_p=0.0), InvalidParams),
    (dict(prompt="hi", top_k=-1), InvalidParams),
    (dict(prompt="hi", frequency_penalty=2.5), InvalidParams),
    (dict(prompt="hi", repetition_penalty=0.0), InvalidParams),
    (dict(prompt="hi", min_p=1.5), InvalidParams),
    (dict(prompt="hi", length_penalty=0.5), InvalidParams),        # not an option of kvhold's
])
def test_bad_parameters_fail_fast_in_the_sdk(client, kwargs, exc):
    prompt = kwargs.pop("prompt")
    with pytest.raises(exc):
        client.generate(prompt, **kwargs)


def _raw(sidecar, msg_bytes):
    """Send a frame bypassing SDK validation; return the decoded reply."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(sidecar.new_client().endpoint)
    try:
        sock.send(msg_bytes)
        assert sock.poll(5000)
        return wire.decode(sock.recv())
    finally:
        sock.close(0)


@pytest.mark.parametrize("params,prompt_ids,code", [
    ({"max_tokens": 0}, [1, 2], ErrorCode.INVALID_PARAMS),
    ({"bogus": 1}, [1, 2], ErrorCode.INVALID_PARAMS),
    ({"max_tokens": 10}, [1, 99999], ErrorCode.INVALID_TOKEN),
    ({"max_tokens": 10}, [-1], ErrorCode.INVALID_TOKEN),
    ({"max_tokens": 10}, [], ErrorCode.INVALID_PARAMS),
    ({"max_tokens": 10}, list(range(300)), ErrorCode.PROMPT_TOO_LONG),
    ({"max_tokens": 250}, list(range(10)), ErrorCode.PROMPT_TOO_LONG),
    ({"temperature": "hot"}, [1], ErrorCode.INVALID_PARAMS),
])
def test_the_sidecar_validates_everything_itself(sidecar, params, prompt_ids, code):
    reply = _raw(sidecar, wire.encode(m.Generate(tag=9, params=params, prompt_ids=prompt_ids)))
    assert isinstance(reply, m.Error) and reply.code == code and reply.tag == 9


@pytest.mark.parametrize("frame", [b"", b"\xc1garbage", wire.encode(m.Attach(token="x", pid=1)),
                                   b"\x93\x01\xa8generate\x80"])
def test_garbage_gets_an_error_and_the_service_keeps_serving(sidecar, client, frame):
    reply = _raw(sidecar, frame)
    assert isinstance(reply, m.Error)
    assert client.generate("still serving", max_tokens=3, ignore_eos=True).result().completion_tokens == 3


def test_typed_errors_from_the_sidecar(client):
    with pytest.raises(PromptTooLong):
        client.generate(prompt_ids=list(range(2, 300)), max_tokens=5)
    with pytest.raises(InvalidTokenId):
        client.generate(prompt_ids=[5, 10**6], max_tokens=5)
    with pytest.raises(ValueError):
        client.generate("a", prompt_ids=[1])


def test_cancel_and_ownership(tiny_model, start_sidecar, tmp_path):
    # The executor stops itself at its 5th commit, a few tokens into the 200 (ignore_eos: no early
    # end): the request is certainly running when the cancels arrive. The frontend answers a
    # cancel and marks it in the journal without the executor; the stopped executor, let go on,
    # sees it there and ends the stream.
    sc = start_sidecar(["--model", str(tiny_model), "--max-seq-len", "256", "--standbys", "0",
                        "--lease-ms", "60000"],
                       env={"KVHOLD_FAULT": "commit_finish:5:stop", "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")})
    pid = sc.wait_steady(standbys=0)["pid"]
    with sc.new_client(timeout=20) as client:
        stream = client.generate("A long answer", max_tokens=200, temperature=0.0, ignore_eos=True)
        next(stream)
        wait_stopped(pid)
        try:
            with sc.new_client() as other:
                with pytest.raises(NotFound):          # not theirs: it does not exist for them
                    other.cancel(stream.request_id)
            client.cancel(stream.request_id)
        finally:
            os.kill(pid, signal.SIGCONT)
        result = stream.result()
    assert result.finish_reason == "cancelled" and result.completion_tokens < 200


def test_a_dead_sidecar_is_an_error_in_bounded_time(tiny_model, tmp_path):
    from kvhold.testing.sidecar_process import SidecarProcess

    # the executor stops itself at its 5th commit: the stream cannot end before the sidecar's death
    env = {"KVHOLD_FAULT": "commit_finish:5:stop", "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")}
    sc = SidecarProcess(["--model", str(tiny_model), "--standbys", "0", "--lease-ms", "30000"], env=env).start()
    try:
        sc.wait_steady(standbys=0)
        client = sc.new_client(timeout=2.0)
        stream = client.generate("Going", max_tokens=400, temperature=0.0)
        next(stream)
        sc.stop(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(SidecarUnavailable):
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 5
        with pytest.raises(SidecarUnavailable):
            client.ping()
        client.close()
    finally:
        sc.stop()
