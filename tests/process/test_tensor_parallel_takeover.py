"""Tensor-parallel executor groups (2 ranks, gloo, real processes): a SIGKILL of either rank,
a SIGSTOP of one rank (its peer then waits in a collective) and a double fault each fence
and kill the whole active group, and the hot-standby group resumes from the group-committed
tokens: nothing lost, and every output equals an uninterrupted run's (greedy, fp32 CPU)."""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from kvhold.testing.tensor_parallel_group import FENCED_EXIT, GroupOwner, _lease, _tables

PROMPTS = [[1, 5, 9, 33, 7], [1, 100, 200], [1, 42] * 6]
MAX_NEW = 32
STEP_DELAY_S = 0.02


@pytest.fixture
def state():
    d = Path(tempfile.mkdtemp(prefix="kvh-tp-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _run(model, state: Path, world: int, standby: bool, on_tick=None, hang_s: float = 5.0):
    owner = GroupOwner.create(state, model, world, PROMPTS, MAX_NEW, standby=standby, hang_s=hang_s,
                              step_delay_s=STEP_DELAY_S)
    out = owner.run(on_tick=on_tick, timeout_s=240)
    done = owner.committed()
    assert list(done) == [len(p) + MAX_NEW for p in PROMPTS], "0 lost: every token committed"
    return owner, out


@pytest.fixture(scope="module")
def references(tiny_model, tmp_path_factory):
    """Uninterrupted runs at TP=1 and TP=2."""
    out = {}
    for world in (1, 2):
        d = Path(tempfile.mkdtemp(prefix="kvh-tpref-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        try:
            out[world] = _run(tiny_model, d, world, standby=False)[1]
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return out


def test_tp2_uninterrupted_equals_tp1(references):
    assert references[2] == references[1]


class Faults:
    """Send `sig` to rank `rank` of the active group once sequence 0 has this many committed
    generated tokens, once per entry of `plan` [(after_tokens, rank, sig)]."""

    def __init__(self, plan):
        self.plan = list(plan)
        self.sent = []

    def __call__(self, owner: GroupOwner, group) -> None:
        if not self.plan:
            return
        after, rank, sig = self.plan[0]
        fresh = not self.sent or group.epoch > self.sent[-1][0]     # one fault per group
        if fresh and owner.committed()[0] - len(PROMPTS[0]) >= after and all(p.poll() is None for p in group.procs):
            owner.fault_at = time.time()
            os.kill(group.procs[rank].pid, sig)
            self.sent.append((group.epoch, rank, sig))
            self.plan.pop(0)


@pytest.mark.parametrize("rank", [0, 1])
def test_sigkill_of_each_rank(tiny_model, state, references, rank):
    faults = Faults([(10, rank, signal.SIGKILL)])
    owner, out = _run(tiny_model, state, 2, standby=True, on_tick=faults)
    assert faults.sent == [(1, rank, signal.SIGKILL)]
    assert len(owner.takeovers) == 1 and owner.takeovers[0].resumed_s is not None
    assert out == references[2] == references[1]


def test_sigstop_of_one_rank(tiny_model, state, references):
    """The stopped rank beats no more and its peer waits in the all-reduce: the group is
    found silent, SIGKILLed whole (a stopped process too) and replaced."""
    faults = Faults([(10, 1, signal.SIGSTOP)])
    owner, out = _run(tiny_model, state, 2, standby=True, on_tick=faults, hang_s=2.0)
    assert len(owner.takeovers) == 1 and "silent" in owner.takeovers[0].reason
    assert owner.takeovers[0].detected_s >= 1.5   # silence counts from its last beat, a step before
    assert out == references[2]


def test_double_fault(tiny_model, state, references):
    """The first standby group, once active, loses a rank too; the next standby (started
    after the first takeover) resumes."""
    faults = Faults([(8, 0, signal.SIGKILL), (20, 1, signal.SIGKILL)])
    owner, out = _run(tiny_model, state, 2, standby=True, on_tick=faults)
    assert [e for e, _, _ in faults.sent] == [1, 2]
    assert len(owner.takeovers) == 2 and all(t.resumed_s is not None for t in owner.takeovers)
    assert out == references[2]


def test_fenced_group_publishes_nothing(tiny_model, state):
    """A group of an older epoch than the lease's exits at `go` without touching the tables."""
    owner = GroupOwner.create(state, tiny_model, 2, PROMPTS, 4, standby=False)
    _lease(state)[0] = 5
    stale = owner._spawn(4)
    owner._wait_ready(stale)
    before = np.array(_tables(state, owner.meta, "r"))
    for p in stale.procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    assert [p.wait(timeout=60) for p in stale.procs] == [FENCED_EXIT, FENCED_EXIT]
    assert np.array_equal(before, _tables(state, owner.meta, "r"))


def test_fault_during_takeover(tiny_model, state, references):
    """A rank of the standby group dies the moment its group takes over, before it commits
    anything: a third group (started cold, no standby was ready yet) resumes."""
    faults = Faults([(8, 0, signal.SIGKILL), (-10**9, 1, signal.SIGKILL)])
    owner, out = _run(tiny_model, state, 2, standby=True, on_tick=faults)
    assert [e for e, _, _ in faults.sent] == [1, 2]
    assert len(owner.takeovers) == 2
    assert owner.takeovers[0].resumed_s is None and owner.takeovers[1].resumed_s is not None
    assert out == references[2]
