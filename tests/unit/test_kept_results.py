"""Results kept for pickup on disk (kvhold.frontend.kept_results): a round trip through the file,
what a damaged or half-written file becomes (set aside as `.bad`, never passed on), and Restore
loading them at its start."""
import time

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvhold.protocol import messages as m
from kvhold.protocol.state_files import StateFileError
from kvhold.frontend.kept_results import KeptRecord, KeptResults
from kvhold.frontend.restore import Unclaimed


def _kept(rid=7):
    done = m.Done(request_id=rid, finish_reason="length", prompt_tokens=3, completion_tokens=2, text="ab")
    return Unclaimed(b"\x01ipc-uid-1000", [5, 6], ["a", "b"], done, 123,
                     {"logprobs": np.array([-0.5, -1.25], dtype=np.float32), "top_ids": [[5], [6]]})


def _doc(rid=7, **changes) -> dict:
    doc = {"request_id": rid, "identity": b"\x01ipc", "ids": [5, 6], "texts": ["a", "b"],
           "done": {"request_id": rid, "finish_reason": "length", "prompt_tokens": 3, "completion_tokens": 2,
                    "text": "ab"},
           "finished_ns": 123, "logprobs": {}}
    doc.update(changes)
    return doc


def test_a_kept_result_round_trips_and_goes_when_removed(tmp_path):
    kept = KeptResults(tmp_path / "results")
    kept.save(7, _kept())
    (record,) = KeptResults(tmp_path / "results").load()
    assert record.identity == b"\x01ipc-uid-1000" and record.ids == [5, 6] and record.texts == ["a", "b"]
    assert record.done == _kept().done and record.logprobs["logprobs"] == [-0.5, -1.25]
    kept.remove(7)
    assert kept.load() == [] and not list((tmp_path / "results").iterdir())


def test_damaged_files_are_set_aside_and_half_written_ones_removed(tmp_path):
    kept = KeptResults(tmp_path)
    kept.save(1, _kept(1))
    (tmp_path / f"{2:016x}.kept").write_bytes(b"\xc1not msgpack")
    (tmp_path / f"{3:016x}.tmp").write_bytes(b"half")
    (tmp_path / f"{4:016x}.kept").write_bytes(msgpack.packb(_doc(5)))     # not the request of its name
    assert [r.request_id for r in kept.load()] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{1:016x}.kept", f"{2:016x}.kept.bad",
                                                          f"{4:016x}.kept.bad"]


@pytest.mark.parametrize("changes, reason", [
    (dict(ids="56"), "list of token ids"),
    (dict(ids=[2**63, 6]), "not in [0"),
    (dict(ids=[-5, 6]), "not in [0"),
    (dict(ids=[5, True]), "integers"),
    (dict(texts=["a"]), "1 texts for 2 token ids"),
    (dict(texts=["a", 2]), "texts"),
    (dict(request_id=-1), "request_id"),
    (dict(request_id="7"), "request_id"),
    (dict(identity="u"), "identity"),
    (dict(identity=b""), "identity"),
    (dict(done={"request_id": 7}), "done"),
    (dict(done=None), "done"),
    (dict(finished_ns=-1), "finished_ns"),
    (dict(finished_ns=1e400), "finished_ns"),
    (dict(logprobs={"logprobs": [-0.5]}), "1 logprobs for 2"),
    (dict(logprobs={"logprobs": ["x", "y"]}), "logprobs"),
    (dict(logprobs={"rm -rf": []}), "logprobs"),
    (dict(extra=1), "unknown field"),
])
def test_a_field_of_the_wrong_type_or_range_is_refused_with_its_reason(changes, reason):
    with pytest.raises(StateFileError, match=reason.replace("[", r"\[")):
        KeptRecord.from_bytes(msgpack.packb(_doc(**changes), use_bin_type=True))


def test_token_ids_past_the_vocabulary_are_refused():
    assert KeptRecord.from_bytes(msgpack.packb(_doc(), use_bin_type=True), vocab_size=7).ids == [5, 6]
    with pytest.raises(StateFileError, match="vocabulary"):
        KeptRecord.from_bytes(msgpack.packb(_doc(), use_bin_type=True), vocab_size=6)


_values = st.recursive(st.none() | st.booleans() | st.integers(min_value=-2**63, max_value=2**64 - 1)
                       | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                    max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(sorted(_doc())), value=_values)
def test_any_value_in_any_field_is_a_kept_result_or_a_state_file_error(field, value):
    """Never another exception: a damaged file can only be refused with a reason."""
    try:
        record = KeptRecord.from_bytes(msgpack.packb(_doc(**{field: value}), use_bin_type=True))
    except StateFileError:
        return
    assert all(type(t) is int and 0 <= t for t in record.ids) and len(record.texts) == len(record.ids)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=64))
def test_any_bytes_are_a_kept_result_or_a_state_file_error(data):
    try:
        KeptRecord.from_bytes(data)
    except StateFileError:
        pass


def test_restore_loads_what_a_previous_process_kept_and_sets_the_damaged_aside(tmp_path):
    from kvhold.sidecar.durable_journal import DurableJournal
    from kvhold.frontend.restore import Restore

    durable = DurableJournal(tmp_path / "journal")
    KeptResults(durable.dir / "results").save(7, _kept())
    bad = durable.dir / "results" / f"{8:016x}.kept"
    bad.write_bytes(msgpack.packb(_doc(8, ids=[2**63, 6], finished_ns=time.monotonic_ns()), use_bin_type=True))
    restore = Restore(None, durable, fingerprint="x", vocab_size=10, generation=1, started_ns=0,
                      send_client=lambda *a: True)
    restore.restore(adopting=False, readmit=False)
    assert list(restore.unclaimed) == [7] and restore.unclaimed[7].ids == [5, 6]
    assert bad.with_name(bad.name + ".bad").exists() and not bad.exists()
