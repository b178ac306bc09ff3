"""The journal's vectorised reads for streaming (`Journal.stream_reads`) say what its scalar reads
say (`progress`, `asked_logprobs`, `lp_done`) for every slot, over random journal states; and
`logprob_stream.sendable_from` decides as `sendable` does."""
import os

import numpy as np
import pytest

from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import ExecState, FinishReason, KvGeometry, TableGeometry
from kvhold.protocol.tables import Tables
from kvhold.frontend import logprob_stream

GEOMETRY = TableGeometry(kv=KvGeometry(1, 1, 8, "float32", 4), num_pages=16, num_slots=32,
                         max_seq_len=64, num_leases=2, max_logprobs=4)


@pytest.fixture
def journal():
    t = Tables.create(f"/kvhold-test-reads-{os.getpid()}", GEOMETRY, generation=1)
    yield Journal(t)
    t.unlink()


def scramble(journal: Journal, rng) -> list[int]:
    """Random execution and admission halves; the request ids each slot's reader expects."""
    r, n = journal.req, len(journal.req)
    r["request_id"] = rng.integers(1, 6, n)
    r["exec_request_id"] = np.where(rng.random(n) < 0.7, r["request_id"], rng.integers(0, 6, n))
    r["exec_state"] = rng.integers(0, 3, n)
    r["num_generated"] = rng.integers(0, 40, n)
    r["finish_reason"] = rng.integers(0, 6, n)
    r["prompt_len"] = rng.integers(1, 20, n)
    r["logprobs"] = rng.integers(0, 6, n) * (rng.random(n) < 0.5)
    r["prompt_logprobs"] = rng.integers(0, 6, n) * (rng.random(n) < 0.5)
    r["lp_done"] = rng.integers(0, 60, n)
    return [int(x) if rng.random() < 0.8 else int(rng.integers(1, 6)) for x in r["request_id"]]


@pytest.mark.parametrize("seed", range(20))
def test_stream_reads_equal_the_scalar_reads(journal, seed):
    rng = np.random.default_rng(seed)
    expected = scramble(journal, rng)
    slots = rng.permutation(len(journal.req))[:rng.integers(1, len(journal.req) + 1)]
    reads = journal.stream_reads(slots.astype(np.int64))
    for k, slot in enumerate(slots.tolist()):
        rid = expected[slot]
        assert reads.request_id[k] == journal.request_id_at(slot)
        assert reads.progress(k, rid) == journal.progress(slot, rid)
        assert all(type(x) is type(y) for x, y in zip(reads.progress(k, rid), journal.progress(slot, rid)))
        assert reads.asked_logprobs(k) == journal.asked_logprobs(slot)
        assert reads.lp_done_of(k, rid) == journal.lp_done(slot, rid)
        assert reads.prompt_len[k] == int(journal.req["prompt_len"][slot])
        state, count, _ = journal.progress(slot, rid)
        p = reads.prompt_len[k]
        finished = state == ExecState.FINISHED
        assert logprob_stream.sendable_from(reads.asked_logprobs(k), reads.lp_done_of(k, rid), p, count,
                                            finished) == logprob_stream.sendable(journal, slot, rid, p, count, finished)
        assert journal.generated(slot, 0, count % 20, p) == journal.generated(slot, 0, count % 20)
        assert logprob_stream.fields(journal, slot, p, 0, count % 20, reads.asked_logprobs(k)) == \
            logprob_stream.fields(journal, slot, p, 0, count % 20)


def test_a_bad_state_raises_as_the_scalar_read_does(journal):
    journal.req["request_id"][0] = journal.req["exec_request_id"][0] = 7
    journal.req["exec_state"][0] = 9
    with pytest.raises(ValueError):
        journal.progress(0, 7)
    with pytest.raises(ValueError):
        journal.stream_reads(np.array([0])).progress(0, 7)
    journal.req["exec_state"][0] = ExecState.FINISHED
    journal.req["finish_reason"][0] = FinishReason.STOP
    assert journal.stream_reads(np.array([0])).progress(0, 7) == (ExecState.FINISHED, 0, FinishReason.STOP)
