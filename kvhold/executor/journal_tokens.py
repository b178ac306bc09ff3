"""A hot standby's copy of the live requests' tokens, read ahead of a takeover.

A takeover rebuilds every live request as a sequence from the journal, converting each
committed token to a Python int: at 64 streams of 512-2048 tokens, ~90,000 of them and
about 3.5 ms of the takeover on a development CPU. A request's tokens in the journal only
grow while it is taken (the commit stores a token before it bumps the count, and a committed
token is never rewritten), so an idle standby reads them ahead (`refresh`, each time its
loop wakes) and the takeover reads only those committed since (`take`).

What makes a kept list safe to use: it is kept per journal slot with the request id it was
read for, and only for a slot an executor had taken (before `take`, a slot's generated count
may be a previous request's); `take` uses it only for the same slot and request id, and only
if it is no longer than the count the takeover reads, and reads the rest from the journal.
Anything else is read whole, as without this.
"""
from __future__ import annotations

import numpy as np

from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import AdmitState


class JournalTokens:
    def __init__(self, journal: Journal):
        self.journal = journal
        self._lists: dict[int, tuple[int, list[int]]] = {}    # slot -> (request id, its tokens)

    def refresh(self) -> None:
        """Read the tokens committed since the last refresh, for every taken live request."""
        r, tokens = self.journal.req, self.journal.tokens
        rid_of = r["request_id"].copy()       # read first: a slot taken by this id has its counts
        taken = (r["admit_state"] != AdmitState.FREE) & (r["exec_request_id"] == rid_of) & (rid_of != 0)
        slots = taken.nonzero()[0]
        rids = rid_of[slots]
        counts = (r["prompt_len"][slots].astype(np.int64) + r["num_generated"][slots]).tolist()
        kept, lists = self._lists, {}
        for slot, rid, n in zip(slots.tolist(), rids.tolist(), counts):
            have = kept.get(slot)
            if have is not None and have[0] == rid and len(have[1]) <= n:
                got = have[1]
                if len(got) < n:
                    got.extend(tokens[slot, len(got):n].tolist())
            else:
                got = tokens[slot, :n].tolist()
            lists[slot] = (rid, got)
        # a slot released and taken by another request while this ran: its list is dropped
        moved = (r["request_id"][slots] != rids) | (r["exec_request_id"][slots] != rids)
        for slot in slots[moved].tolist():
            del lists[slot]
        self._lists = lists

    def take(self, slot: int, request_id: int, num_tokens: int) -> list[int]:
        """The first `num_tokens` tokens of the request in `slot`, as a list the caller owns."""
        have = self._lists.pop(slot, None)
        tokens = self.journal.tokens
        if have is None or have[0] != request_id or len(have[1]) > num_tokens:
            return tokens[slot, :num_tokens].tolist()
        got = have[1]
        if len(got) < num_tokens:
            got.extend(tokens[slot, len(got):num_tokens].tolist())
        return got

    def clear(self) -> None:
        self._lists = {}

    def __len__(self) -> int:
        return len(self._lists)
