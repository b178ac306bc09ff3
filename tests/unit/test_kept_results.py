"""Results kept for pickup on disk (kvhold.frontend.kept_results): a round trip through the file,
what a damaged or half-written file becomes, and Restore loading them at its start."""
import numpy as np

from kvhold.protocol import messages as m
from kvhold.frontend.kept_results import KeptResults
from kvhold.frontend.restore import Unclaimed


def _kept(rid=7):
    done = m.Done(request_id=rid, finish_reason="length", prompt_tokens=3, completion_tokens=2, text="ab")
    return Unclaimed(b"\x01ipc-uid-1000", [5, 6], ["a", "b"], done, 123,
                     {"logprobs": np.array([-0.5, -1.25], dtype=np.float32), "top_ids": [[5], [6]]})


def test_a_kept_result_round_trips_and_goes_when_removed(tmp_path):
    kept = KeptResults(tmp_path / "results")
    kept.save(7, _kept())
    (doc,) = KeptResults(tmp_path / "results").load()
    assert doc["identity"] == b"\x01ipc-uid-1000" and doc["ids"] == [5, 6] and doc["texts"] == ["a", "b"]
    assert m.Done(**doc["done"]) == _kept().done and doc["logprobs"]["logprobs"] == [-0.5, -1.25]
    kept.remove(7)
    assert kept.load() == [] and not list((tmp_path / "results").iterdir())


def test_damaged_and_half_written_files_are_dropped(tmp_path):
    kept = KeptResults(tmp_path)
    kept.save(1, _kept(1))
    (tmp_path / f"{2:016x}.kept").write_bytes(b"\xc1not msgpack")
    (tmp_path / f"{3:016x}.tmp").write_bytes(b"half")
    assert [d["request_id"] for d in kept.load()] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{1:016x}.kept"]


def test_restore_loads_what_a_previous_process_kept(tmp_path):
    from kvhold.sidecar.durable_journal import DurableJournal
    from kvhold.frontend.restore import Restore

    durable = DurableJournal(tmp_path / "journal")
    KeptResults(durable.dir / "results").save(7, _kept())
    restore = Restore(None, durable, fingerprint="x", vocab_size=10, generation=1, started_ns=0,
                      send_client=lambda *a: True)
    restore.restore(adopting=False, readmit=False)
    assert list(restore.unclaimed) == [7] and restore.unclaimed[7].ids == [5, 6]
