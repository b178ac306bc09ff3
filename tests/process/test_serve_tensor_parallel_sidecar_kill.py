"""`kvhold serve -tp 2` (CPU, gloo) loses its sidecar to a SIGKILL while several OpenAI
streams are in flight: the spare sidecar (or, with --no-sidecar-spare, a restarted one)
re-adopts both executor groups (the same leaders and rank processes, in the same roles) and
every request; each HTTP stream goes on (resumed by Last-Event-ID, should its connection
break) to the same events as an uninterrupted TP=1 `kvhold serve` run, nothing lost, nothing
failed. The new sidecar watches the re-adopted ranks: a rank of the active group killed
afterwards ends that group and the standby group resumes. Once serve is stopped no process of
it is left."""
from __future__ import annotations

import contextlib
import json
import os
import signal

import httpx
import pytest

from kvhold.executor.tensor_parallel.ranks import group_pids
from kvhold.protocol.procfs import pid_alive
from kvhold.testing.serve_process import http_client
from tests.process.helpers import Events, Server, comparable, wait_until

TP_FLAGS = ("-tp", "2", "--cpu-threads", "1")

# greedy and seeded, completions and chat; long enough to be mid-stream at the kill
STREAMS = [
    ("/v1/completions", {"prompt": "The sidecar keeps the memory", "max_tokens": 160, "temperature": 0}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 150, "temperature": 0.8, "seed": 7}),
    ("/v1/completions", {"prompt": "One two three four", "max_tokens": 140, "temperature": 1.0,
                         "top_p": 0.9, "top_k": 20, "seed": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 130,
                              "temperature": 0.7, "seed": 11}),
]


