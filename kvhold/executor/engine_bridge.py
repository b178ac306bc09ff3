"""What an engine bridge's workload shares, whatever the engine (vLLM, TensorRT-LLM).

A bridged engine owns its KV pool and its scheduler; kvhold drives it from the journal and
protects its KV with a mirror (kvhold.executor.kv_mirror), which the engine's KV connector
feeds. Every bridge does the same around its engine, and `BridgeWorkload` does it once:
* admission: each journal request no executor has taken is taken under this executor's
  epoch; one the client cancelled while queued is finished at once, one that sets a sampling
  field the engine cannot honour (`unsupported`; the sidecar refuses those at admission when
  it knows the workload, kvhold.protocol.settings.UNSUPPORTED_SAMPLING) is finished with
  ERROR and logged, every other one is submitted to the engine (`_submit`, the bridge's own);
* a submission's output is cumulative over that submission, which began after `offsets[slot]`
  tokens were already journaled (they are part of its prompt): `_new_tokens` is what it adds;
* tokens are journaled one at a time (`_append_token`, with their log-probs where the bridge
  has them), the journal's page list names the mirrored prefix of the request's KV
  (`list_mirrored_pages`), and a request ends with the commit rule's order: reason, then the
  page list emptied, then the mirror's records released (`_end_request`);
* takeover: the live requests are the taken, unfinished journal entries (`_live_entries`);
  the mirror's intact prefix of each is planned (`_plan_restore`) and the journal's page list
  becomes that prefix before the request is resubmitted.
A bridge whose connector runs on an engine thread of its own guards the mirror with
`mirror_lock`. The connector module, which the engine (not kvhold) imports and constructs by
name, reaches the executor's state through an `Installed` holder the workload fills first.
"""
from __future__ import annotations

import contextlib
import logging
import math
from typing import Generic, TypeVar

import numpy as np

from kvhold.executor.engine_workload import EngineWorkload
from kvhold.protocol.layout import AdmitState, ExecState, FinishReason

log = logging.getLogger(__name__)
T = TypeVar("T")


class Installed(Generic[T]):
    """The one bridge state of this process, installed by the workload before the engine is
    built, found by the connector classes the engine constructs; `missing` says how to run it."""

    def __init__(self, missing: str):
        self.value: T | None = None
        self.missing = missing

    def install(self, value: T | None) -> None:
        self.value = value

    def current(self) -> T:
        if self.value is None:
            raise RuntimeError(self.missing)
        return self.value


def list_mirrored_pages(journal, mirror, slot: int, request_id: int, before_write=None) -> int:
    """Journal page list := the kvhold pages of the request's mirrored prefix: the pages the
    mirror assigned since the list was last written are appended (`before_write()` first,
    e.g. a lease check). Where the mirror replaced pages the list names (a block served by a
    shared page: KvMirror.settle_full), the list is written again from the first of them, and
    only then does the mirror let the replaced pages go. Returns how many were written."""
    listed = journal.num_pages(slot)
    first = min(listed, mirror.relist.get(request_id, listed))
    new = []
    while (page := mirror.page_of(request_id, first + len(new))) is not None:
        new.append(page)
    if new:
        if before_write is not None:
            before_write()
        journal.set_pages(slot, new, first)
    if request_id in mirror.relist:
        mirror.relisted(request_id)
    return len(new)


