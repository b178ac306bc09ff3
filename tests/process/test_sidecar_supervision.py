"""Supervision with real processes and real signals: kill, stop, exit, fencing, tokens."""
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.process.helpers import sidecar_log
from kvhold.testing.sidecar_process import SidecarProcess

IDLE = ["--workload", "idle", "--lease-ms", "300", "--log-level", "INFO"]
EXIT_FENCED = 75


def _fence_of(sc, pid):
    return sc.wait_for(lambda st: next((e for e in st["events"] if e["kind"] == "fence"
                                        and e["pid"] == pid), None), timeout=10)


def _exit_of(sc, pid, timeout=10):
    return sc.wait_for(lambda st: next((e for e in st["events"] if e["kind"] == "exit"
                                        and e["pid"] == pid), None), timeout=timeout)


def _new_active(sc, old_pid):
    def check(st):
        active = SidecarProcess.executors(st, "active")
        return active[0] if active and active[0]["pid"] != old_pid else None
    return sc.wait_for(check, timeout=10)


@pytest.mark.parametrize("sig,code", [(signal.SIGKILL, 128 + 9), (signal.SIGSEGV, 128 + 11)])
def test_killed_active_is_fenced_and_standby_promoted(start_sidecar, sig, code):
    sc = start_sidecar(IDLE)
    active = sc.wait_steady()
    standby = SidecarProcess.executors(sc.status(), "standby")[0]
    t0 = time.monotonic_ns()
    os.kill(active["pid"], sig)
    fence = _fence_of(sc, active["pid"])
    assert fence["reason"] == "died" and fence["role"] == "ACTIVE"  # futex or pidfd
    assert fence["fenced_ns"] >= t0
    new = _new_active(sc, active["pid"])
    assert new["pid"] == standby["pid"]               # the warm standby, not a cold start
    assert _exit_of(sc, active["pid"])["exit_code"] == code
    again = sc.wait_steady()                          # re-armed with a fresh standby
    assert again["pid"] == standby["pid"]
    new_standby = SidecarProcess.executors(sc.status(), "standby")[0]
    assert new_standby["epoch"] > fence["fenced_epoch"]


def test_hang_is_fenced_within_the_lease_and_killed(start_sidecar):
    sc = start_sidecar(IDLE)
    active = sc.wait_steady()
    t0 = time.monotonic_ns()
    os.kill(active["pid"], signal.SIGSTOP)
    fence = _fence_of(sc, active["pid"])
    assert fence["reason"] == "hang"
    assert (fence["fenced_ns"] - t0) / 1e6 <= 300 * 1.1 + 20  # lease + 10%, + poll granularity
    assert _exit_of(sc, active["pid"])["exit_code"] == 128 + 9   # hung and ours: SIGKILLed
    _new_active(sc, active["pid"])


def test_standby_killed_in_its_takeover_is_replaced_at_once(start_sidecar):
    """The re-arm pause that leaves a takeover the CPU ends when the executor taking over dies:
    with no executor left, a replacement is spawned then, not when the pause would have ended."""
    sc = start_sidecar(["--workload", "idle", "--lease-ms", "3000", "--log-level", "INFO"])
    active = sc.wait_steady()
    standby = SidecarProcess.executors(sc.status(), "standby")[0]
    os.kill(standby["pid"], signal.SIGSTOP)           # promoted, it cannot report its takeover
    os.kill(active["pid"], signal.SIGKILL)
    sc.wait_for(lambda st: any(e["kind"] == "promote" and e["pid"] == standby["pid"] for e in st["events"]),
                timeout=10)
    os.kill(standby["pid"], signal.SIGKILL)
    fence = _fence_of(sc, standby["pid"])
    assert fence["role"] == "ACTIVE"
    spawn = sc.wait_for(lambda st: next((e for e in st["events"] if e["kind"] == "spawn"
                                         and e["ns"] >= fence["detect_ns"]), None), timeout=10)
    assert (spawn["ns"] - fence["detect_ns"]) / 1e6 < 1000    # the pause lasts 2 s
    sc.wait_steady(timeout=60)


def test_fenced_process_that_wakes_up_exits_by_itself(start_sidecar):
    """A stopped executor left alive once fenced (--no-kill-fenced) exits with 75 when continued.
    The stop lands wherever the active is, its promotion included (the status shows it active
    as the sidecar sends it): woken after the promotion's last lease check, it sends Recovered
    under the fenced epoch, and the sidecar's refusal, read before its next beat, is a fence
    too (tests/unit/test_executor_fenced_exit.py). A failure shows the processes' log."""
    sc = start_sidecar(IDLE + ["--no-kill-fenced"])
    active = sc.wait_steady()
    os.kill(active["pid"], signal.SIGSTOP)
    _fence_of(sc, active["pid"])
    _new_active(sc, active["pid"])
    os.kill(active["pid"], signal.SIGCONT)
    assert _exit_of(sc, active["pid"])["exit_code"] == EXIT_FENCED


