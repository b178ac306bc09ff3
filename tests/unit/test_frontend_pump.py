"""The frontend's token pump from vectorised journal reads: each stream gets exactly the tokens
committed, in order, each once, then its Done; slot numbers outside the journal, repeated slots
and slots of no stream are ignored; log-probs are held back until final; a failed stream only
releases its slot."""
import os
import types

import numpy as np
import pytest

from kvhold.protocol import messages as m
from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import AdmitState, FinishReason, KvGeometry, TableGeometry
from kvhold.protocol.tables import Tables
from kvhold.sidecar.durable_journal import DurableJournal
from kvhold.frontend.frontend import Frontend
from kvhold.sidecar.timeline import RecoveryTimeline
from kvhold.testing.frontend_host import FrontendHost
from kvhold.protocol.sampling import SamplingParams

GEOMETRY = TableGeometry(kv=KvGeometry(1, 1, 8, "float32", 4), num_pages=16, num_slots=8,
                         max_seq_len=64, num_leases=2, max_logprobs=2)


class Host(FrontendHost):
    def send_client(self, key, msg, connection=0):
        super().send_client(key, msg)
        return True                      # sent: the stream goes on


@pytest.fixture
def fe(tmp_path):
    t = Tables.create(f"/kvhold-test-pump-{os.getpid()}", GEOMETRY, generation=1)
    f = Frontend(t, types.SimpleNamespace(vocab_size=512), None, runs_model=True,
                 durable=DurableJournal(tmp_path / "j"), fingerprint="f", timeline=RecoveryTimeline(),
                 host=Host())
    yield f
    t.unlink()


def open_streams(fe, n, logprobs=None):
    j = fe.journal
    out = []
    for i in range(n):
        slot, rid = j.free_slot(), j.new_request_id()
        j.admit(slot, rid, [1, 2, 3], SamplingParams(max_tokens=20, seed=1, temperature=0.0, top_p=1.0, top_k=0,
                                                     logprobs=logprobs))
        fe._open_stream(rid, slot, b"u%d" % (i % 2), [1, 2, 3], ())
        j.take(slot, rid, epoch=1)
        out.append((slot, rid))
    return out


def commit(j: Journal, streams, step, lp=False):
    slots = np.array([s for s, _ in streams], dtype=np.int64)
    pos = np.full(len(slots), 3 + step, dtype=np.int64)
    logprobs = None
    if lp:
        logprobs = (slots, pos, np.full(len(slots), -0.5, np.float32), np.ones((len(slots), 2), np.int32),
                    np.full((len(slots), 2), -0.25, np.float32), pos + 1)
    j.commit_tokens(slots, pos, (slots * 10 + step).astype(np.int32), np.full(len(slots), step + 1), logprobs)


def events(fe):
    sent, fe.host.sent = fe.host.sent, []
    return [(key, msg) for key, msg in sent]


def test_each_token_once_in_order_then_done(fe):
    streams = open_streams(fe, 4)
    j = fe.journal
    for step in range(3):
        commit(j, streams, step)
        slots = [s for s, _ in streams]
        fe.on_committed(slots + slots[:2] + [-1, len(j.req), 10 ** 30])    # repeats, and no slot
        got = events(fe)
        assert [(msg.request_id, msg.start, msg.ids) for _, msg in got] == [
            (rid, step, [slot * 10 + step]) for slot, rid in streams]
        assert [key for key, _ in got] == [b"u%d" % (i % 2) for i in range(4)]
    fe.on_committed([s for s, _ in streams])          # nothing new: nothing sent
    assert events(fe) == []
    for slot, _ in streams:
        j.finish(slot, FinishReason.STOP)
    fe.on_committed([s for s, _ in streams[::-1]])
    got = events(fe)
    assert [(type(msg), msg.request_id) for _, msg in got] == [(m.Done, rid) for _, rid in streams[::-1]]
    assert all(msg.completion_tokens == 3 and msg.finish_reason == "stop" for _, msg in got)
    assert not fe.streams and j.num_free_slots() == len(j.req)


def test_the_safety_net_pumps_every_stream_and_a_failed_one_only_releases(fe):
    streams = open_streams(fe, 3)
    j = fe.journal
    commit(j, streams, 0)
    fe.fail_request(streams[1][1], streams[1][0], "boom")
    fe._pump_all()                                       # the safety net (tick): no StepDone at all
    got = events(fe)
    assert [(type(msg), msg.request_id) for _, msg in got] == [
        (m.Error, streams[1][1]), (m.Tokens, streams[0][1]), (m.Tokens, streams[2][1])]
    j.finish(streams[1][0], FinishReason.CANCELLED)
    fe.on_committed([streams[1][0]])
    assert events(fe) == [] and streams[1][1] not in fe.streams
    assert j.req["admit_state"][streams[1][0]] == AdmitState.FREE


def test_tokens_wait_for_their_final_logprobs(fe):
    streams = open_streams(fe, 2, logprobs=2)
    j = fe.journal
    commit(j, streams, 0, lp=True)
    j.req["lp_done"][streams[1][0]] = 3                   # the second's log-probs not final yet
    fe.on_committed([s for s, _ in streams])
    got = events(fe)
    assert [(msg.request_id, msg.ids, msg.logprobs, msg.top_ids) for _, msg in got] == [
        (streams[0][1], [streams[0][0] * 10], [-0.5], [[1, 1]])]
    j.req["lp_done"][streams[1][0]] = 4
    fe.on_committed([streams[1][0]])
    assert [(msg.request_id, msg.top_logprobs) for _, msg in events(fe)] == [(streams[1][1], [[-0.25, -0.25]])]
