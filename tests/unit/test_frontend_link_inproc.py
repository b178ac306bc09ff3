"""The memory owner's in-process link end: the typed link messages, delivered by direct calls
to the frontend in the owner's process (kvhold.sidecar.frontend_link.InprocFrontendLink)."""
from __future__ import annotations

import os

import pytest

from kvhold.protocol import frontend_link as fl
from kvhold.protocol.layout import KvGeometry, TableGeometry
from kvhold.protocol.tables import Tables
from kvhold.sidecar.frontend_link import InprocFrontendLink

GEOMETRY = TableGeometry(kv=KvGeometry(1, 1, 8, "float32", 4), num_pages=16, num_slots=8,
                         max_seq_len=64, num_leases=2, max_logprobs=2)


class Peer:
    """A frontend that records what its owner delivers and answers a stop at once."""

    def __init__(self):
        self.link = None
        self.delivered = []

    def deliver(self, msg):
        self.delivered.append(msg)
        if isinstance(msg, fl.ExecutorsStopped):
            self.link.handle(InprocFrontendLink.IDENTITY, fl.InFlightJournaled(requests=3))


@pytest.fixture
def link():
    tables = Tables.create(f"/kvhold-test-inproc-link-{os.getpid()}", GEOMETRY, generation=4)
    wakes = []
    end = InprocFrontendLink(tables, wake=lambda: wakes.append(1), status=lambda: {"pid": os.getpid()})
    end.wakes = wakes
    end.peer = Peer()
    end.peer.link = end
    end.tables_name = "tables"
    yield end
    tables.unlink()


def test_the_owner_messages_arrive_as_typed_messages_within_the_call(link):
    link.handle(link.IDENTITY, fl.Hello(pid=os.getpid()))
    hello = link.peer.delivered[-1]
    assert isinstance(hello, fl.OwnerHello) and hello.generation == 4 and hello.tables == "tables"
    assert link.connected and link.wakes == [1]
    slots = [0, 2]
    link.committed(slots, 1)
    assert link.peer.delivered[-1] == fl.Committed(slots=[0, 2], recoveries=1)
    link.handle(link.IDENTITY, fl.WakeExecutor())
    assert link.wakes == [1, 1]
    link.handle(link.IDENTITY, fl.OwnerStatusQuery(tag=7))
    assert link.peer.delivered[-1] == fl.OwnerStatus(tag=7, status={"pid": os.getpid()})


def test_closures_failures_and_the_stop_go_to_the_frontend(link):
    link.handle(link.IDENTITY, fl.Hello(pid=os.getpid()))
    link.close_admissions("health", "GPU fault")
    assert link.peer.delivered[-1] == fl.AdmissionsChanged(closed={"health": "GPU fault"})
    link.open_admissions("health")
    assert link.peer.delivered[-1] == fl.AdmissionsChanged(closed={})
    link.fail_request(5, 1, "request 0x5 failed")
    assert link.peer.delivered[-1] == fl.FailRequest(request_id=5, slot=1, message="request 0x5 failed")
    assert link.journal_on_stop() == 3        # answered within the call: no wait
    link.handle(link.IDENTITY, fl.PoolRestartAsked(hold=True))
    assert link.pool_restart == fl.PoolRestartAsked(hold=True)
