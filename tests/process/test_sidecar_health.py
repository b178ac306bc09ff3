"""Health monitor: recorded NVML signal sequences through the real policy and thread."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvhold.sidecar.health import (XID_ACTIONS, Action, EscalationPolicy, HealthEvent, HealthMonitor,
                            HealthSignal, HealthSourceError, NvmlSource, RecordedSource,
                            make_source)

DATA = Path(__file__).parents[1] / "data" / "health"
E, P, D = "restart_executor", "restart_pool", "drain"


def wait_until(cond, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def replay(name: str, policy: EscalationPolicy | None = None) -> tuple[list[HealthEvent], dict]:
    """Play a recording through a real HealthMonitor thread; return (events, status)."""
    events: list[HealthEvent] = []
    source = RecordedSource(DATA / name)
    monitor = HealthMonitor(source, policy or EscalationPolicy(), events.append, interval_s=0.02)
    monitor.start()
    wait_until(lambda: source.done)
    monitor.stop()           # joins: every emitted signal has been handled by now
    assert not monitor.running
    status = monitor.status()
    json.dumps(status)       # must be JSON-serialisable as is
    return events, status


def sig(kind="xid", ns=0, **detail) -> HealthSignal:
    return HealthSignal(kind, detail, ns)


# ---------------------------------------------------------------- recorded sequences
@pytest.mark.parametrize("name, actions, standing", [
    ("app_faults.json", [E, E], E),
    ("xid_storm.json", [E, E, P, E], P),
    ("ecc_dbe.json", [P], P),
    ("remap_then_failure.json", [P, D], D),
    ("pcie_x16_to_x8.json", [D], D),
    ("gpu_lost.json", [D, D], D),
    ("unknown_xid.json", [E], E),
])
def test_recording_maps_to_actions(name, actions, standing):
    events, status = replay(name)
    assert [e.action.label for e in events] == actions
    assert [e["action"] for e in status["events"]] == actions
    assert status["action"] == standing and status["error"] is None
    assert status["source"]["emitted"] == len(actions)


def test_reasons_say_what_happened_and_what_to_do():
    events, status = replay("gpu_lost.json")
    assert events[0].reason == "Xid 79 (GPU has fallen off the bus): drain"
    assert status["reason"] == events[0].reason     # the first event that set the standing action
    events, _ = replay("xid_storm.json")
    assert "3 executor restarts within 60 s" in events[2].reason
    assert events[2].reason.endswith("restart pool")
    events, _ = replay("unknown_xid.json")
    assert "Xid 9999 (not in kvhold's table" in events[0].reason
    events, _ = replay("pcie_x16_to_x8.json")
    assert "x8 gen5 (baseline x16 gen5)" in events[0].reason


def test_nvml_error_alone_is_logged_not_acted_on():
    events, status = replay("nvml_error_only.json")
    assert events == [] and status["action"] == "none" and status["events"] == []


def test_malformed_recording_is_a_clear_value_error():
    with pytest.raises(ValueError, match=r"entry 1: an xid entry needs detail.xid"):
        RecordedSource(DATA / "malformed.json")


@pytest.mark.parametrize("entries, message", [
    ({"t": 0}, "JSON list"),
    ([[0, "xid"]], "entry 0: expected an object"),
    ([{"t": -1, "kind": "xid", "detail": {"xid": 1}}], "entry 0: 't' must be"),
    ([{"t": "soon", "kind": "gpu_lost"}], "entry 0: 't' must be"),
    ([{"t": 0, "kind": "melted"}], "entry 0: 'kind' must be one of"),
    ([{"t": 0, "kind": "gpu_lost", "detail": [1]}], "'detail' must be an object"),
    ([{"t": 0, "kind": "gpu_lost", "when": 3}], r"unknown keys \['when'\]"),
    ([{"t": 1, "kind": "gpu_lost"}, {"t": 0.5, "kind": "gpu_lost"}], "entry 1: 't' goes backwards"),
])
def test_recording_defects_name_the_entry(entries, message):
    with pytest.raises(ValueError, match=message):
        RecordedSource(entries)


def test_unreadable_recordings(tmp_path):
    with pytest.raises(ValueError, match="cannot read health recording"):
        RecordedSource(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("[{")
    with pytest.raises(ValueError, match="not valid JSON"):
        RecordedSource(tmp_path / "bad.json")


def test_recorded_source_emits_on_schedule_with_scheduled_ns():
    src = RecordedSource([{"t": 0.15, "kind": "gpu_lost"}])
    src.start()
    assert src.poll(0.01) == []
    t0 = time.monotonic()
    got = src.poll(1.0)              # waits for the entry, not the whole timeout
    assert time.monotonic() - t0 < 0.5
    assert [s.kind for s in got] == ["gpu_lost"] and got[0].ns == src.start_ns + 150_000_000
    assert src.done and src.poll(0.01) == []
    src.close()


# ---------------------------------------------------------------- policy
@pytest.mark.parametrize("xid, action", [
    (13, Action.RESTART_EXECUTOR), (31, Action.RESTART_EXECUTOR), (43, Action.RESTART_EXECUTOR),
    (45, Action.RESTART_EXECUTOR), (94, Action.RESTART_EXECUTOR), (48, Action.RESTART_POOL),
    (63, Action.RESTART_POOL), (92, Action.RESTART_POOL), (95, Action.RESTART_POOL),
    (119, Action.RESTART_POOL), (120, Action.RESTART_POOL), (64, Action.DRAIN),
    (74, Action.DRAIN), (79, Action.DRAIN), (12345, Action.RESTART_EXECUTOR),
])
def test_xid_table(xid, action):
    assert EscalationPolicy().decide(sig(xid=xid)).action == action


@pytest.mark.parametrize("kind, action", [
    ("ecc_dbe", Action.RESTART_POOL), ("remap_pending", Action.RESTART_POOL),
    ("remap_failure", Action.DRAIN), ("pcie_degraded", Action.DRAIN), ("gpu_lost", Action.DRAIN),
    ("nvml_error", Action.NONE),
])
def test_signal_kinds(kind, action):
    assert EscalationPolicy().decide(sig(kind)).action == action


def test_actions_are_ordered_by_severity():
    assert Action.NONE < Action.RESTART_EXECUTOR < Action.RESTART_POOL < Action.DRAIN
    assert all(a in Action for a, _ in XID_ACTIONS.values())


def test_storm_needs_the_restarts_inside_the_window():
    s = 1_000_000_000
    policy = EscalationPolicy(storm_count=3, storm_window_s=60)
    actions = [policy.decide(sig(xid=13, ns=t * s)).action for t in (0, 30, 61, 62, 63)]
    # At 61 s the restart at 0 has left the window; 30, 61, 62 make three.
    assert actions == [Action.RESTART_EXECUTOR] * 3 + [Action.RESTART_POOL, Action.RESTART_EXECUTOR]
    spaced = EscalationPolicy()
    assert {spaced.decide(sig(xid=31, ns=t * s)).action for t in (0, 61, 122, 183)} == {
        Action.RESTART_EXECUTOR}


def test_storm_is_configurable_and_only_counts_executor_restarts():
    policy = EscalationPolicy(storm_count=2, storm_window_s=1)
    assert policy.decide(sig(xid=13, ns=0)).action == Action.RESTART_EXECUTOR
    assert policy.decide(sig(xid=48, ns=1)).action == Action.RESTART_POOL
    assert policy.decide(sig(xid=13, ns=2)).action == Action.RESTART_POOL
    with pytest.raises(ValueError):
        EscalationPolicy(storm_count=0)


def test_current_is_the_highest_standing_action_until_cleared():
    policy = EscalationPolicy(storm_count=2)
    policy.decide(sig(xid=13, ns=0))
    policy.decide(sig("gpu_lost", ns=1))
    policy.decide(sig(xid=48, ns=2))
    assert policy.current == Action.DRAIN and policy.reason.startswith("GPU is lost")
    policy.clear()
    assert policy.current == Action.NONE and policy.reason == ""
    # clear() forgets the storm window too: one restart after it does not escalate.
    assert policy.decide(sig(xid=13, ns=3)).action == Action.RESTART_EXECUTOR


def test_xid_overrides_and_unknown_kinds():
    policy = EscalationPolicy(xid_actions={74: Action.RESTART_POOL, 500: Action.DRAIN})
    assert policy.decide(sig(xid=74)).reason == "Xid 74 (NVLink error): restart pool"
    assert policy.decide(sig(xid=500)).action == Action.DRAIN
    with pytest.raises(ValueError, match="unknown health signal kind"):
        policy.decide(sig("melted"))


# ---------------------------------------------------------------- monitor
class BrokenSource:
    """A source that fails the way NVML does on a machine without a driver."""

    def __init__(self, fail_in="start"):
        self.fail_in, self.closed = fail_in, False

    def start(self):
        if self.fail_in == "start":
            raise HealthSourceError("NVML init failed (Driver Not Loaded)")

    def poll(self, timeout_s):
        time.sleep(0.01)             # a poll takes time, as NVML's does
        raise RuntimeError("poll exploded")

    def describe(self):
        return {"source": "broken"}

    def close(self):
        self.closed = True


@pytest.mark.parametrize("fail_in, error", [
    ("start", "HealthSourceError: NVML init failed"), ("poll", "RuntimeError: poll exploded")])
def test_a_failing_source_stops_the_monitor_not_the_process(fail_in, error):
    source = BrokenSource(fail_in)
    monitor = HealthMonitor(source, EscalationPolicy(), lambda e: None, interval_s=0.02).start()
    wait_until(lambda: not monitor.running)
    assert monitor.status()["error"].startswith(error) and monitor.status()["action"] == "none"
    monitor.stop()
    assert source.closed


def test_a_failing_callback_does_not_stop_the_monitor():
    seen = []

    def on_event(event):
        seen.append(event)
        if len(seen) == 1:
            raise RuntimeError("sidecar bug")

    source = RecordedSource(DATA / "app_faults.json")
    monitor = HealthMonitor(source, EscalationPolicy(), on_event, interval_s=0.02).start()
    wait_until(lambda: len(seen) == 2)
    assert monitor.running and monitor.status()["error"] is None
    monitor.stop()


def test_callback_runs_on_the_monitor_thread_and_stop_is_prompt():
    threads = []
    source = RecordedSource([{"t": 0, "kind": "xid", "detail": {"xid": 13}}])
    monitor = HealthMonitor(source, EscalationPolicy(),
                            lambda e: threads.append(threading.current_thread().name),
                            interval_s=0.2).start()
    wait_until(lambda: threads)
    t0 = time.monotonic()
    monitor.stop()
    assert time.monotonic() - t0 < 0.5 and threads == ["kvhold-health"]


def test_monitor_without_a_source_reports_off():
    monitor = HealthMonitor(None, EscalationPolicy(), lambda e: None).start()
    assert monitor.status() == {"source": "off", "action": "none", "reason": "", "events": [],
                                "error": None, "running": False}
    monitor.stop()


def test_status_keeps_the_last_32_events():
    entries = [{"t": 0, "kind": "xid", "detail": {"xid": 13}}] * 40
    source = RecordedSource(entries)
    monitor = HealthMonitor(source, EscalationPolicy(), lambda e: None, interval_s=0.02).start()
    wait_until(lambda: source.done)
    monitor.stop()
    assert len(monitor.status()["events"]) == 32


# ---------------------------------------------------------------- make_source
def test_make_source_specs():
    assert make_source("off") is None
    assert isinstance(make_source("nvml"), NvmlSource) and make_source("nvml").index == 0
    assert make_source("nvml:3").index == 3
    src = make_source(f"replay:{DATA / 'app_faults.json'}")
    assert isinstance(src, RecordedSource) and len(src.entries) == 2


@pytest.mark.parametrize("spec", ["", "on", "off:1", "nvml:", "nvml:x", "nvml:-1", "replay:",
                                  "replay:/nonexistent/kvhold.json", None])
def test_make_source_rejects_bad_specs(spec):
    with pytest.raises(ValueError):
        make_source(spec)


# ---------------------------------------------------------------- NVML
def test_nvml_without_a_gpu_is_a_clear_error():
    pytest.importorskip("pynvml")
    source = NvmlSource(0)
    try:
        source.start()
    except HealthSourceError as e:
        assert "NVML" in str(e)
    else:
        source.close()
        pytest.skip("an NVIDIA GPU is present")
    monitor = HealthMonitor(NvmlSource(0), EscalationPolicy(), lambda e: None, interval_s=0.02)
    monitor.start()
    wait_until(lambda: not monitor.running)
    assert "NVML init failed" in monitor.status()["error"]
    monitor.stop()


class FakeNvml:
    """Stands in for the pynvml module so NvmlSource's own logic runs on CPU."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    class NVMLError_GpuIsLost(NVMLError):
        pass

    class NVMLError_Timeout(NVMLError):
        pass

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, nvmlEventTypeXidCriticalError = 1, 0, 8

    def __init__(self, unsupported=()):
        self.unsupported, self.lost, self.xids = set(unsupported), False, []
        self.dbe, self.rows, self.width, self.gen = 0, (0, 0, 0, 0), 16, 5

    def _get(self, name, value):
        if name in self.unsupported:
            raise self.NVMLError_NotSupported()
        if self.lost:
            raise self.NVMLError_GpuIsLost("GPU is lost")
        return value

    def __getattr__(self, name):      # the NVML calls NvmlSource makes, reading the state above
        read = {"nvmlDeviceGetTotalEccErrors": lambda: self.dbe,
                "nvmlDeviceGetRemappedRows": lambda: self.rows,
                "nvmlDeviceGetCurrPcieLinkWidth": lambda: self.width,
                "nvmlDeviceGetCurrPcieLinkGeneration": lambda: self.gen,
                "nvmlDeviceGetMaxPcieLinkWidth": lambda: 16,
                "nvmlDeviceGetMaxPcieLinkGeneration": lambda: 5,
                "nvmlDeviceGetName": lambda: b"Fake H200", "nvmlDeviceGetUUID": lambda: "GPU-fake",
                "nvmlSystemGetDriverVersion": lambda: "0.0", "nvmlEventSetCreate": lambda: "set"}
        if not name.startswith("nvml"):
            raise AttributeError(name)
        return lambda *args: self._get(name, read.get(name, lambda: None)())

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        self._get("nvmlEventSetWait_v2", None)
        if not self.xids:
            time.sleep(timeout_ms / 1000)    # NVML's wait: no event within the timeout
            raise self.NVMLError_Timeout()
        return type("Event", (), {"eventType": 8, "eventData": self.xids.pop(0)})


