"""The frontend's admission order, driven in process as the sidecar's loop drives it (real
tables in shared memory, a real durable journal on disk, the real group-commit thread): a
request is acknowledged and enters the shared-memory journal only once its batch is on disk;
admissions closed meanwhile refuse it and drop its record; a stop answers every admission
still on its way."""
import os
import threading

import pytest

from kvhold.protocol import messages as m
from kvhold.protocol.errors import ErrorCode
from kvhold.protocol.model_spec import ModelSpec
from kvhold.protocol.tables import Tables
from kvhold.sidecar.config import PoolConfig, SidecarConfig
from kvhold.sidecar.durable_journal import DurableJournal
from kvhold.frontend.frontend import Frontend
from kvhold.sidecar.timeline import RecoveryTimeline
from kvhold.testing.frontend_host import FrontendHost

PARAMS = {"max_tokens": 4, "temperature": 0.0}


@pytest.fixture
def frontend(tiny_model, tmp_path):
    spec = ModelSpec.from_dir(tiny_model)
    geometry = SidecarConfig(pool=PoolConfig(model=tiny_model, max_seq_len=256, kv_pages=64)).table_geometry(spec)
    tables = Tables.create(f"/kvhold-test-adm-{os.getpid()}", geometry, generation=1)
    host = FrontendHost()
    durable = DurableJournal(tmp_path / "journal")
    fe = Frontend(tables, spec, tiny_model, runs_model=True, durable=durable, fingerprint="f",
                  timeline=RecoveryTimeline(), host=host)
    fe.host_ = host
    host.frontend = fe
    yield fe
    fe.finish_pending()
    tables.close()
    tables.unlink()


def slow_disk(fe, monkeypatch) -> threading.Event:
    """Batches wait for the returned event before they are written."""
    gate = threading.Event()
    real = fe.durable.write_batch
    monkeypatch.setattr(fe.durable, "write_batch", lambda bodies: gate.wait(10) and real(bodies))
    return gate


def files(fe, settled: bool = False) -> list[str]:
    if settled:
        assert fe.commit.wait_idle()              # ended marks and unlinks run on its thread
    return sorted(p.name for p in fe.durable.dir.iterdir() if p.name.startswith("seg-"))


def test_acknowledged_only_once_on_disk(frontend, monkeypatch):
    fe, host = frontend, frontend.host_
    gate = slow_disk(fe, monkeypatch)
    free = fe.journal.num_free_slots()
    assert fe.handle(b"uA", m.Generate(tag=1, params=PARAMS, prompt_ids=[5, 6, 7])) is None
    assert fe.handle(b"uA", m.Generate(tag=2, params=PARAMS, prompt="Once upon a time")) is None
    host.run_posted()                            # the text prompt's tokens are back
    assert host.sent == [] and fe.journal.num_free_slots() == free and files(fe) == []
    assert fe.status()["admissions"]["writing"] == 2
    gate.set()
    while len(host.sent) < 2:
        host.run_posted()
    accepted = [msg for _, msg in host.sent]
    assert [type(a) for a in accepted] == [m.Accepted, m.Accepted] and {a.tag for a in accepted} == {1, 2}
    assert fe.journal.num_free_slots() == free - 2 and len(fe.streams) == 2
    assert len(files(fe)) >= 1                   # on disk before anyone was told


def test_admissions_closed_meanwhile_refuse_and_drop_the_record(frontend, monkeypatch):
    fe, host = frontend, frontend.host_
    gate = slow_disk(fe, monkeypatch)
    free = fe.journal.num_free_slots()
    assert fe.handle(b"uA", m.Generate(tag=1, params=PARAMS, prompt_ids=[5, 6, 7])) is None
    fe.close_admissions("health", "a GPU fault")
    gate.set()
    host.run_posted()
    assert [(type(msg), msg.code, msg.tag) for _, msg in host.sent] == [(m.Error, ErrorCode.SHUTTING_DOWN, 1)]
    assert fe.journal.num_free_slots() == free and not fe.streams
    assert files(fe, settled=True) == []          # the record written meanwhile is gone again


def test_a_stop_answers_every_admission_on_its_way(frontend, monkeypatch):
    fe, host = frontend, frontend.host_
    gate = slow_disk(fe, monkeypatch)
    fe.handle(b"uA", m.Generate(tag=1, params=PARAMS, prompt_ids=[5, 6, 7]))     # being written
    fe.handle(b"uB", m.Generate(tag=2, params=PARAMS, prompt_ids=[5, 6, 8]))     # queued behind it
    fe.handle(b"uC", m.Generate(tag=3, params=PARAMS, prompt="x" * 200_000))      # tokenizing
    threading.Timer(0.2, gate.set).start()
    fe.finish_pending()
    answers = sorted((key, msg.tag, msg.code) for key, msg in host.sent)
    assert answers == [(b"uA", 1, ErrorCode.SHUTTING_DOWN), (b"uB", 2, ErrorCode.SHUTTING_DOWN),
                       (b"uC", 3, ErrorCode.SHUTTING_DOWN)]
    assert files(fe, settled=True) == [] and not fe.pending and not fe.streams
