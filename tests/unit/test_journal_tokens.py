"""A standby's tokens read ahead (kvhold.executor.journal_tokens) give a takeover exactly the
journal's tokens, whatever happened to the slots between the read and the takeover."""
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvhold.executor.journal_tokens import JournalTokens
from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import KvGeometry, TableGeometry
from kvhold.protocol.tables import Tables
from kvhold.protocol.sampling import SamplingParams

SLOTS, MAX_SEQ = 4, 64


@pytest.fixture
def table_geometry():
    return TableGeometry(kv=KvGeometry(2, 2, 8, "float32", 4), num_pages=16, num_slots=SLOTS, max_seq_len=MAX_SEQ,
                         num_leases=4)


class Journalled:
    """Requests admitted, taken, generating and released in a real journal."""

    def __init__(self, tables):
        self.journal = Journal(tables)
        self.next_token = 1

    def admit(self, slot: int, prompt_len: int, take: bool = True) -> None:
        rid = self.journal.new_request_id()
        prompt = list(range(self.next_token, self.next_token + prompt_len))
        self.next_token += prompt_len
        self.journal.admit(slot, rid, prompt, SamplingParams(max_tokens=40, seed=1, temperature=0.0, top_p=1.0, top_k=0))
        if take:
            self.journal.take(slot, rid, epoch=1)

    def generate(self, slot: int, n: int) -> None:
        e = self.journal.entry(slot)
        n = min(n, MAX_SEQ - 1 - e.num_tokens, e.max_tokens - e.num_generated)
        for _ in range(max(0, n)):
            e = self.journal.entry(slot)
            self.journal.commit_tokens(np.array([slot]), np.array([e.num_tokens]), np.array([self.next_token]),
                                       np.array([e.num_generated + 1]))
            self.next_token += 1

    def check(self, ahead: JournalTokens) -> None:
        for slot in range(SLOTS):
            e = self.journal.entry(slot)
            if e.taken:
                assert ahead.take(slot, e.request_id, e.num_tokens) == \
                    self.journal.all_tokens(slot, e.num_tokens).tolist()


def test_a_takeover_reads_only_what_was_committed_since_and_gets_every_token(tables):
    world = Journalled(tables)
    for slot in range(SLOTS):
        world.admit(slot, prompt_len=5 + slot)
    ahead = JournalTokens(world.journal)
    ahead.refresh()
    assert len(ahead) == SLOTS
    world.generate(0, 7)
    ahead.refresh()
    world.generate(0, 3)
    world.generate(1, 2)
    world.journal.release(2)               # slot 2 now holds another request, taken
    world.admit(2, prompt_len=9)
    world.journal.release(3)               # slot 3 another, not taken: nothing is kept for it
    world.admit(3, prompt_len=4, take=False)
    world.check(ahead)


def test_an_untaken_slot_is_not_read_ahead(tables):
    world = Journalled(tables)
    world.admit(0, prompt_len=6, take=False)
    ahead = JournalTokens(world.journal)
    ahead.refresh()
    assert len(ahead) == 0


ops = st.lists(st.tuples(st.sampled_from(["admit", "admit_untaken", "generate", "release", "refresh"]),
                         st.integers(0, SLOTS - 1), st.integers(1, 12)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_read_ahead_equals_the_journal_after_any_history(ops):
    g = TableGeometry(kv=KvGeometry(2, 2, 8, "float32", 4), num_pages=16, num_slots=SLOTS, max_seq_len=MAX_SEQ,
                      num_leases=4)
    t = Tables.create(f"/kvhold-test-{os.getpid()}-{np.random.randint(1 << 30)}", g, generation=1)
    try:
        world = Journalled(t)
        ahead = JournalTokens(world.journal)
        live = set()
        for op, slot, n in ops:
            if op.startswith("admit") and slot not in live:
                world.admit(slot, prompt_len=n, take=op == "admit")
                live.add(slot)
            elif op == "generate" and slot in live and world.journal.entry(slot).taken:
                world.generate(slot, n)
            elif op == "release" and slot in live:
                world.journal.release(slot)
                live.discard(slot)
            elif op == "refresh":
                ahead.refresh()
        world.check(ahead)
    finally:
        t.unlink()