@pytest.fixture
def fake_nvml(monkeypatch):
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def kinds(source) -> list[str]:
    return [s.kind for s in source.poll(0.01)]


def test_nvml_source_signals_changes_from_the_baseline_once(fake_nvml):
    fake_nvml.dbe, fake_nvml.gen = 3, 1            # old errors and an idle link: not signalled
    source = NvmlSource(0)
    source.start()
    assert source.describe()["baseline"]["ecc_dbe"] == 3 and kinds(source) == []
    fake_nvml.xids, fake_nvml.dbe = [13, 31], 4
    got = source.poll(0.01)
    assert [(s.kind, s.detail.get("xid")) for s in got] == [("xid", 13), ("xid", 31),
                                                            ("ecc_dbe", None)]
    assert got[2].detail["new"] == 1 and kinds(source) == []
    fake_nvml.rows = (0, 1, 1, 0)
    assert kinds(source) == ["remap_pending"] and kinds(source) == []
    fake_nvml.rows, fake_nvml.width = (0, 1, 1, 1), 8
    assert kinds(source) == ["remap_failure", "pcie_degraded"] and kinds(source) == []
    fake_nvml.lost = True
    assert kinds(source) == ["gpu_lost"] and kinds(source) == [] and source.describe()["lost"]
    source.close()


