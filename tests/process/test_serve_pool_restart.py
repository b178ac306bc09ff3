"""A pool restart under `kvhold serve` after its spare sidecar took over: the spare that became
the owner re-executes as the owner (not as a waiting spare), the new pool serves, the stream in
flight continues to the same events as an uninterrupted run and the supervisor goes on. Real
processes, real signals."""
import os
import shutil
import signal
import subprocess

import pytest

from kvhold.client.client import Client
from kvhold.sidecar.daemon import STOP_AT_ENV
from kvhold.serving.serve import SIDECAR_RESTARTS
from kvhold.testing.serve_process import http_client
from tests.process.helpers import (SERVE_FLAGS, Events, Server, ServeProcess, alive, comparable, pool_restart_cli,
                                   pool_restart_cmd, wait_stopped, wait_until, whole)

pytestmark = pytest.mark.slow      # a takeover and a pool restart: `pytest -m slow`

# long enough to be mid-stream when the drain starts
COMPLETION = {"prompt": "The sidecar keeps the memory", "max_tokens": 1000, "temperature": 0.8, "seed": 3,
              "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def _spare_waiting(srv) -> dict:
    return wait_until(lambda: (st := srv.sidecar_status()) and st["spares"] and st, 60, 0.1,
                      what="the spare sidecar waiting")


def test_a_pool_restart_after_the_spare_took_over(tiny_model, tmp_path, runtime_root):
    srv = Server(tiny_model, runtime_root, tmp_path / "serve.log", "--max-seq-len", "1024",
                 "--journal-dir", str(tmp_path / "journal"))
    try:
        reference = whole(srv, "/v1/completions", COMPLETION)
        first = _spare_waiting(srv)
        spare_pid = first["spares"][0]
        os.kill(first["pid"], signal.SIGKILL)                # the sidecar alone: its spare takes over
        took_over = wait_until(lambda: (st := srv.sidecar_status()) and st["pid"] == spare_pid
                               and st.get("adoption") and st, 60, 0.1, what="the spare to take over")
        srv.wait_healthy(timeout=60)
        with http_client().stream("POST", srv.base + "/v1/completions", json=COMPLETION, timeout=120) as r:
            assert r.status_code == 200
            events = Events(r).read(5)
            cli = pool_restart_cli(srv.instance, runtime_root, "--continue", "--timeout", "60", "--json")
            assert cli.returncode == 0, cli.stderr          # the new pool serves
            events.read()
        got = events.events
        assert got[-1] == (None, "[DONE]") and comparable(got) == comparable(reference)
        after = srv.sidecar_status()
        assert after["pid"] == spare_pid                     # the same process, re-executed
        assert after["generation"] == took_over["generation"] + 1
        assert after["spare"] is None                        # it started as the owner, not a spare
        assert srv.proc.poll() is None
        assert srv.wait_healthy(timeout=60)["status"] == "ok"
        _spare_waiting(srv)                                  # and a spare waits on it again
    finally:
        srv.stop()
    assert srv.proc.returncode == 0


def test_a_pool_restart_whose_new_sidecar_fails_stops_serve_with_the_reason(tiny_model, tmp_path, runtime_root):
    """The checkpoint's config.json is gone when the pool restarts: the new image cannot start.
    The spare does not take over a lock nobody died holding; the supervisor restarts the sidecar
    as after any death and, as it keeps failing, exits 1 naming the reason. The request in
    flight stays in the durable journal: once config.json is back, the next `kvhold serve`
    serves and brings it back."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    journal = tmp_path / "journal"
    flags = ("--max-seq-len", "1024", "--journal-dir", str(journal))
    srv = Server(model, runtime_root, tmp_path / "serve.log", *flags)
    try:
        pids = _spare_waiting(srv)
        pids = [pids["pid"], *pids["spares"]]
        with http_client().stream("POST", srv.base + "/v1/completions", json=COMPLETION, timeout=120) as r:
            assert r.status_code == 200
            part = Events(r).read(5)
            (model / "config.json").rename(tmp_path / "config.json")
            with Client.for_instance(srv.instance, runtime_root, timeout=10) as client:
                assert client.pool_restart(hold=False, client_grace_s=60).in_flight == 1
            assert srv.proc.wait(90) == 1                # serve gives up, saying why
            part.read()
        log = (tmp_path / "serve.log").read_text()
        assert "took over" not in log
        assert log.count(": restarting it") == SIDECAR_RESTARTS
        stop = next(line for line in log.splitlines() if " C [serve" in line)
        assert "config.json: missing" in stop and f"{SIDECAR_RESTARTS} restarts within a minute" in stop
        assert len(list(journal.glob("req-*.json"))) == 1          # the request waits on disk
        wait_until(lambda: not any(alive(p) for p in pids), 10, 0.05, what="the sidecar and its spare to end")
    finally:
        srv.stop()
    (tmp_path / "config.json").rename(model / "config.json")        # the cause fixed
    again = ServeProcess([*SERVE_FLAGS, *flags], runtime_root, model=model, instance=srv.instance,
                         log_path=tmp_path / "again.log")
    try:
        again.start()                                              # serves again, the request back
        restored = again.sidecar_status()["pool_restart"]["restore"]
        assert restored["requests_restored"] == 1 and not again.sidecar_status()["pool_restart"]["failed"]
    finally:
        again.stop()


@pytest.mark.parametrize("point", ["pool_restart_draining", "pool_restart_drained"])
def test_a_sidecar_killed_during_a_pool_restart_leaves_the_instance_serving(tiny_model, tmp_path, runtime_root, point):
    """The memory owner is SIGKILLed in the middle of a pool restart, with a stream in flight and
    its spare waiting: while it drains (it holds the lock; its executors are not stopped yet) or
    once the drain is done (the requests on disk, the lock gone, the re-exec next). It stops itself
    at that point (KVHOLD_SIDECAR_STOP_AT), the test kills it there. Either way the instance serves
    again: the stream in flight ends with the events of an uninterrupted run, /health is ok, a new
    request is served, a spare waits again and serve is still up."""
    srv = Server(tiny_model, runtime_root, tmp_path / "serve.log", "--max-seq-len", "1024",
                 "--journal-dir", str(tmp_path / "journal"), env={STOP_AT_ENV: point})
    try:
        reference = whole(srv, "/v1/completions", COMPLETION)
        owner = _spare_waiting(srv)["pid"]
        with http_client().stream("POST", srv.base + "/v1/completions", json=COMPLETION, timeout=180) as r:
            assert r.status_code == 200
            events = Events(r).read(5)
            cli = subprocess.Popen(pool_restart_cmd(srv.instance, runtime_root, "--continue", "--timeout", "20"),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   stdin=subprocess.DEVNULL)
            wait_stopped(owner, 60)                         # at the named point of the drain
            os.kill(owner, signal.SIGKILL)
            events.read()
            _, err = cli.communicate(timeout=120)
        if point == "pool_restart_draining":    # it held the lock: its spare re-adopted the old pool
            assert cli.returncode == 1 and "interrupted" in err, err
        else:                                   # the requests on disk: the restarted sidecar restores them
            assert cli.returncode == 0, err
        got = events.events
        assert got[-1] == (None, "[DONE]") and comparable(got) == comparable(reference)
        assert srv.wait_healthy(timeout=90)["status"] == "ok"
        assert srv.sidecar_status()["pid"] != owner
        assert comparable(whole(srv, "/v1/completions", COMPLETION)) == comparable(reference)
        _spare_waiting(srv)
        assert srv.proc.poll() is None
    finally:
        srv.stop()
    assert srv.proc.returncode == 0
