"""An instance stays protected, or says it is not: a second `kvhold serve` of a running instance
is refused and leaves the first intact, and /health turns 503 when executors are in a respawn
loop (a crash of the active could no longer be survived). Real servers, real signals."""
import os
import signal
import subprocess
import sys

import pytest

from tests.process.helpers import Server, completion, free_port, wait_until

pytestmark = pytest.mark.slow     # real restarts and timeouts: `pytest -m slow` (CI runs it)

RUNTIME_FILES = ("client.sock", "control.sock", "fd.sock", "sidecar.json", "lock", "token")


def test_a_second_serve_of_a_running_instance_is_refused_and_leaves_it_intact(tiny_model, tmp_path, runtime_root):
    srv = Server(tiny_model, runtime_root, tmp_path / "serve.log")
    try:
        rundir = runtime_root / srv.instance
        inodes = {name: os.stat(rundir / name).st_ino for name in RUNTIME_FILES}
        sidecar_pid = srv.sidecar_status()["pid"]
        second = subprocess.run(
            [sys.executable, "-m", "kvhold", "serve", "--model", str(tiny_model), "--port", str(free_port()),
             "--instance", srv.instance, "--runtime-root", str(runtime_root), "--max-seq-len", "512",
             "--lease-ms", "3000"], capture_output=True, text=True, timeout=120)
        assert second.returncode != 0
        assert f"already served by sidecar pid {sidecar_pid}" in second.stderr
        # nothing of the running instance was removed or replaced
        assert {name: os.stat(rundir / name).st_ino for name in RUNTIME_FILES} == inodes
        status = subprocess.run([sys.executable, "-m", "kvhold", "status", "--instance", srv.instance,
                                 "--runtime-root", str(runtime_root), "--json"],
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert srv.sidecar_status()["pid"] == sidecar_pid
        # and a crash of the active executor is still survived, the stream continuing
        kw = dict(prompt="Still protected", max_tokens=60, temperature=0.8, seed=5)
        reference = completion(srv, **kw).choices[0].text
        active = srv.wait_healthy()["active_pid"]
        parts = []
        for i, chunk in enumerate(completion(srv, stream=True, **kw)):
            parts.append(chunk.choices[0].text)
            if i == 5:
                os.kill(active, signal.SIGKILL)
        assert "".join(parts) == reference
        assert srv.wait_healthy()["active_pid"] != active
    finally:
        srv.stop()


def test_health_is_503_while_executors_crash_at_start_in_a_loop(tiny_model, tmp_path, runtime_root, monkeypatch):
    armed = tmp_path / "fault-armed"
    monkeypatch.setenv("KVHOLD_FAULT", "attached:1:exit")    # every executor, while `armed` exists
    monkeypatch.setenv("KVHOLD_FAULT_IF", str(armed))
    srv = Server(tiny_model, runtime_root, tmp_path / "serve.log", "--restart-backoff-ms", "50,400")
    try:
        body = srv.wait_healthy()
        assert srv.health().json()["reason"].startswith("active executor pid")
        armed.touch()
        os.kill(body["active_pid"], signal.SIGKILL)  # the standby takes over; its replacements die

        def unhealthy():
            r = srv.health()
            return r if r.status_code == 503 and "respawn loop" in r.json()["reason"] else None
        r = wait_until(unhealthy, timeout_s=90, interval_s=0.1, what="/health to report the respawn loop")
        assert r.json()["reason"].startswith("no crash protection: executors in a respawn loop")
        assert r.json()["active_pid"] is not None          # still serving, but unprotected
        protection = srv.sidecar_status()["protection"]
        assert protection["ok"] is False and protection["deaths_since_ready"] >= 3
        shown = subprocess.run([sys.executable, "-m", "kvhold", "status", "--instance", srv.instance,
                                "--runtime-root", str(runtime_root)], capture_output=True, text=True, timeout=60)
        assert "unprotected: executors in a respawn loop" in shown.stdout, shown.stdout + shown.stderr
        exits = [e for e in srv.sidecar_status()["events"] if e["kind"] == "exit" and e["exit_code"] == 3]
        assert exits, "the replacements died of the start-up fault"
        armed.unlink()                                     # replacements start clean again
        srv.wait_healthy(standbys=1, timeout=90)
        assert srv.sidecar_status()["protection"]["ok"] is True
    finally:
        srv.stop()