def test_nvml_source_generation_check_is_opt_in(fake_nvml):
    source = NvmlSource(0, check_pcie_gen=True)
    source.start()
    fake_nvml.gen = 3
    assert kinds(source) == ["pcie_degraded"]
    source.close()


def test_nvml_source_skips_unsupported_queries_without_spinning(monkeypatch):
    fake = FakeNvml(unsupported={"nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows",
                                 "nvmlEventSetCreate"})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    source = NvmlSource(0)
    source.start()
    assert source.describe()["unsupported"] == ["ecc_dbe", "remap", "xid_events"]
    t0 = time.monotonic()
    assert source.poll(0.1) == [] and time.monotonic() - t0 >= 0.09
    source.close()


@pytest.mark.gpu
def test_nvml_source_on_a_gpu():
    pytest.importorskip("pynvml")
    source = NvmlSource(0)
    try:
        source.start()
    except HealthSourceError as e:
        pytest.skip(f"no NVIDIA GPU/driver: {e}")
    try:
        info = source.describe()
        assert info["started"] and info["name"] and info["uuid"].startswith("GPU-")
        signals = source.poll(0.2)
        assert signals == [], signals
        json.dumps(source.describe())
    finally:
        source.close()


# Writes far outside any mapping from a kernel: the driver logs Xid 31 (MMU fault) and
# kills only this context. Opt-in, since it leaves an Xid in the host's kernel log.
FAULT = """
import torch, triton, triton.language as tl
@triton.jit
def poke(p, off):
    tl.store(p + off, 1)
poke[(1,)](torch.zeros(1, dtype=torch.int32, device="cuda"), 1 << 44)
torch.cuda.synchronize()
"""


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("KVHOLD_GPU_FAULT_TESTS") != "1",
                    reason="injects a real Xid: set KVHOLD_GPU_FAULT_TESTS=1")
def test_nvml_source_sees_a_real_application_xid(tmp_path):
    pytest.importorskip("pynvml")
    pytest.importorskip("triton")
    events: list[HealthEvent] = []
    source = NvmlSource(0)
    try:
        source.start()        # before the fault: NVML only reports Xids after registration
    except HealthSourceError as e:
        pytest.skip(f"no NVIDIA GPU/driver: {e}")
    if not source.describe()["xid_events"]:
        source.close()
        pytest.skip("Xid events are not supported on this GPU")
    monitor = HealthMonitor(source, EscalationPolicy(), events.append, interval_s=0.1).start()
    script = tmp_path / "fault.py"          # triton reads a kernel's source from its file
    script.write_text(FAULT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "illegal" in out.stderr.lower(), out.stderr[-800:]
    wait_until(lambda: events, timeout_s=10)
    monitor.stop()
    assert events[0].signal.kind == "xid" and events[0].signal.detail["xid"] in (13, 31, 43)
    assert events[0].action == Action.RESTART_EXECUTOR, events[0].reason
