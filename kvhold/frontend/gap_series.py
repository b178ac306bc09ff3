"""TokenGaps: the latency the clients saw, second by second, for the picture of a failover.

Each time the frontend streams a request's new tokens it notes the gap since that request's
previous tokens went out (a keepalive does not count). Per one-second bucket of
CLOCK_MONOTONIC it keeps the largest gap, the tokens streamed and how many gaps were noted,
for the last ten minutes. A failover shows as one bucket whose largest gap is the stall the
streams crossed; `kvhold failovers` draws the series with the recovery records beside it.
The status carries it (`token_gaps`); nothing else reads it.
"""
from __future__ import annotations

import collections

BUCKET_NS = 1_000_000_000
KEEP = 600                   # buckets: ten minutes


class TokenGaps:
    def __init__(self, bucket_ns: int = BUCKET_NS, keep: int = KEEP):
        self.bucket_ns = bucket_ns
        self.buckets: collections.deque = collections.deque(maxlen=keep)   # [start_ns, max_gap_ns, tokens, gaps]

    def note(self, now: int, gap_ns: int | None, tokens: int) -> None:
        """`tokens` streamed at `now`, `gap_ns` after the request's previous ones (None: its first)."""
        start = now - now % self.bucket_ns
        if not self.buckets or self.buckets[-1][0] != start:
            self.buckets.append([start, 0, 0, 0])
        b = self.buckets[-1]
        b[2] += tokens
        if gap_ns is not None:
            b[1] = max(b[1], gap_ns)
            b[3] += 1

    def status(self) -> dict:
        return {"bucket_ms": self.bucket_ns / 1e6,
                "series": [[start, round(gap / 1e6, 3), tokens, gaps] for start, gap, tokens, gaps in self.buckets]}
