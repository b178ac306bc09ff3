"""Where health signals come from: NVML on a real GPU, or a JSON recording replayed.

A source turns device state into `HealthSignal`s and knows nothing of actions
(that is `kvhold.sidecar.health.EscalationPolicy`). Every source has `start()` (may raise
`HealthSourceError`; `poll` calls it if nobody did), `poll(timeout_s)` (blocks at
most about `timeout_s`, returns the signals seen, never busy-returns), `describe()`
(a JSON-serialisable dict, safe from any thread) and an idempotent `close()`.
Recording format (`RecordedSource`): a JSON list of {"t": seconds from start(), "kind": one of
SIGNAL_KINDS, "detail": {...} (optional), "note": str (optional)}, t non-decreasing.
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)
# The clock of kvhold.protocol.leases.now_ns(), without importing the shm tables (and posix_ipc) with it.
now_ns = time.monotonic_ns
SIGNAL_KINDS = ("xid", "ecc_dbe", "remap_pending", "remap_failure", "pcie_degraded",
                "gpu_lost", "nvml_error")
MAX_XIDS_PER_POLL = 64          # bounds one poll during an Xid storm; the rest wait for the next
_ENTRY_KEYS = {"t", "kind", "detail", "note"}


class HealthSourceError(RuntimeError):
    """The source cannot work at all (no driver, no GPU, bad device index)."""


@dataclass(slots=True, frozen=True)
class HealthSignal:
    kind: str                               # one of SIGNAL_KINDS
    detail: dict = field(default_factory=dict)
    ns: int = 0                             # CLOCK_MONOTONIC, as kvhold.protocol.leases.now_ns()

    def to_dict(self) -> dict:
        return {"kind": self.kind, "detail": dict(self.detail), "ns": self.ns}


# ---------------------------------------------------------------------- replay
def _validate_entry(i: int, e) -> dict:
    if not isinstance(e, dict):
        raise ValueError(f"recording entry {i}: expected an object, got {type(e).__name__}")
    if unknown := set(e) - _ENTRY_KEYS:
        raise ValueError(f"recording entry {i}: unknown keys {sorted(unknown)}")
    t = e.get("t")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise ValueError(f"recording entry {i}: 't' must be a finite number >= 0, got {t!r}")
    if e.get("kind") not in SIGNAL_KINDS:
        raise ValueError(f"recording entry {i}: 'kind' must be one of {SIGNAL_KINDS}, "
                         f"got {e.get('kind')!r}")
    detail = e.get("detail", {})
    if not isinstance(detail, dict):
        raise ValueError(f"recording entry {i}: 'detail' must be an object")
    xid = detail.get("xid")
    if e["kind"] == "xid" and (isinstance(xid, bool) or not isinstance(xid, int) or xid < 0):
        raise ValueError(f"recording entry {i}: an xid entry needs detail.xid >= 0, got {xid!r}")
    return {"t": float(t), "kind": e["kind"], "detail": detail}


def load_recording(path_or_list) -> list[dict]:
    """Parse and validate a recording; every defect raises ValueError naming the entry."""
    if isinstance(path_or_list, (str, Path)):
        try:
            data = json.loads(Path(path_or_list).read_text())
        except OSError as e:
            raise ValueError(f"cannot read health recording {path_or_list}: {e}") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"health recording {path_or_list} is not valid JSON: {e}") from e
    else:
        data = path_or_list
    if not isinstance(data, list):
        raise ValueError(f"a health recording is a JSON list of entries, got {type(data).__name__}")
    entries = [_validate_entry(i, e) for i, e in enumerate(data)]
    for i in range(1, len(entries)):
        if entries[i]["t"] < entries[i - 1]["t"]:
            raise ValueError(f"recording entry {i}: 't' goes backwards "
                             f"({entries[i]['t']} after {entries[i - 1]['t']})")
    return entries


class RecordedSource:
    """Replays a recording: each entry is emitted once its `t` has passed since start().

    A signal's `ns` is its scheduled time (start + t), not the moment poll noticed it,
    so time windows in the policy see the recorded timeline whatever the thread jitter.
    """

    def __init__(self, path_or_list):
        self.path = str(path_or_list) if isinstance(path_or_list, (str, Path)) else None
        self.entries = load_recording(path_or_list)
        self.num_emitted = 0
        self.start_ns: int | None = None
        self._closed = threading.Event()

    @property
    def done(self) -> bool:
        return self.num_emitted == len(self.entries)

    def start(self) -> None:
        if self.start_ns is None:
            self.start_ns = now_ns()

    def poll(self, timeout_s: float) -> list[HealthSignal]:
        self.start()
        if not self.done:
            due_ns = self.start_ns + int(self.entries[self.num_emitted]["t"] * 1e9)
            timeout_s = min(timeout_s, max(0.0, (due_ns - now_ns()) / 1e9))
        self._closed.wait(timeout_s)
        out = []
        while not self.done and not self._closed.is_set():
            e = self.entries[self.num_emitted]
            due_ns = self.start_ns + int(e["t"] * 1e9)
            if due_ns > now_ns():
                break
            out.append(HealthSignal(e["kind"], dict(e["detail"]), due_ns))
            self.num_emitted += 1
        return out

    def describe(self) -> dict:
        return {"source": "replay", "path": self.path, "entries": len(self.entries),
                "emitted": self.num_emitted}

    def close(self) -> None:
        self._closed.set()


# ---------------------------------------------------------------------- NVML
def _import_pynvml():
    try:
        import pynvml
    except ImportError as e:
        raise HealthSourceError("NVML health needs nvidia-ml-py (pip install nvidia-ml-py)") from e
    return pynvml


class NvmlSource:
    """Watches one GPU through NVML: Xid events, double-bit ECC, row remapping, PCIe link.

    Counters are compared with a baseline taken at start(), so faults from before this
    process started are reported in describe() but not signalled again; only a remap
    failure (the GPU can no longer retire bad rows) is signalled even if it predates us.
    A query that raises NotSupported (common on virtualized GPUs) is skipped from then on.
    The PCIe generation is not checked unless `check_pcie_gen`: GPUs lower the link
    speed when idle to save power, so a generation drop alone is normal; a width drop is not.
    """

    def __init__(self, device_index: int = 0, *, check_pcie_gen: bool = False):
        if device_index < 0:
            raise ValueError(f"NVML device index must be >= 0, got {device_index}")
        self.index = device_index
        self.check_pcie_gen = check_pcie_gen
        self.info: dict = {}
        self.baseline: dict = {}
        self.unsupported: set[str] = set()
        self.lost = False
        self._nvml = None
        self._started = False   # set last in start(): describe() may run on another thread
        self._handle = None
        self._event_set = None
        self._failing: set[str] = set()     # queries whose current failure was already signalled
        self._pending: list[HealthSignal] = []
        self._latched: set[str] = set()     # conditions signalled once until they clear
        self._closed = threading.Event()

    # -------------------------------------------------------------- start-up
    def start(self) -> None:
        if self._nvml is not None:
            return
        nvml = _import_pynvml()
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            raise HealthSourceError(f"NVML init failed ({e}): no NVIDIA driver or GPU here?") from e
        self._nvml = nvml
        try:
            self._handle = nvml.nvmlDeviceGetHandleByIndex(self.index)
            self.info = {"name": _text(nvml.nvmlDeviceGetName(self._handle)),
                         "uuid": _text(nvml.nvmlDeviceGetUUID(self._handle)),
                         "driver": _text(nvml.nvmlSystemGetDriverVersion())}
        except nvml.NVMLError as e:
            self.close()
            raise HealthSourceError(f"NVML device {self.index}: {e}") from e
        try:
            self._take_baseline()
            self._event_set = self._query("xid_events", self._new_xid_event_set)
        except nvml.NVMLError_GpuIsLost as e:
            self._lose(e)
        self._started = True
        log.info("NVML health on GPU %d (%s): baseline %s", self.index, self.info["name"],
                 self.baseline)

    def _take_baseline(self) -> None:
        nv, h = self._nvml, self._handle
        for name, fn in (("max_pcie_width", nv.nvmlDeviceGetMaxPcieLinkWidth),
                         ("max_pcie_gen", nv.nvmlDeviceGetMaxPcieLinkGeneration)):
            if (value := self._query(name, fn, h)) is not None:
                self.baseline[name] = value
        self._check_ecc(), self._check_pcie()      # these set their baselines on first sight
        rows = self._query("remap", nv.nvmlDeviceGetRemappedRows, h)
        if rows is not None:
            self.baseline["remap"] = dict(zip(("corrected", "uncorrected", "pending", "failure"),
                                              rows))
        if rows is not None and rows[2]:
            # Only a GPU reset applies it; signalling it would restart the pool in a loop.
            log.warning("GPU %d has rows pending remapping from before start: reset the GPU",
                        self.index)
            self._latched.add("remap_pending")
        self._pending.clear()   # a baseline query failing is not a device fault

    def _new_xid_event_set(self):
        nv = self._nvml
        event_set = nv.nvmlEventSetCreate()
        try:
            nv.nvmlDeviceRegisterEvents(self._handle, nv.nvmlEventTypeXidCriticalError, event_set)
        except nv.NVMLError:
            nv.nvmlEventSetFree(event_set)
            raise
        return event_set

    # -------------------------------------------------------------- polling
    def poll(self, timeout_s: float) -> list[HealthSignal]:
        self.start()
        out: list[HealthSignal] = []
        if not (self.lost or self._closed.is_set()):
            try:
                out += self._wait_xids(timeout_s)
                out += self._check_ecc() + self._check_remap() + self._check_pcie()
            except self._nvml.NVMLError_GpuIsLost as e:
                self._lose(e)
        elif not self._pending:
            self._closed.wait(timeout_s)    # a lost GPU has nothing more to say
        out, self._pending = self._pending + out, []
        return out

    def _lose(self, e: Exception) -> None:
        self.lost = True
        self._pending.append(HealthSignal("gpu_lost", {"gpu": self.index, "error": str(e)},
                                          now_ns()))

    def _wait_xids(self, timeout_s: float) -> list[HealthSignal]:
        if self._event_set is None:
            self._closed.wait(timeout_s)
            return []
        nv, out, timeout_ms = self._nvml, [], max(0, int(timeout_s * 1000))
        while len(out) < MAX_XIDS_PER_POLL:
            try:
                data = nv.nvmlEventSetWait_v2(self._event_set, timeout_ms)
            except nv.NVMLError_Timeout:
                break
            except nv.NVMLError_GpuIsLost:
                raise
            except nv.NVMLError as e:
                self._failed("xid_events", e)
                self._closed.wait(timeout_s)    # never spin on a wait that fails at once
                break
            timeout_ms = 0                       # drain what is queued, then go on
            if data.eventType & nv.nvmlEventTypeXidCriticalError:
                out.append(HealthSignal("xid", {"xid": int(data.eventData), "gpu": self.index},
                                        now_ns()))
        return out

    def _dbe_count(self) -> int:
        nv = self._nvml
        return nv.nvmlDeviceGetTotalEccErrors(self._handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                              nv.NVML_VOLATILE_ECC)

    def _check_ecc(self) -> list[HealthSignal]:
        if (count := self._query("ecc_dbe", self._dbe_count)) is None:
            return []
        base = self.baseline.setdefault("ecc_dbe", count)
        last = self.baseline.get("ecc_dbe_last", base)
        self.baseline["ecc_dbe_last"] = max(count, last)
        if count <= last:
            return []
        return [HealthSignal("ecc_dbe", {"count": count, "baseline": base, "new": count - last,
                                         "gpu": self.index}, now_ns())]

    def _check_remap(self) -> list[HealthSignal]:
        rows = self._query("remap", self._nvml.nvmlDeviceGetRemappedRows, self._handle)
        if rows is None:
            return []
        corr, unc, pending, failure = rows
        detail = {"corrected_rows": corr, "uncorrected_rows": unc, "gpu": self.index}
        return (self._edge("remap_pending", bool(pending), detail)
                + self._edge("remap_failure", bool(failure), detail))

    def _check_pcie(self) -> list[HealthSignal]:
        nv, h, b = self._nvml, self._handle, self.baseline
        width = self._query("pcie_width", nv.nvmlDeviceGetCurrPcieLinkWidth, h)
        gen = self._query("pcie_gen", nv.nvmlDeviceGetCurrPcieLinkGeneration, h)
        base_width = b.setdefault("pcie_width", width) if width is not None else None
        base_gen = b.setdefault("pcie_gen", gen) if gen is not None else None
        narrow = width is not None and width < base_width
        slow = self.check_pcie_gen and gen is not None and gen < base_gen
        detail = {"width": width, "gen": gen, "baseline_width": base_width,
                  "baseline_gen": base_gen, "max_width": b.get("max_pcie_width"),
                  "max_gen": b.get("max_pcie_gen"), "gpu": self.index}
        return self._edge("pcie_degraded", narrow or slow, detail)

    def _edge(self, kind: str, active: bool, detail: dict) -> list[HealthSignal]:
        """Signal a condition once when it appears; re-arm when it clears."""
        if not active:
            self._latched.discard(kind)
            return []
        if kind in self._latched:
            return []
        self._latched.add(kind)
        return [HealthSignal(kind, dict(detail), now_ns())]

    def _query(self, name: str, fn, *args):
        """fn(*args), or None when unsupported (remembered) or failing (signalled once)."""
        if name in self.unsupported:
            return None
        nv = self._nvml
        try:
            value = fn(*args)
        except nv.NVMLError_NotSupported:
            self.unsupported.add(name)
            log.info("NVML %s is not supported on GPU %d: not checked", name, self.index)
            return None
        except nv.NVMLError_GpuIsLost:
            raise
        except nv.NVMLError as e:
            self._failed(name, e)
            return None
        self._failing.discard(name)
        return value

    def _failed(self, name: str, e: Exception) -> None:
        if name not in self._failing:
            self._failing.add(name)
            log.warning("NVML %s failed on GPU %d: %s", name, self.index, e)
            self._pending.append(HealthSignal("nvml_error", {"query": name, "error": str(e),
                                                             "gpu": self.index}, now_ns()))

    def describe(self) -> dict:
        return {"source": "nvml", "index": self.index, "started": self._started, **self.info,
                "baseline": dict(self.baseline), "unsupported": sorted(self.unsupported),
                "xid_events": self._event_set is not None, "lost": self.lost}

    def close(self) -> None:
        self._closed.set()
        nv, self._nvml, self._started = self._nvml, None, False
        if nv is None:
            return
        try:
            if self._event_set is not None:
                nv.nvmlEventSetFree(self._event_set)
            nv.nvmlShutdown()
        except nv.NVMLError as e:     # a lost GPU may refuse; the process is leaving it anyway
            log.info("NVML shutdown: %s", e)
        self._event_set = None


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
