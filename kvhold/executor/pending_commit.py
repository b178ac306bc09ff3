"""PendingCommit: a decode step's commit, published while the next step runs on the GPU.

A decode step's commit (DESIGN.md s3) is host work on shared memory: the pages' new
(count, checksum) under the seqlock, the sampled tokens and generated counts in the
journal, then the finished requests. Done between two steps it leaves the GPU idle for
that long (2-4% of a Llama-3-8B step at batch 64). So Engine.step splits it:

* at once, after the read-back: the engine's own state advances (counts and checksums it
  keeps per page, each sequence's tokens, finished sequences leave the scheduler) and
  what is to be published is computed, into a PendingCommit;
* the next step schedules and queues its forward, then publishes the PendingCommit in
  the original order (pages, journal, finished), while the device computes.

Nothing a client or a successor can see changes order: a token still reaches the
journal only after the KV slots it follows are published, and the next step's writes
go to slots beyond the published counts (or to new pages). If the executor dies with a
commit pending, the successor finds the step's KV slots unpublished and its token not
in the journal, and recomputes both, exactly as for a death just before a commit.
Pages of a sequence with a commit pending are never freed before it is published:
finished sequences are freed by the publication itself, which comes before the next
schedule when any finished (their pages are free for it, as without the pipeline); the
scheduler publishes before it would preempt (Scheduler.on_preempt), and so do
cancellations, steps that are not decode-only (they take the general commit path) and a
step with nothing to run. The lease is checked before the pages and again before the
journal, as in the unpipelined commit.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvhold.executor.sequence import Sequence
from kvhold.protocol.layout import FinishReason


@dataclass(slots=True)
class PendingCommit:
    """Also the second half of an immediate commit, whose pages went out first (pages None)."""
    pages: np.ndarray | None        # int64: pages whose committed range grows by one slot
    counts: np.ndarray | None       # uint32: their new token counts
    checksums: np.ndarray | None    # uint64: their new checksums
    slots: np.ndarray               # int64: journal slots that sampled a token
    positions: np.ndarray           # int64: where each token goes in its slot's token row
    tokens: np.ndarray              # int32
    generated: np.ndarray           # uint32: each slot's generated count, this token included
    finished: list[tuple[Sequence, FinishReason]]
