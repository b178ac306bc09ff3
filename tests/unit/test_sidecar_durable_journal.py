"""The durable journal's files: admission segments written by the group commit, request files,
ended marks, what `load()` restores (old request files included) and what a refused write
leaves behind (nothing)."""
import errno
import os
import threading
import time

import pytest

from kvhold.sidecar import durable_journal as dj
from kvhold.sidecar.durable_journal import DurableJournal, GroupCommit, encode_record


def body(rid: int, **extra) -> dict:
    return {"request_id": rid, "generation": 1, "client": "7501", "prompt_ids": [1, 2, rid % 500 + 3],
            "generated": [], "stop_ids": [], "max_tokens": 4, "seed": rid, "top_k": 0,
            "temperature": 0.5, "top_p": 1.0, **extra}


def names(d: DurableJournal) -> list[str]:
    return sorted(p.name for p in d.dir.iterdir() if p.is_file())


def test_a_batch_is_one_segment_and_restores(tmp_path):
    d = DurableJournal(tmp_path / "j")
    name = d.write_batch([body(1), body(2), body(3)])
    d.committed(name, [1, 2, 3])
    assert names(d) == [name] and name.startswith("seg-") and name.endswith(".jsonl")
    d.remove(2)                                    # ended: marked, the segment stays for 1 and 3
    assert names(d) == sorted([name, name.replace(".jsonl", ".ended")])
    good, failed = DurableJournal(tmp_path / "j").load()
    assert good == [body(1), body(3)] and not failed


def test_a_segment_goes_when_its_last_request_ends(tmp_path):
    d = DurableJournal(tmp_path / "j")
    d.committed(d.write_batch([body(1), body(2)]), [1, 2])
    d.remove(1)
    d.remove(2)
    assert names(d) == []
    assert DurableJournal(tmp_path / "j").load() == ([], [])


def test_a_restarted_journal_keeps_track_of_restored_segments(tmp_path):
    d = DurableJournal(tmp_path / "j")
    first = d.write_batch([body(1), body(2)])
    d.committed(first, [1, 2])
    again = DurableJournal(tmp_path / "j")        # the next start
    good, _ = again.load()
    assert [b["request_id"] for b in good] == [1, 2]
    second = again.write_batch([body(3)])          # numbering continues after the old segment
    assert second > first
    again.committed(second, [3])
    again.remove(1)
    again.remove(2)
    assert names(again) == [second]


def test_a_request_file_supersedes_the_admission_record(tmp_path):
    d = DurableJournal(tmp_path / "j")
    d.committed(d.write_batch([body(1), body(2)]), [1, 2])
    d.write(body(1, generated=[7, 8], state="drained"))        # a drain, with its tokens
    again = DurableJournal(tmp_path / "j")
    good, _ = again.load()
    assert good == [body(1, generated=[7, 8], state="drained"), body(2)]
    again.remove(1)                        # both of its records go: a crash now must not bring it back
    assert [b["request_id"] for b in DurableJournal(tmp_path / "j").load()[0]] == [2]


def test_old_request_files_are_read(tmp_path):
    directory = tmp_path / "j"
    directory.mkdir()
    old = body(5, generated=[9])
    (directory / "req-0000000000000005.json").write_bytes(encode_record(old))   # version 1, one file
    d = DurableJournal(directory)
    assert d.load() == ([old], [])
    d.remove(5)
    assert names(d) == []


def test_a_damaged_line_fails_alone(tmp_path):
    d = DurableJournal(tmp_path / "j")
    name = d.write_batch([body(1), body(2), body(3)])
    path = d.dir / name
    lines = path.read_bytes().split(b"\n")
    lines[1] = lines[1].replace(b'"seed": 2', b'"seed": 3')       # one record damaged on disk
    path.write_bytes(b"\n".join(lines))
    again = DurableJournal(tmp_path / "j")
    good, failed = again.load()
    assert [b["request_id"] for b in good] == [1, 3]
    assert [(f.request_id, f.reason) for f in failed] == [(2, "checksum mismatch (the record was damaged on disk)")]
    kept = d.dir / "failed" / f"{name[:-len('.jsonl')]}-1.bad"
    assert kept.read_bytes() == lines[1] and kept.with_suffix(".reason").exists()


