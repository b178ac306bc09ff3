"""`kvhold serve` as three failure domains: the HTTP server process is SIGKILLed mid-stream
and the sidecar with its executors keeps running (same pids), the supervisor restarts the
HTTP server, and a client that resumes with Last-Event-ID gets exactly the rest of its
stream (a live one, and one that finished while no HTTP server was up), so that the whole
equals an uninterrupted run. A stream nobody resumes is cancelled after --unclaimed-cancel-s."""
import json
import os
import signal
import time

from kvhold.testing.serve_process import http_client
import pytest

from tests.process.helpers import (Events, Server, comparable, http_child, stream_request_id, unique_prompt_token,
                                   wait_stopped, wait_until, whole)

pytestmark = pytest.mark.slow      # two servers, real kills and restarts: `pytest -m slow`

COMPLETION = {"prompt": "The sidecar keeps the memory", "max_tokens": 1000, "temperature": 0,
              "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
# long enough to be still running when a test kills the HTTP server a few events in, however
# fast the engine: its end is then one no client was attached to (a result kept for pickup)
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 400, "temperature": 0,
        "ignore_eos": True, "stream": True}


def executor_pids(status) -> set:
    return {e["pid"] for e in status["executors"]}


def test_sigkill_of_the_http_server_mid_stream_then_resume(tiny_model, tmp_path, runtime_root):
    # Once the HTTP server is dead, the executor stops itself 450 steps of the completion later:
    # the chat (400 tokens) has ended by then and the completion (1000) has not, and it stays
    # unfinished until its client is back, however long the new HTTP server takes to start (the
    # lease outlasts the stop, so the executor is neither fenced nor replaced).
    armed, fired = tmp_path / "armed", tmp_path / "fired"
    token = unique_prompt_token(tiny_model, [{"prompt": COMPLETION["prompt"]}, {"prompt": "user: Hello\nassistant:"}], 0)
    env = {"KVHOLD_FAULT": f"step:token={token}@450:stop", "KVHOLD_FAULT_IF": str(armed),
           "KVHOLD_FAULT_ONCE": str(fired)}
    srv = Server(tiny_model, runtime_root, tmp_path / "serve.log", "--max-seq-len", "1024",  # a long stream
                 "--lease-ms", "600000", env=env)
    stopped = None
    try:
        reference = {"/v1/completions": whole(srv, "/v1/completions", COMPLETION),
                     "/v1/chat/completions": whole(srv, "/v1/chat/completions", CHAT)}
        before = srv.sidecar_status()
        old_http = http_child(srv)
        with http_client().stream("POST", srv.base + "/v1/completions", json=COMPLETION, timeout=120) as a, \
                http_client().stream("POST", srv.base + "/v1/chat/completions", json=CHAT, timeout=120) as b:
            assert a.status_code == b.status_code == 200
            parts = {"/v1/completions": Events(a).read(5), "/v1/chat/completions": Events(b).read(3)}
            os.kill(srv.proc.pid, signal.SIGSTOP)     # no restart until the chat has ended
            try:
                os.kill(old_http, signal.SIGKILL)
                armed.touch()
                for p in parts.values():
                    p.read()                          # to the broken connection
                chat_rid = stream_request_id(srv, parts["/v1/chat/completions"].events[-1][0])
                comp_rid = stream_request_id(srv, parts["/v1/completions"].events[-1][0])
                stopped = int(wait_until(lambda: fired.exists() and fired.read_text().split(), 60, 0.05,
                                         what="the executor to stop itself")[0])
                wait_stopped(stopped)
                # the chat ended with no HTTP server up: its result waits for pickup in the sidecar
                status = wait_until(lambda: (st := srv.sidecar_status()) and chat_rid in [
                    u["request_id"] for u in st["pool_restart"]["unclaimed"]] and st, 60, 0.1,
                    what="the chat to finish unclaimed")
                assert comp_rid in status["pool_restart"]["awaiting_resume"]   # still generating
            finally:
                os.kill(srv.proc.pid, signal.SIGCONT)
        # resumed at once: the supervisor holds the port, the connection waits for the new server
        for path, part in parts.items():
            last = part.events[-1][0]
            rid = last.split("-")[0]
            with http_client().stream("GET", f"{srv.base}/v1/streams/{rid}", headers={"Last-Event-ID": last},
                              timeout=120) as r:
                assert r.status_code == 200, r.read()
                if stopped is not None:       # the completion is taken up again: let it go on
                    os.kill(stopped, signal.SIGCONT)
                    stopped = None
                rest = Events(r).read().events
            got = part.events + rest
            assert rest[-1] == (None, "[DONE]")
            assert comparable(got) == comparable(reference[path]), path        # nothing skipped or repeated
            heads = {(json.loads(d)["id"], json.loads(d)["created"]) for _, d in got if d != "[DONE]"}
            assert len(heads) == 1, heads                         # the same response, chunk for chunk
        assert http_child(srv) != old_http
        after = srv.sidecar_status()
        assert after["pid"] == before["pid"] and executor_pids(after) == executor_pids(before)
        assert after["requests"]["finished"].get("cancelled", 0) == 0
        log = (tmp_path / "serve.log").read_text()
        assert f"the HTTP server pid {old_http} was killed by SIGKILL" in log and "restarting it in" in log
        assert f"request {chat_rid:#x} finished with no client attached" in log      # served from the sidecar
        assert f"request {comp_rid:#x} finished with no client attached" not in log  # resumed while live
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        srv.stop()
    assert srv.proc.returncode == 0


