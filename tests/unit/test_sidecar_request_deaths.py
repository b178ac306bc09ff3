"""The rule that fails a request killing its executors (kvhold.sidecar.request_deaths), over real
shared tables written as the engine writes them: step marks in the journal, the open step in
the lease. A death counts against the requests in the open step; a second death fails a request
only in the re-run of its step that it had alone; one that ran past that point is a suspect anew.
A crash or a hang counts; a kill from outside (SIGKILL, SIGTERM) does not, unless the OOM killer
sent it, or the request was in the step of MAX_KILLS deaths in a row without progress."""
import os

import numpy as np

from kvhold.protocol.journal import Journal
from kvhold.protocol.leases import Lease, LeaseTable
from kvhold.sidecar.request_deaths import MAX_DEATHS, MAX_KILLS, RequestDeaths
from kvhold.protocol.sampling import SamplingParams


class World:
    """Executors that take requests, run steps and die; the sidecar's counts beside them."""

    def __init__(self, tables):
        self.tables, self.journal, self.leases = tables, Journal(tables), LeaseTable(tables)
        self.failed: list[tuple[int, int, str]] = []
        self.deaths = RequestDeaths(tables, lambda *f: self.failed.append(f))
        self.ids: dict[str, int] = {}

    def admit(self, name: str, prompt_len: int = 8) -> None:
        slot, rid = self.journal.free_slot(), self.journal.new_request_id()
        self.journal.admit(slot, rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=8, seed=1, temperature=0.0,
                                                                                     top_p=1.0, top_k=0))
        self.ids[name] = rid

    def executor(self) -> Lease:
        slot = self.leases.free_slot()
        lease = Lease(self.tables, slot, self.leases.grant(slot, os.getpid()))
        for s in self.journal.untaken_slots():
            e = self.journal.entry(int(s))
            self.journal.take(e.slot, e.request_id, lease.epoch)
        return lease

    def step(self, lease: Lease, number: int, **ranges) -> None:
        """Open step `number` with these requests computing KV [start, end)."""
        slots = {self.journal.entry(s).request_id: s for s in self.journal.live_slots().tolist()}
        names = list(ranges)
        self.journal.mark_step(np.array([slots[self.ids[n]] for n in names]), lease.epoch, number,
                               np.array([ranges[n][0] for n in names]), np.array([ranges[n][1] for n in names]))
        lease.open_step(number)

    def die(self, lease: Lease, exit_code: int = 128 + 11, hang: bool = False) -> list[str]:
        """The executor dies (by default of SIGSEGV) or hangs; what the rule fails."""
        self.leases.fence(lease.slot)
        failed = self.deaths.executor_died(lease.slot, lease.epoch, cause_known=hang)
        if not hang:
            failed += self.deaths.exit_known(lease.epoch, exit_code)
        self.leases.release(lease.slot, exit_code)     # reaped: its lease slot is free again
        return sorted(n for n, rid in self.ids.items() if rid in failed)

    def isolate(self) -> dict[str, int]:
        back = {rid: n for n, rid in self.ids.items()}
        return {back[rid]: end for rid, end in self.deaths.isolate()}


def test_the_request_that_dies_alone_again_is_failed_and_the_other_is_not(tables):
    w = World(tables)
    w.admit("good")
    w.admit("bad")
    e1 = w.executor()
    w.step(e1, 1, good=(0, 8))
    e1.open_step(0)                              # a completed step
    w.step(e1, 2, good=(8, 9), bad=(0, 8))       # the bad one joins, and the executor dies
    assert w.die(e1) == []
    assert w.isolate() == {"good": 9, "bad": 8}

    e2 = w.executor()
    w.step(e2, 1, good=(8, 9))                   # the good one's re-run alone: it survives
    e2.open_step(0)
    w.step(e2, 2, bad=(0, 8))                    # the bad one's alone: death
    assert w.die(e2) == ["bad"]
    assert MAX_DEATHS == 2
    rid, slot, message = w.failed[0]
    assert rid == w.ids["bad"] and "died 2 times" in message
    assert list(w.isolate()) == ["good"]


def test_a_suspect_that_ran_past_its_death_alone_counts_again_from_one(tables):
    w = World(tables)
    w.admit("a")
    e1 = w.executor()
    w.step(e1, 1, a=(8, 9))
    assert w.die(e1) == []
    e2 = w.executor()
    w.step(e2, 5, a=(9, 10))                     # past position 9: it had run its step alone
    assert w.die(e2) == [] and w.isolate() == {"a": 10}
    e3 = w.executor()
    w.step(e3, 1, a=(9, 10))                     # now it dies alone at 10 again
    assert w.die(e3) == ["a"]


def test_a_batched_step_before_the_isolated_one_proves_nothing(tables):
    w = World(tables)
    w.admit("a", prompt_len=20)
    w.admit("b")
    e1 = w.executor()
    w.step(e1, 1, a=(16, 20))                    # a's last prefill chunk: death
    assert w.die(e1) == []
    e2 = w.executor()
    w.step(e2, 1, a=(0, 16), b=(0, 8))           # a recomputes its first chunk with b: death
    assert w.die(e2) == []
    assert w.isolate() == {"a": 20, "b": 8}
    e3 = w.executor()
    w.step(e3, 1, a=(16, 20))                    # a alone at its chunk: second death there
    assert w.die(e3) == ["a"]


def test_a_death_between_steps_counts_against_nobody(tables):
    w = World(tables)
    w.admit("a")
    e1 = w.executor()
    w.step(e1, 1, a=(0, 8))
    e1.open_step(0)
    assert w.die(e1) == [] and w.isolate() == {}