def test_fail_moves_a_segment_record_alone(tmp_path):
    d = DurableJournal(tmp_path / "j")
    d.committed(d.write_batch([body(1), body(2)]), [1, 2])
    again = DurableJournal(tmp_path / "j")
    again.load()
    rec = again.fail(again.path_for(1), 1, "the model changed")       # as Restore does
    again.restored()
    assert rec.path.endswith("failed/req-0000000000000001.json")
    assert (tmp_path / "j" / "failed" / "req-0000000000000001.json").exists()
    assert [b["request_id"] for b in DurableJournal(tmp_path / "j").load()[0]] == [2]


@pytest.mark.parametrize("call", ["write_batch", "write"])
def test_a_refused_write_leaves_no_temporary_file(tmp_path, monkeypatch, call):
    d = DurableJournal(tmp_path / "j")
    real_write = os.write

    def full(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(dj.os, "write", full)
    with pytest.raises(OSError, match="No space left"):
        d.write_batch([body(1)]) if call == "write_batch" else d.write(body(1))
    assert names(d) == []


def test_group_commit_takes_what_queued_while_it_wrote(tmp_path, monkeypatch):
    d = DurableJournal(tmp_path / "j")
    done: list = []
    gate, writing = threading.Event(), threading.Event()
    real = d.write_batch

    def slow_disk(bodies):
        writing.set()
        gate.wait(10)
        return real(bodies)

    monkeypatch.setattr(d, "write_batch", slow_disk)
    commit = GroupCommit(d, lambda name, ids, error: done.append((name, ids, error)))
    commit.submit(body(1))
    assert writing.wait(10)
    for rid in range(2, 65):                   # arrive while the first batch is on its way to disk
        commit.submit(body(rid))
    gate.set()
    deadline = time.monotonic() + 10
    while sum(len(ids) for _, ids, _ in done) < 64 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [ids for _, ids, _ in done] == [[1], list(range(2, 65))]     # two batches for 64
    assert all(error is None for _, _, error in done)
    assert commit.close() == []


def test_group_commit_reports_a_refused_batch(tmp_path, monkeypatch):
    d = DurableJournal(tmp_path / "j")
    done: list = []

    def refuse(bodies):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(d, "write_batch", refuse)
    commit = GroupCommit(d, lambda name, ids, error: done.append((name, ids, error)))
    commit.submit(body(1))
    deadline = time.monotonic() + 10
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
    commit.close()
    assert done[0][:2] == (None, [1]) and done[0][2].errno == errno.ENOSPC


def test_a_request_end_costs_the_caller_no_file_operation(tmp_path, monkeypatch):
    """With a group commit, `remove` only does the bookkeeping: the ended mark and the unlink
    run on the commit's thread, after the batch they came with; `close` runs what is queued."""
    d = DurableJournal(tmp_path / "j")
    done: list = []
    commit = GroupCommit(d, lambda name, ids, error: done.append((name, ids)))
    for rid in (1, 2, 3):
        commit.submit(body(rid))
        assert commit.wait_idle()
    for name, ids in done:
        d.committed(name, ids)
    caller, seen = threading.get_ident(), []
    real_open, real_unlink = os.open, os.unlink

    def watch(real):
        return lambda *a, **k: (seen.append(threading.get_ident()), real(*a, **k))[1]

    monkeypatch.setattr(os, "open", watch(real_open))
    monkeypatch.setattr(os, "unlink", watch(real_unlink))
    gate = threading.Event()
    commit._defer(lambda: gate.wait(10))          # hold the thread: the next ops queue behind
    d.remove(1)                                   # its segment goes
    assert seen == [] and len(names(d)) == 3      # nothing done on the caller's thread yet
    gate.set()
    assert commit.wait_idle() and len(names(d)) == 2
    assert seen and caller not in seen
    gate.clear()
    commit._defer(lambda: gate.wait(0.2))
    d.remove(2)
    assert commit.close() == []                   # the queued unlink is run, not lost
    assert [n for n in names(d)] == [done[2][0]]
    monkeypatch.undo()
    assert [b["request_id"] for b in DurableJournal(tmp_path / "j").load()[0]] == [3]
