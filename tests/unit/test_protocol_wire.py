"""Wire codec: round trips, schema enforcement, and fuzzing of the one decoder."""
import dataclasses

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from kvhold.protocol import messages as m
from kvhold.protocol.errors import ErrorCode, InvalidParams, error_from_code
from kvhold.protocol.settings import ExecutorSettings
from kvhold.protocol.wire import MAX_FRAME_BYTES, PROTOCOL_VERSION, WireError, decode, encode, registered_types
from kvhold.protocol.sampling import SamplingParams


def test_round_trip_every_message():
    samples = [m.Attach(token="t", pid=1), m.Generate(tag=1, params=SamplingParams(max_tokens=3), prompt="hi"),
               m.Generate(tag=2, params=SamplingParams(), prompt_ids=[1, 2]), m.Tokens(request_id=5, start=0, ids=[1],
               texts=["a"]), m.Promote(epoch=3, pending_epochs=[1, 2]), m.Wake(), m.Keepalive()]
    for msg in samples:
        assert decode(encode(msg)) == msg
    assert {"attach", "generate", "tokens", "done", "error"} <= registered_types()


@pytest.mark.parametrize("payload,code", [
    (b"", ErrorCode.BAD_MESSAGE),
    (b"\xc1", ErrorCode.BAD_MESSAGE),
    (msgpack.packb({"a": 1}), ErrorCode.BAD_MESSAGE),
    (msgpack.packb([PROTOCOL_VERSION + 1, "ping", {"tag": 1}]), ErrorCode.BAD_VERSION),
    (msgpack.packb([True, "ping", {"tag": 1}]), ErrorCode.BAD_VERSION),
    (msgpack.packb([PROTOCOL_VERSION, "nope", {}]), ErrorCode.UNKNOWN_TYPE),
    (msgpack.packb([PROTOCOL_VERSION, "ping", []]), ErrorCode.BAD_FIELD),
    (msgpack.packb([PROTOCOL_VERSION, "ping", {}]), ErrorCode.BAD_FIELD),
    (msgpack.packb([PROTOCOL_VERSION, "ping", {"tag": "1"}]), ErrorCode.BAD_FIELD),
    (msgpack.packb([PROTOCOL_VERSION, "ping", {"tag": True}]), ErrorCode.BAD_FIELD),
    (msgpack.packb([PROTOCOL_VERSION, "ping", {"tag": 1, "x": 1}]), ErrorCode.BAD_FIELD),
    (msgpack.packb([PROTOCOL_VERSION, "generate", {"tag": 1, "params": {}, "prompt_ids": [1, "x"]}]),
     ErrorCode.BAD_FIELD),
    (b"\x00" * (MAX_FRAME_BYTES + 1), ErrorCode.TOO_LARGE),
])
def test_bad_frames_get_codes(payload, code):
    with pytest.raises(WireError) as info:
        decode(payload)
    assert info.value.code == code


def test_executor_settings_travel_typed_and_are_checked_on_decode():
    settings = ExecutorSettings(workload="idle", heartbeat_ms=40, lease_ms=200, prefill_chunk=32)
    msg = m.Attached(slot=1, epoch=2, generation=3, nonce="n", regions=[], settings=settings, weights={})
    assert decode(encode(msg)) == msg and decode(encode(msg)).settings.cpu_threads is None

    def attached(**settings_body):
        body = {**{f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}, "settings": settings_body}
        return msgpack.packb([PROTOCOL_VERSION, "attached", body], use_bin_type=True)
    assert decode(attached(workload="churn")).settings == ExecutorSettings(workload="churn")
    for bad, words in [({"max_batch": "8"}, "max_batch.*int"), ({"cuda_graph": 1}, "cuda_graph"),
                       ({"prefill_chunk": 0}, "prefill_chunk must be positive"),
                       ({"workload": "nope"}, "workload"), ({"no_cuda_graph": True}, "unknown field")]:
        with pytest.raises(WireError, match=words) as info:
            decode(attached(**bad))
        assert info.value.code == ErrorCode.BAD_FIELD
    with pytest.raises(TypeError, match="heartbeat_ms"):
        ExecutorSettings(heartbeat_ms=1.5)


def test_allowed_types_restrict_a_socket():
    with pytest.raises(WireError) as info:
        decode(encode(m.Attach(token="x", pid=1)), allowed=m.CLIENT_IN)
    assert info.value.code == ErrorCode.UNKNOWN_TYPE


def test_error_codes_map_to_typed_exceptions():
    exc = error_from_code(ErrorCode.PROMPT_TOO_LONG, "too long")
    assert isinstance(exc, InvalidParams) and exc.code == ErrorCode.PROMPT_TOO_LONG
    assert error_from_code(9999, "?").code == ErrorCode.INTERNAL


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_only_raise_wire_errors(data):
    try:
        decode(data)
    except WireError:
        pass


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=2000, deadline=None)
@given(st.sampled_from(sorted(registered_types())), st.dictionaries(
    st.sampled_from(["tag", "params", "prompt", "prompt_ids", "token", "pid", "slot", "epoch",
                     "request_id", "ids", "texts", "start", "code", "message", "x"]), _values,
    max_size=6))
def test_structured_garbage_is_rejected_or_typed(type_name, body):
    data = msgpack.packb([PROTOCOL_VERSION, type_name, body], use_bin_type=True)
    try:
        msg = decode(data)
    except WireError:
        return
    for f in dataclasses.fields(msg):  # whatever passed has the declared types
        value = getattr(msg, f.name)
        assert value is None or not isinstance(value, bytes) or "bytes" in str(f.type)


def test_nested_report_round_trips_and_is_checked():
    from kvhold.protocol.recovery_report import RecoveryReport, RequestRecovery

    report = RecoveryReport(pages_checked=3, requests_damaged=1, kv_mode="foreign", fenced_epoch=2,
                            requests=[RequestRecovery(request_id=7, klass="damaged", first_bad_page=1,
                                                      kv_kept=16, tokens_recomputed=4)])
    msg = m.Recovered(slot=0, epoch=3, report=report)
    assert decode(encode(msg)) == msg
    record = report.to_dict()
    assert record["requests"] == [{"request_id": 7, "class": "damaged", "first_bad_page": 1,
                                   "kv_kept": 16, "tokens_recomputed": 4}]
    assert "tails_dropped" not in record and record["kv_mode"] == "foreign"
    for bad in ({"requests": [{"request_id": 1}]}, {"pages_bad": "1"}, {"nope": 1}, []):
        with pytest.raises(WireError) as info:
            decode(msgpack.packb([PROTOCOL_VERSION, "recovered", {"slot": 0, "epoch": 1, "report": bad}]))
        assert info.value.code == ErrorCode.BAD_FIELD