def _body(body: dict) -> dict:
    return {**body, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def _whole(srv: Server, path: str, body: dict) -> list:
    with http_client().stream("POST", srv.base + path, json=_body(body), timeout=120) as r:
        assert r.status_code == 200
        return Events(r).read().events


def _finish(srv: Server, events: list) -> tuple[list, int]:
    """The stream read to its end: `events` so far, then, while it ends short of [DONE] (its
    connection broke), the rest from GET /v1/streams with the last event's id. Returns the
    whole stream and the number of resumes it took."""
    resumes = 0
    while not events or events[-1] != (None, "[DONE]"):
        assert resumes < 5, events[-3:]
        last = events[-1][0]
        resumes += 1
        with http_client().stream("GET", f"{srv.base}/v1/streams/{last.split('-')[0]}",
                          headers={"Last-Event-ID": last}, timeout=120) as r:
            assert r.status_code == 200, r.read()
            events = events + Events(r).read().events
    return events, resumes


def _groups(status: dict) -> dict[str, list[int]]:
    """{role: [leader, rank 1]} as the sidecar reports the groups, checked against /proc."""
    out = {}
    for e in status["executors"]:
        assert len(e["ranks"]) == 2 and e["ranks"] == group_pids(e["pid"]), e
        out[e["role"]] = e["ranks"]
    return out


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except FileNotFoundError:
            continue
        for task in tasks:
            try:
                kids = {int(c) for c in open(f"/proc/{p}/task/{task}/children").read().split()}
            except FileNotFoundError:
                continue
            todo += list(kids - out)
            out |= kids
    return out


def _with_instance(instance: str) -> set[int]:
    """Every process whose command line names the instance."""
    out = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmd = open(f"/proc/{name}/cmdline", "rb").read()
            except OSError:
                continue
            if instance.encode() in cmd and pid_alive(int(name)):
                out.add(int(name))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("spare", [True, False], ids=["spare", "no-spare"])
def test_sigkill_of_the_sidecar_mid_stream_under_serve_tp2(tiny_model, tmp_path, runtime_root, spare):
    ref_srv = Server(tiny_model, runtime_root, tmp_path / "ref.log", "--standbys", "0", "--no-sidecar-spare")
    try:
        reference = [_whole(ref_srv, path, body) for path, body in STREAMS]     # TP=1, uninterrupted
    finally:
        ref_srv.stop()
    assert ref_srv.proc.returncode == 0

    extra = () if spare else ("--no-sidecar-spare",)
    srv = Server(tiny_model, runtime_root, tmp_path / "serve.log", *TP_FLAGS, *extra)
    ours: set[int] = {srv.proc.pid}
    try:
        before = wait_until(lambda: (st := srv.sidecar_status()) and len(st["executors"]) == 2
                            and all(e.get("ready") and len(e.get("ranks") or ()) == 2 for e in st["executors"])
                            and (st["spares"] or not spare) and st, 120, 0.1,
                            what="both groups ready (and the spare waiting)")
        groups = _groups(before)
        assert set(groups) == {"active", "standby"}
        assert len(before["spares"]) == (1 if spare else 0)
        ours |= _descendants(srv.proc.pid) | {p for ranks in groups.values() for p in ranks}

        with httpx.Client(timeout=120) as http, contextlib.ExitStack() as open_streams:
            responses = [open_streams.enter_context(http.stream("POST", srv.base + path, json=_body(body)))
                         for path, body in STREAMS]
            assert all(r.status_code == 200 for r in responses)
            parts = [Events(r).read(3) for r in responses]     # every stream has tokens
            os.kill(before["pid"], signal.SIGKILL)              # the sidecar alone
            for p in parts:
                p.read()
        finished = [_finish(srv, p.events) for p in parts]
        for (path, body), (got, _), want in zip(STREAMS, finished, reference):
            assert comparable(got) == comparable(want), (path, body)      # as the TP=1 run, event for event
            usage = json.loads(got[-2][1])["usage"]
            assert usage["completion_tokens"] == body["max_tokens"]
        print("resumes per stream:", [n for _, n in finished])

        after = wait_until(lambda: (st := srv.sidecar_status()) and st["pid"] != before["pid"] and st,
                           60, 0.1, what="the new sidecar")
        ours |= _descendants(srv.proc.pid) | {after["pid"], *after["spares"]}
        assert after["adoption"]["previous_pid"] == before["pid"]
        if spare:
            assert after["pid"] == before["spares"][0]
        # the same groups: the same leaders and rank processes, in the same roles, re-adopted
        assert _groups(after) == groups
        assert {e["via"] for e in after["executors"]} == {"readopted"}
        assert all(pid_alive(p) for ranks in groups.values() for p in ranks)
        assert {(e["role"], e["pid"]) for e in after["adoption"]["executors"]} == {
            (role, ranks[0]) for role, ranks in groups.items()}
        assert after["weights"]["load_ms"] is None and not after["recoveries"]       # nothing reloaded
        assert after["request_deaths"]["failed_total"] == 0
        assert after["requests"]["finished"].get("cancelled", 0) == 0
        assert after["requests"]["in_flight"] == 0
        log = (tmp_path / "serve.log").read_text()
        assert (f"re-adopted the pool of sidecar pid {before['pid']}: 2 live executors, "
                f"{len(STREAMS)} in-flight requests") in log                              # all mid-stream
        if spare:
            assert (f"the sidecar pid {before['pid']} was killed by SIGKILL: the spare pid {after['pid']} "
                    f"took over") in log
        else:
            assert f"the sidecar pid {before['pid']} was killed by SIGKILL: restarting it" in log
        health = srv.wait_healthy(timeout=60)
        assert health["status"] == "ok" and health["active_pid"] == groups["active"][0]

        # the re-adopted groups are watched: rank 1 of the active one killed mid-stream ends that
        # group, and the re-adopted standby group resumes the stream
        path, body = STREAMS[1]
        with http_client().stream("POST", srv.base + path, json=_body(body), timeout=120) as r:
            assert r.status_code == 200
            part = Events(r).read(3)
            os.kill(groups["active"][1], signal.SIGKILL)
            part.read()
        got, _ = _finish(srv, part.events)
        assert comparable(got) == comparable(reference[1])
        wait_until(lambda: not any(pid_alive(p) for p in groups["active"]), 30, 0.1,
                   what="the whole active group to be gone")
        final = srv.wait_healthy(timeout=60)
        assert final["active_pid"] == groups["standby"][0]
        status = srv.sidecar_status()
        assert [r["requests_lost"] for r in status["recoveries"]] == [0]
        assert status["request_deaths"]["failed_total"] == 0
        ours |= _descendants(srv.proc.pid)
        running = _with_instance(srv.instance)               # the ranks' command lines name none
        assert groups["standby"][0] in running and running <= ours, (running, ours)
    finally:
        srv.stop()
    assert srv.proc.returncode == 0
    ours.discard(before["pid"])
    wait_until(lambda: not any(pid_alive(p) for p in ours), 30, 0.1,
               what=f"every process of serve to be gone: {sorted(p for p in ours if pid_alive(p))}")
    assert not _with_instance(srv.instance)