class BridgeWorkload(EngineWorkload):
    """An executor workload over an engine that owns its KV pool (module docstring).

    The bridge sets `journal` and `bridge` (whose `mirror` is the KvMirror) in `prepare` and
    implements `_submit(entry)`, which hands the engine the entry's tokens and records the
    submission with `_track`."""

    cold_first_step = True
    unsupported: tuple[str, ...] = ()       # SamplingParams fields the engine cannot honour

    def __init__(self, ctx):
        super().__init__(ctx)
        self.live: dict[int, object] = {}       # journal slot -> the engine's handle of its submission
        self.offsets: dict[int, int] = {}       # journal slot -> tokens generated before that submission

    def mirror_lock(self):
        """Held around what reads or changes the mirror's records (a bridge whose connector
        runs on another thread returns its lock)."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ admission
    def _submit(self, entry) -> None:
        raise NotImplementedError

    def _track(self, entry, handle) -> None:
        self.live[entry.slot] = handle
        self.offsets[entry.slot] = entry.num_generated

    def _admit(self) -> None:
        for slot in self.journal.untaken_slots():
            e = self.journal.entry(int(slot))
            self.ctx.lease.check()
            self.journal.take(e.slot, e.request_id, self.ctx.epoch)
            if e.admit_state == AdmitState.CANCELLED:
                self.journal.finish(e.slot, FinishReason.CANCELLED)
            elif (name := e.sampling.first_set(self.unsupported)) is not None:
                log.error("request %#x refused: this engine does not support %s", e.request_id, name)
                self.journal.finish(e.slot, FinishReason.ERROR)
            else:
                self._submit(self.journal.entry(e.slot))

    def has_work(self) -> bool:
        return bool(self.live) or len(self.journal.untaken_slots()) > 0

    # ------------------------------------------------------------------ commit
    def _new_tokens(self, slot: int, tokens: list[int]):
        """(journal entry, the tokens of the submission's cumulative output not journaled yet)."""
        e = self.journal.entry(slot)
        return e, list(tokens[e.num_generated - self.offsets[slot]:])

    def _append_token(self, slot: int, e, token: int, logprobs=None):
        """Journal one generated token after entry `e`'s, with its log-probs when given
        (`logprobs`: its log-prob [1], rank [1], top ids [1, k], top log-probs [1, k], stored
        before the count, as Journal.commit_tokens does); returns the entry as it is now."""
        self.ctx.lease.check()
        pos = np.array([e.num_tokens], dtype=np.int64)
        lp = None
        if logprobs is not None:
            value, rank, top_ids, top_lps = logprobs
            lp = (np.array([slot], dtype=np.int64), pos, value, top_ids, top_lps,
                  np.array([e.num_tokens + 1], dtype=np.uint32), rank)
        self.journal.commit_tokens(np.array([slot]), pos, np.array([token], dtype=np.int32),
                                   np.array([e.num_generated + 1], dtype=np.uint32), lp)
        return self.journal.entry(slot)

    def _list_pages(self, slot: int, request_id: int) -> None:
        list_mirrored_pages(self.journal, self.bridge.mirror, slot, request_id, self.ctx.lease.check)

    def _end_request(self, slot: int, request_id: int, reason: FinishReason) -> None:
        """Finish the request: its reason, then the page list shrinks, then the mirror's
        records of it clear (a takeover in between finds no listed page of another owner)."""
        self.ctx.lease.check()
        self.journal.finish(slot, reason)
        self.journal.set_num_pages(slot, 0)
        self.bridge.mirror.release(request_id)
        self.live.pop(slot, None)
        self.offsets.pop(slot, None)

    # ------------------------------------------------------------------ takeover
    def _live_entries(self) -> list:
        """The journal requests a dead executor had taken and not finished."""
        return [e for e in map(self.journal.entry, map(int, self.journal.live_slots()))
                if e.taken and e.exec_state != ExecState.FINISHED]

    def _plan_restore(self, entries, pending_epochs, full_blocks_only: bool = False) -> dict:
        """Validate the mirrored pages of `entries` (KvMirror.plan_restore: up to the block of
        each one's last journaled token, which is the next input) and list each one's intact
        prefix as its journal pages."""
        bt = self.ctx.tables.geometry.kv.page_tokens
        with self.mirror_lock():
            plans = self.bridge.mirror.plan_restore(
                {e.request_id: math.ceil(max(0, e.num_tokens - 1) / bt) for e in entries},
                pending_epochs, full_blocks_only=full_blocks_only,
                listed={e.request_id: self.journal.pages_of(e.slot, self.journal.num_pages(e.slot))
                        for e in entries})
        for e in entries:
            self.ctx.lease.check()
            self.journal.set_pages(e.slot, list(plans[e.request_id].pages))   # the kept prefix only
        return plans

    # ------------------------------------------------------------------ workload interface
    def flush(self) -> list[int]:
        return []                 # every step commits at once: nothing is left pending

    def take_marks(self) -> dict:
        return {}                 # the engine's step is not split into kvhold's parts

    def take_step_tokens(self) -> list[int]:
        return []                 # the engine's scheduler is its own

    def on_reaped(self, epochs) -> None:
        with self.mirror_lock():
            released = self.bridge.mirror.release_quarantined(epochs)
        if released:
            log.info("released %d quarantined pages of exited epochs %s", released, list(epochs))
