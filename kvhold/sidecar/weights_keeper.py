"""The weights region's lifecycle: empty -> loading (one executor) -> sealed.

The sidecar never parses tensors itself: it sizes the region from the checkpoint
manifest, then designates exactly one attached executor as the loader (header
`weights_state=LOADING`, `weights_epoch=<its epoch>`); only that executor gets a
writable descriptor. When the loader reports the manifest fingerprint, the
region is sealed and every later executor maps it read-only and skips loading.
If the loader dies, another attached executor is designated (it sees its own
epoch in the header) or, if none, the next one to attach.
"""
from __future__ import annotations

import logging

from kvhold.protocol import messages as m
from kvhold.protocol.checkpoint import Manifest
from kvhold.protocol.errors import ErrorCode
from kvhold.protocol.layout import WeightsState
from kvhold.protocol.tables import Tables

log = logging.getLogger(__name__)


class WeightsKeeper:
    def __init__(self, tables: Tables, manifest: Manifest | None, adopted: bool = False):
        """`adopted`: the tables of a dead sidecar (kvhold.sidecar.adoption), weights already
        sealed with this manifest's fingerprint: they stay as they are, loaded once."""
        self.tables = tables
        self.manifest = manifest
        self.header = tables.header
        self.fingerprint = manifest.fingerprint if manifest else ""
        if not adopted:
            self._set(WeightsState.EMPTY if manifest else WeightsState.SEALED, 0)
        self.load_ms: float | None = None

    @property
    def state(self) -> WeightsState:
        return WeightsState(int(self.header["weights_state"]))

    def _set(self, state: WeightsState, epoch: int) -> None:
        self.header["weights_epoch"] = epoch
        self.header["weights_state"] = state

    def attach_info(self, h) -> dict:
        if self.state == WeightsState.EMPTY:
            self._designate(h)
        return {"state": self.state.name.lower(), "fingerprint": self.fingerprint,
                "manifest": self.manifest.to_wire() if self.manifest else None,
                "loader": self.may_write(h)}

    def _designate(self, h) -> None:
        self._set(WeightsState.LOADING, h.epoch)
        log.info("executor pid %d (epoch %d) loads the weights", h.pid, h.epoch)

    def may_write(self, h) -> bool:
        return self.state == WeightsState.LOADING and int(self.header["weights_epoch"]) == h.epoch

    def on_sealed(self, h, msg: m.WeightsSealed):
        if not self.may_write(h):
            return m.Error(code=ErrorCode.FENCED, message="not the designated weights loader")
        if msg.fingerprint != self.fingerprint:
            log.error("loader pid %d sealed fingerprint %s, expected %s: reloading",
                      h.pid, msg.fingerprint[:12], self.fingerprint[:12])
            self._set(WeightsState.EMPTY, 0)
            return m.Error(code=ErrorCode.BAD_FIELD, message="fingerprint mismatch")
        self.header["weights_fingerprint"] = bytes.fromhex(self.fingerprint)
        self._set(WeightsState.SEALED, h.epoch)
        self.load_ms = msg.load_ms
        log.info("weights sealed by pid %d in %.0f ms (fingerprint %s)", h.pid, msg.load_ms,
                 self.fingerprint[:12])
        return None

    def on_fenced(self, h, candidates=()) -> None:
        if self.state != WeightsState.LOADING or int(self.header["weights_epoch"]) != h.epoch:
            return
        nxt = next(iter(candidates), None)
        if nxt is not None:
            self._designate(nxt)
        else:
            self._set(WeightsState.EMPTY, 0)
            log.warning("weights loader pid %d died before sealing; the next executor reloads", h.pid)
