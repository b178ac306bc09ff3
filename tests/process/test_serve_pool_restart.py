"""A pool restart under `kvhold serve` after its spare sidecar took over: the spare that became
the owner re-executes as the owner (not as a waiting spare), the new pool serves, the stream in
flight continues to the same events as an uninterrupted run and the supervisor goes on. Real
processes, real signals."""
import os
import signal

import httpx
import pytest

from tests.process.helpers import Events, Server, comparable, pool_restart_cli, wait_until, whole

pytestmark = pytest.mark.slow      # a takeover and a pool restart: `pytest -m slow`

COMPLETION = {"prompt": "The sidecar keeps the memory", "max_tokens": 400, "temperature": 0.8, "seed": 3,
              "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def _spare_waiting(srv) -> dict:
    return wait_until(lambda: (st := srv.sidecar_status()) and st["spares"] and st, 60, 0.1,
                      what="the spare sidecar waiting")


def test_a_pool_restart_after_the_spare_took_over(tiny_model, tmp_path):
    srv = Server(tiny_model, tmp_path, tmp_path / "serve.log", "--max-seq-len", "1024",
                 "--journal-dir", str(tmp_path / "journal"))
    try:
        reference = whole(srv, "/v1/completions", COMPLETION)
        first = _spare_waiting(srv)
        spare_pid = first["spares"][0]
        os.kill(first["pid"], signal.SIGKILL)                # the sidecar alone: its spare takes over
        took_over = wait_until(lambda: (st := srv.sidecar_status()) and st["pid"] == spare_pid
                               and st.get("adoption") and st, 60, 0.1, what="the spare to take over")
        srv.wait_healthy(timeout=60)
        with httpx.stream("POST", srv.base + "/v1/completions", json=COMPLETION, timeout=120) as r:
            assert r.status_code == 200
            events = Events(r).read(5)
            cli = pool_restart_cli(srv.instance, tmp_path, "--continue", "--timeout", "60", "--json")
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