def test_a_stream_nobody_resumes_is_cancelled(tiny_model, tmp_path, runtime_root):
    # one request runs at a time: the second waits for the first, with no token sent yet when the
    # HTTP server dies, and starts once a new HTTP server (the same owner, which knows nothing
    # of it) is connected
    srv = Server(tiny_model, runtime_root, tmp_path / "serve.log", "--unclaimed-cancel-s", "1.5",
                 "--max-seq-len", "1024", "--max-batch", "1")      # a first stream that outlasts the 1.5 s
    try:
        body = dict(COMPLETION, max_tokens=1000)
        sidecar_pid = srv.sidecar_status()["pid"]
        with http_client().stream("POST", srv.base + "/v1/completions", json=body, timeout=120) as r, \
                http_client().stream("POST", srv.base + "/v1/completions", json=dict(body, max_tokens=990),
                             timeout=120) as queued:
            assert r.status_code == queued.status_code == 200, r.read()
            events = Events(r).read(3)
            held_at = time.monotonic()
            os.kill(http_child(srv), signal.SIGKILL)
            events.read()
            assert not Events(queued).read().events
        last = events.events[-1][0]
        sid, rid = last.split("-")[0], stream_request_id(srv, last)
        try:
            status = wait_until(lambda: (st := srv.sidecar_status())["requests"]["in_flight"] == 0 and st,
                                90, 0.1, what="both requests to end")
        except AssertionError:
            print(json.dumps(srv.sidecar_status(), indent=1)[:4000], (tmp_path / "serve.log").read_text()[-4000:])
            raise
        waited = time.monotonic() - held_at
        assert waited >= 3.0, (waited, status["requests"], status["pool_restart"], status.get("client_peers"))                    # each held --unclaimed-cancel-s, one after the other
        assert status["pid"] == sidecar_pid and status["pool_restart"]["unclaimed_cancelled_total"] == 2
        assert status["requests"]["finished"] == {"cancelled": 2}      # neither ran for nobody
        assert status["pool_restart"]["unclaimed_total"] == 0           # nor was kept for nobody
        srv.wait_healthy()
        r = http_client().get(f"{srv.base}/v1/streams/{sid}", headers={"Last-Event-ID": last}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"
        assert "cancelled: no client claimed it" in r.json()["error"]["message"]
        assert f"request {rid:#x} was cancelled: no client claimed it" in (tmp_path / "serve.log").read_text()

        # a second death soon after the first: a longer delay before the restart
        second = http_child(srv)
        os.kill(second, signal.SIGKILL)
        wait_until(lambda: http_child(srv) != second, 30, 0.05, what="the second restart")
        log = (tmp_path / "serve.log").read_text()
        assert f"the HTTP server pid {second} was killed by SIGKILL" in log and "restarting it in 1.0 s" in log
        srv.wait_healthy()

        # the supervisor's own death: the HTTP server dies with it, the sidecar is told to drain
        http_pid = http_child(srv)
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()
        wait_until(lambda: not _alive(http_pid), 10, 0.05, what="the HTTP server to die with the supervisor")
        wait_until(lambda: not _alive(sidecar_pid), 60, 0.1, what="the sidecar to drain and exit")
        assert "admissions closed by stop: the sidecar is stopping" in (tmp_path / "serve.log").read_text()
    finally:
        srv.stop()


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.parametrize("spare", [True, False], ids=["spare", "no-spare"])
def test_sigkill_of_the_sidecar_mid_stream_under_serve(tiny_model, tmp_path, runtime_root, spare):
    """The memory owner dies mid-stream: its spare takes over (or, with --no-sidecar-spare, the
    supervisor starts a new sidecar) and re-adopts the executors (same pids) and the requests;
    the HTTP stream pauses and goes on to the same events as an uninterrupted run, with nothing
    recomputed and no weights loaded again."""
    extra = () if spare else ("--no-sidecar-spare",)
    srv = Server(tiny_model, runtime_root, tmp_path / "serve.log", "--max-seq-len", "1024", *extra)
    try:
        body = dict(COMPLETION, max_tokens=300)
        reference = whole(srv, "/v1/completions", body)
        srv.wait_healthy()
        before = srv.sidecar_status()
        if spare:
            before = wait_until(lambda: (st := srv.sidecar_status()) and st["spares"] and st, 60, 0.1,
                                what="the spare sidecar waiting")
            assert len(before["spares"]) == 1
        else:
            assert before["spares"] == []
        with http_client().stream("POST", srv.base + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            events = Events(r).read(5)
            os.kill(before["pid"], signal.SIGKILL)        # the sidecar alone
            events.read()
        got = events.events
        assert got[-1] == (None, "[DONE]") and comparable(got) == comparable(reference)
        after = wait_until(lambda: (st := srv.sidecar_status()) and st["pid"] != before["pid"] and st,
                           30, 0.1, what="the new sidecar")
        assert executor_pids(after) == executor_pids(before)               # re-adopted, not replaced
        assert after["adoption"]["previous_pid"] == before["pid"]
        assert after["weights"]["load_ms"] is None and not after["recoveries"]
        usage = json.loads(got[-2][1])["usage"]
        assert usage["completion_tokens"] == 300
        log = (tmp_path / "serve.log").read_text()
        if spare:
            assert after["pid"] == before["spares"][0]
            assert after["spare"]["previous_pid"] == before["pid"]
            assert (f"the sidecar pid {before['pid']} was killed by SIGKILL: the spare pid {after['pid']} "
                    f"took over") in log
        else:
            assert after["spare"] is None
            assert f"the sidecar pid {before['pid']} was killed by SIGKILL: restarting it" in log
        assert srv.wait_healthy(timeout=60)["status"] == "ok"
    finally:
        srv.stop()
    assert srv.proc.returncode == 0


def test_a_result_kept_for_pickup_outlives_a_sigkill_of_the_frontend(tiny_model, tmp_path, runtime_root):
    """The HTTP server dies mid-stream, the request ends with no client (its result kept for
    pickup, its durable record and journal slot gone), then the frontend is SIGKILLed too: the
    restarted frontend still hands the result over to the client that resumes."""
    srv = Server(tiny_model, runtime_root, tmp_path / "serve.log", "--max-seq-len", "1024",
                 "--journal-dir", str(tmp_path / "journal"))
    try:
        reference = whole(srv, "/v1/chat/completions", CHAT)
        before = srv.sidecar_status()
        frontend_pid = before["frontend"]["pid"]
        with http_client().stream("POST", srv.base + "/v1/chat/completions", json=CHAT, timeout=120) as r:
            assert r.status_code == 200
            part = Events(r).read(3)
            os.kill(srv.proc.pid, signal.SIGSTOP)     # no restarts until both are dead
            try:
                os.kill(http_child(srv), signal.SIGKILL)
                part.read()
                rid = stream_request_id(srv, part.events[-1][0])
                wait_until(lambda: rid in [u["request_id"] for u in srv.sidecar_status()["pool_restart"]["unclaimed"]],
                           60, 0.1, what="the chat to finish unclaimed")
                os.kill(frontend_pid, signal.SIGKILL)
                wait_until(lambda: not _alive(frontend_pid), 10, 0.05, what="the frontend to die")
            finally:
                os.kill(srv.proc.pid, signal.SIGCONT)
        last = part.events[-1][0]
        srv.wait_healthy(timeout=60)
        with http_client().stream("GET", f"{srv.base}/v1/streams/{last.split('-')[0]}", headers={"Last-Event-ID": last},
                          timeout=120) as r:
            assert r.status_code == 200, r.read()
            rest = Events(r).read().events
        assert rest[-1] == (None, "[DONE]")
        assert comparable(part.events + rest) == comparable(reference)     # nothing skipped or repeated
        after = srv.sidecar_status()
        assert after["frontend"]["pid"] != frontend_pid
        assert after["pid"] == before["pid"] and executor_pids(after) == executor_pids(before)
        assert after["pool_restart"]["unclaimed_total"] == 0                # picked up
        assert not list((tmp_path / "journal").rglob("*.kept"))           # its file went with it
    finally:
        srv.stop()


def test_after_a_restart_only_the_credential_that_started_a_stream_resumes_it(tiny_model, tmp_path, runtime_root):
    """Every client of the HTTP server is one owner to the sidecar: the HTTP server binds each
    stream to the credential that started it (here, without an API key, each client's bearer
    token), and its id is random, not the sidecar's sequential request id."""
    srv = Server(tiny_model, runtime_root, tmp_path / "serve.log", "--max-seq-len", "1024")
    alice, mallory = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer mallory"}
    try:
        reference = whole(srv, "/v1/completions", COMPLETION)
        with http_client().stream("POST", srv.base + "/v1/completions", json=COMPLETION, headers=alice, timeout=120) as r:
            assert r.status_code == 200
            part = Events(r).read(5)
            os.kill(http_child(srv), signal.SIGKILL)
            part.read()
        last = part.events[-1][0]
        sid, rid = last.split("-")[0], stream_request_id(srv, last)
        assert len(sid) == 32 and f"{rid:x}" not in sid
        srv.wait_healthy(timeout=60)
        for guess in (f"{rid:x}", f"cmpl-{rid:x}", f"{rid - 1:x}"):          # sequential ids name no stream
            r = http_client().get(f"{srv.base}/v1/streams/{guess}", headers=mallory, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_stream_id", r.text
        for stranger in (mallory, {}, {"Authorization": "alice"}):          # the id alone is not enough
            r = http_client().get(f"{srv.base}/v1/streams/{sid}", headers={**stranger, "Last-Event-ID": last}, timeout=30)
            assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found", r.text
        with http_client().stream("GET", f"{srv.base}/v1/streams/{sid}", headers={**alice, "Last-Event-ID": last},
                          timeout=120) as r:
            assert r.status_code == 200, r.read()
            rest = Events(r).read().events
        assert rest[-1] == (None, "[DONE]")
        assert comparable(part.events + rest) == comparable(reference)     # the owner lost nothing
        assert srv.sidecar_status()["requests"]["finished"].get("cancelled", 0) == 0
    finally:
        srv.stop()