def test_clean_exit_is_replaced(start_sidecar):
    # a lease the exit cannot outlast on a busy machine: a stop slower than 300 ms would be
    # fenced as a hang before its exit is seen
    sc = start_sidecar(IDLE + ["--lease-ms", "5000"])
    active = sc.wait_steady()
    os.kill(active["pid"], signal.SIGTERM)
    fence = _fence_of(sc, active["pid"])
    assert fence["reason"] == "exited"
    assert _exit_of(sc, active["pid"])["exit_code"] == 0
    _new_active(sc, active["pid"])
    sc.wait_steady()


def _run_executor(sc, token_file, timeout=30):
    return subprocess.run([sys.executable, "-m", "kvhold.executor", "--instance", sc.instance,
                           "--runtime-root", str(sc.runtime_root), "--token-file", str(token_file)],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("token", ["wrong-token", ""])
def test_wrong_or_missing_token_is_refused(start_sidecar, runtime_root, token):
    sc = start_sidecar(IDLE + ["--standbys", "0"])
    sc.wait_steady(standbys=0)
    bad = runtime_root / "bad-token"
    bad.write_text(token)
    bad.chmod(0o600)
    result = _run_executor(sc, bad)
    assert result.returncode != 0
    assert "bad executor token" in result.stderr
    assert any(e["kind"] == "refused" for e in sc.status()["events"])
    assert "wrong executor token" in sidecar_log(sc)
    assert len(sc.status()["executors"]) == 1        # no lease was granted


def test_every_object_is_owner_only(start_sidecar, runtime_root):
    sc = start_sidecar(IDLE)
    sc.wait_steady()
    rundir = runtime_root / sc.instance
    assert stat.S_IMODE(os.stat(rundir).st_mode) == 0o700
    for name in ("control.sock", "client.sock", "fd.sock", "token", "lock", "sidecar.json"):
        assert stat.S_IMODE(os.stat(rundir / name).st_mode) == 0o600, name
    shm = [p for p in Path("/dev/shm").iterdir() if p.name.startswith(f"kvhold-{os.getuid()}-{sc.instance}-")]
    assert {p.name.rsplit("-", 1)[1] for p in shm} == {"tables", "kv"}
    for p in shm:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p


def test_two_sidecars_side_by_side(start_sidecar):
    a = start_sidecar(IDLE, instance="alpha")
    b = start_sidecar(IDLE, instance="beta")
    a_active, b_active = a.wait_steady(), b.wait_steady()
    b_pids = {e["pid"] for e in b.status()["executors"]}
    os.kill(a_active["pid"], signal.SIGKILL)
    _new_active(a, a_active["pid"])
    time.sleep(0.5)          # the point: a window in which b must see nothing of a's recovery
    assert {e["pid"] for e in b.status()["executors"]} == b_pids
    assert not [e for e in b.status()["events"] if e["kind"] == "fence"]
    assert b.wait_steady()["pid"] == b_active["pid"]


def test_same_instance_twice_is_refused(start_sidecar):
    a = start_sidecar(IDLE, instance="solo")
    a.wait_steady()
    second = start_sidecar(IDLE, instance="solo", wait=False)
    with pytest.raises(RuntimeError, match="exited with code 2"):
        second.start(timeout=20)
    assert "already served by sidecar pid" in sidecar_log(second)


def _shm_of(instance):
    return sorted(p.name for p in Path("/dev/shm").iterdir()
                  if p.name.startswith(f"kvhold-{os.getuid()}-{instance}-"))


def test_stale_objects_of_a_killed_sidecar_are_removed(start_sidecar):
    a = start_sidecar(IDLE, instance="phoenix")
    a.wait_steady()
    pids = [e["pid"] for e in a.status()["executors"]]
    a.stop(signal.SIGKILL)
    assert _shm_of("phoenix")                           # left behind by the kill
    deadline = time.monotonic() + 10                    # executors follow their sidecar
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() and
                                              "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]
                                              for p in pids):
        time.sleep(0.05)
    b = start_sidecar(IDLE, instance="phoenix")
    b.wait_steady()
    assert "stale object(s) of a previous sidecar" in sidecar_log(b)
    assert b.status()["generation"] == 2


def test_sigterm_stops_everything_and_cleans_up(start_sidecar, runtime_root):
    sc = start_sidecar(IDLE, instance="tidy")
    sc.wait_steady()
    pids = [e["pid"] for e in sc.status()["executors"]]
    assert sc.stop(signal.SIGTERM) == 0
    assert _shm_of("tidy") == []
    rundir = runtime_root / "tidy"
    assert not any((rundir / n).exists() for n in ("control.sock", "client.sock", "fd.sock", "token"))
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
