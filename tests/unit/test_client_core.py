"""The SDK's sans-IO core (kvhold.client.core.ClientCore) that both clients share: encoded
messages in, stream and reply state and the messages to send out, with the clock given by the
test. No socket, no event loop."""
import pytest

from kvhold.client.core import RESUME_AFTER_S, ClientCore
from kvhold.protocol import messages as m, wire
from kvhold.protocol.errors import NotFound, ProtocolError, SidecarUnavailable
from kvhold.protocol.sampling import RequestInput

T0 = 1000.0


def _core(timeout=10.0) -> ClientCore:
    return ClientCore("ipc://test", timeout, now=T0)


def _feed(core: ClientCore, msg, now=T0):
    return core.receive(wire.encode(msg), now)


def _open(core: ClientCore, request_id: int, now=T0, prompt_tokens=3):
    """A Generate and its Accepted: (tag, the stream's state)."""
    tag, msg = core.generate(RequestInput.check(None, [5, 6, 7], None, {"max_tokens": 8}))
    assert isinstance(msg, m.Generate) and msg.tag == tag and msg.prompt_ids == [5, 6, 7]
    got = _feed(core, m.Accepted(tag=tag, request_id=request_id, prompt_tokens=prompt_tokens), now)
    assert got.replies == [tag] and core.answered(tag)
    st = core.reply(tag)
    assert core.streams[request_id] is st and st.prompt_tokens == prompt_tokens
    return tag, st


def _tokens(rid, start, ids):
    return m.Tokens(request_id=rid, start=start, ids=ids, texts=[f"<{t}>" for t in ids])


def test_tokens_come_in_order_once_and_the_end_gives_the_result():
    core = _core()
    _, st = _open(core, 7)
    assert _feed(core, _tokens(7, 0, [1, 2])).streams == [st]
    _feed(core, _tokens(7, 1, [2, 3, 4]))                  # a resend from index 1: 2 is not taken twice
    assert [(e.index, e.token_id) for e in st.pending] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    _feed(core, _tokens(99, 0, [1]))                        # another's stream: ignored
    got = _feed(core, m.Done(request_id=7, finish_reason="length", prompt_tokens=3, completion_tokens=4,
                             text="<1><2><3><4>"))
    assert got.streams == [st] and st.finished and 7 not in core.streams
    result = st.result()
    assert result.token_ids == [1, 2, 3, 4] and result.finish_reason == "length" and result.logprobs is None


def test_a_gap_ends_the_stream_with_an_error_and_it_is_not_resumed():
    core = _core()
    _, st = _open(core, 7)
    _feed(core, _tokens(7, 0, [1]))
    _feed(core, _tokens(7, 3, [4]))
    assert isinstance(st.error, ProtocolError) and "gap" in str(st.error)
    assert [e.token_id for e in st.pending] == [1] and 7 not in core.streams
    assert core.resume_due(T0 + 5 * RESUME_AFTER_S) is None


def test_replies_go_to_their_tag_and_a_late_one_is_dropped():
    core = _core()
    tag, msg = core.request(lambda t: m.Cancel(tag=t, request_id=7))
    assert msg.tag == tag
    assert _feed(core, m.Error(tag=tag, request_id=7, code=NotFound.code, message="gone")).replies == [tag]
    with pytest.raises(NotFound, match="gone"):
        core.reply(tag)
    # a Generate whose waiter gave up: its late Accepted opens no stream, its reply is not kept
    tag, _ = core.generate(RequestInput.check("hi", None, None, {}))
    core.forget(tag)
    got = _feed(core, m.Accepted(tag=tag, request_id=8, prompt_tokens=1))
    assert got.replies == [] and not core.streams and not core.answered(tag)
    # an error naming a tag is that request's answer, even when nobody waits: a stream survives it
    _, st = _open(core, 9)
    _feed(core, m.Error(tag=12345, request_id=9, code=NotFound.code, message="late"))
    assert st.error is None and core.streams[9] is st
    _feed(core, m.Error(tag=0, request_id=9, code=NotFound.code, message="cancelled: no client claimed it"))
    assert isinstance(st.error, NotFound) and 9 not in core.streams