def test_a_kill_from_outside_on_the_isolated_re_run_counts_against_nobody(tables):
    """What a supervisor killing the successor mid-takeover does: SIGKILL lands on the re-run."""
    w = World(tables)
    w.admit("a")
    e1 = w.executor()
    w.step(e1, 1, a=(8, 9))
    assert w.die(e1) == [] and w.isolate() == {"a": 9}           # a crash: a suspect
    e2 = w.executor()
    w.step(e2, 1, a=(8, 9))                                       # its isolated re-run...
    assert w.die(e2, exit_code=128 + 9) == []                     # ...SIGKILLed from outside
    assert w.isolate() == {"a": 9} and w.deaths.status()["forgiven_total"] == 1
    e3 = w.executor()
    w.step(e3, 1, a=(8, 9))
    assert w.die(e3, exit_code=128 + 15) == []                    # SIGTERM: the same
    e4 = w.executor()
    w.step(e4, 1, a=(8, 9))
    assert w.die(e4, exit_code=128 + 6) == ["a"]                  # SIGABRT there: its doing


def test_outside_kills_alone_make_no_suspect(tables):
    w = World(tables)
    w.admit("a")
    for _ in range(3):
        e = w.executor()
        w.step(e, 1, a=(8, 9))
        assert w.die(e, exit_code=128 + 9) == []
    assert w.isolate() == {}


def test_a_sigkill_from_the_oom_killer_counts(tables, monkeypatch):
    from kvhold.sidecar import request_deaths
    counter = [5]
    monkeypatch.setattr(request_deaths, "oom_kills", lambda: counter[0])
    w = World(tables)
    w.admit("a")
    e1 = w.executor()
    w.step(e1, 1, a=(8, 9))
    counter[0] += 1                                               # the kernel killed a process here
    assert w.die(e1, exit_code=128 + 9) == [] and w.isolate() == {"a": 9}
    e2 = w.executor()
    w.step(e2, 1, a=(8, 9))
    counter[0] += 1
    assert w.die(e2, exit_code=128 + 9) == ["a"]


def test_hangs_and_unknown_exits_count(tables):
    w = World(tables)
    w.admit("a")
    e1 = w.executor()
    w.step(e1, 1, a=(8, 9))
    assert w.die(e1, hang=True) == []
    e2 = w.executor()
    w.step(e2, 1, a=(8, 9))
    assert w.die(e2, exit_code=-1) == ["a"]                       # reaped elsewhere: not known


def test_a_request_sigkilled_at_the_same_place_again_and_again_is_isolated_then_failed(tables, monkeypatch):
    """Where the cgroup's OOM count cannot be read, an OOM kill is a SIGKILL like an outside one:
    forgiven, until the request has been in the step of MAX_KILLS deaths in a row without getting
    past the place; then it is isolated (with the one beside it) and its death alone fails it."""
    from kvhold.sidecar import request_deaths
    monkeypatch.setattr(request_deaths, "oom_kills", lambda: None)
    w = World(tables)
    w.admit("good")
    w.admit("bad")
    for n in range(1, MAX_KILLS):
        e = w.executor()
        w.step(e, 1, good=(8, 9), bad=(0, 8))
        assert w.die(e, exit_code=128 + 9) == [] and w.isolate() == {}, n
    e = w.executor()
    w.step(e, 1, good=(8, 9), bad=(0, 8))
    assert w.die(e, exit_code=128 + 9) == []
    assert w.isolate() == {"good": 9, "bad": 8}                   # the MAX_KILLS-th: kept
    e = w.executor()
    w.step(e, 1, good=(8, 9))                                     # alone, it survives
    e.open_step(0)
    w.step(e, 2, bad=(0, 8))                                      # alone, killed again
    assert w.die(e, exit_code=128 + 9) == ["bad"]
    rid, _, message = w.failed[0]
    assert rid == w.ids["bad"] and f"died {MAX_KILLS + 1} times in a row" in message
    assert "SIGKILL" in message and "OOM" in message
    assert w.deaths.status()["failed_total"] == 1


def test_outside_kills_with_progress_between_them_never_add_up(tables):
    """A request that gets past the place of each kill starts a new count: a soak's kills of
    every kind, however many, fail no request."""
    w = World(tables)
    w.admit("a", prompt_len=40)
    for n in range(3 * MAX_KILLS):
        e = w.executor()
        w.step(e, 1, a=(8 + n, 9 + n))                           # one token further each time
        assert w.die(e, exit_code=128 + 9) == [] and w.isolate() == {}
    for _ in range(MAX_KILLS - 1):                                # and then a few at one place
        e = w.executor()
        w.step(e, 1, a=(40, 41))
        assert w.die(e, exit_code=128 + 15) == [] and w.isolate() == {}
    assert w.deaths.status()["forgiven_total"] == 4 * MAX_KILLS - 1


def test_the_count_of_deaths_in_a_row_ends_with_its_request(tables):
    w = World(tables)
    w.admit("a")
    e = w.executor()
    w.step(e, 1, a=(8, 9))
    assert w.die(e, exit_code=128 + 9) == []
    assert list(w.deaths.streaks) == [w.ids["a"]]
    w.journal.release(w.journal.live_slots()[0])
    w.admit("b")
    e = w.executor()
    w.step(e, 1, b=(0, 8))
    w.die(e, exit_code=128 + 9)
    assert list(w.deaths.streaks) == [w.ids["b"]]