def test_a_silence_resumes_the_silent_streams_once_a_second_from_the_index_held():
    core = _core()
    _, quiet = _open(core, 1)
    _, busy = _open(core, 2)
    _feed(core, _tokens(1, 0, [1, 2, 3]), now=T0)
    assert core.resume_due(T0 + 0.5) is None                  # not yet a second since the start
    _feed(core, m.Keepalive(request_ids=[2]), now=T0 + 0.8)   # a keepalive counts for its stream
    resume = core.resume_due(T0 + RESUME_AFTER_S + 0.1)
    assert resume.request_ids == [1] and resume.next_indices == [3]
    assert core.resume_due(T0 + RESUME_AFTER_S + 0.2) is None   # once a second at most
    resume = core.resume_due(T0 + 2 * RESUME_AFTER_S + 0.2)
    assert sorted(zip(resume.request_ids, resume.next_indices)) == [(1, 3), (2, 0)]
    # a reconnect re-attaches every open stream at once, and the silence timer starts again
    again, failed = core.reconnected(T0 + 2 * RESUME_AFTER_S + 0.3)
    assert failed.replies == []                 # no request was awaited across the lost connection
    assert sorted(zip(again.request_ids, again.next_indices)) == [(1, 3), (2, 0)]
    assert core.resume_due(T0 + 2 * RESUME_AFTER_S + 0.5) is None
    assert quiet.error is None and busy.error is None


def test_silence_fails_a_wait_after_the_timeout_unless_a_pool_restart_announced_a_pause():
    core = _core(timeout=2.0)
    assert core.wait_s(started=T0, now=T0) == RESUME_AFTER_S
    assert core.wait_s(started=T0, now=T0 + 1.5) == pytest.approx(0.5)
    with pytest.raises(SidecarUnavailable, match="ipc://test"):
        core.wait_s(started=T0, now=T0 + 2.0)
    _feed(core, m.Keepalive(request_ids=[]), now=T0 + 1.9)    # any frame resets the clock
    assert core.wait_s(started=T0, now=T0 + 3.0) == pytest.approx(0.9)
    _feed(core, m.Restarting(request_ids=[], resume_within_s=30.0, generation=2), now=T0 + 3.0)
    assert core.wait_s(started=T0, now=T0 + 20.0) == RESUME_AFTER_S   # waiting through the pause
    _feed(core, m.Keepalive(request_ids=[]), now=T0 + 21.0)    # a sidecar serves again: normal timeout
    with pytest.raises(SidecarUnavailable):
        core.wait_s(started=T0, now=T0 + 23.5)


def test_an_undecodable_frame_is_a_protocol_error_and_fail_all_ends_everything():
    core = _core()
    _, st = _open(core, 7)
    tag, _ = core.request(lambda t: m.Status(tag=t))
    with pytest.raises(ProtocolError, match="undecodable"):
        core.receive(b"\xc1 not msgpack", T0)
    got = core.fail_all(ProtocolError("broken"))
    assert got.replies == [tag] and got.streams == [st] and not core.streams
    with pytest.raises(ProtocolError, match="broken"):
        core.reply(tag)
    assert isinstance(st.error, ProtocolError)


def test_attach_asks_for_every_token_and_is_answered_by_a_keepalive_or_tokens():
    core = _core()
    st, resume = core.attach(0xabc, now=T0)
    assert (resume.request_ids, resume.next_indices) == ([0xabc], [0])
    with pytest.raises(ValueError, match="already has a stream"):
        core.attach(0xabc, now=T0)
    assert not core.attach_answered(st, asked=T0)
    assert _feed(core, m.Keepalive(request_ids=[0xabc]), now=T0 + 0.1).streams == [st]
    assert core.attach_answered(st, asked=T0)
    other, _ = core.attach(0xdef, now=T0)
    core.drop(other)                                     # nobody answered: forgotten
    assert 0xdef not in core.streams and 0xabc in core.streams


def test_a_request_sent_before_a_lost_connection_fails_at_the_reconnect_one_sent_after_waits():
    core = ClientCore("ipc:///x", timeout=10.0, now=T0)
    before, _ = core.request(lambda tag: m.Ping(tag=tag))
    core.sending(before)
    core.connection_lost()                        # the peer died (socket monitor: disconnected)
    after, _ = core.request(lambda tag: m.Ping(tag=tag))     # queued for the next connection
    core.sending(after)
    resume, got = core.reconnected(T0 + 1)
    assert resume is None and got.replies == [before]
    with pytest.raises(SidecarUnavailable, match="lost before it answered"):
        core.reply(before)
    assert not core.answered(after)               # the next process answers it
