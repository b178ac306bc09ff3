"""Benchmark: SIGKILL of one failure domain of `kvhold serve` mid-stream, the rest serving on.

    python -m tools.bench_domains --kill http --kills 20
    python -m tools.bench_domains --kill frontend --kills 20

`kvhold serve` (the tiny demo model on CPU, a hot standby) streams HTTP completions (greedy and
seeded sampling, and a chat) and, with `--kill frontend`, SDK streams too. For each kill every
stream is running; then:

* `--kill http`: the HTTP server process (`kvhold serve-http`) is SIGKILLed. Its clients' connections
  break; the supervisor restarts it on the listening socket it holds. Measured from the SIGKILL
  (CLOCK_MONOTONIC): a new request answered (`serving_again_ms`: a non-streaming completion sent
  right after the kill, waiting in the listen backlog, retried on a 503), and each stream's first
  event after it resumes through `GET /v1/streams/{request_id}` with `Last-Event-ID` (retried until
  the new server accepts it). Each stream's events (before the kill + after the resume) must equal
  the uninterrupted run's, event id and content.
* `--kill frontend`: the frontend process (`kvhold frontend`) is SIGKILLed; the supervisor restarts
  it, the HTTP server's streams and the SDK's pause and continue on their connections. Measured:
  each stream's first event after the pause (the event that ends the longest silence after the
  kill: the events on their way at the kill, sent before it, come first at the usual spacing;
  `first_event_after_kill_ms` is the first of those), the first and the last stream's; the texts
  against the uninterrupted run.

Counted per kill: streams lost (no complete, identical result), the memory owner's and the
executors' pids kept, tokens recomputed (SDK). The restart delays are set with
`--http-restart-backoff-s` / `--frontend-restart-backoff-s` (default here: the first delay, not
doubled, so that every kill measures what an isolated crash costs: 0.5 s for the HTTP server, 0.1 s
for the frontend; `--backoff` passes other values). Writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from kvhold.client.client import Client, wait_all
from kvhold.testing.make_model import ensure_demo_model
from kvhold.testing.serve_process import Events, ServeProcess, comparable

HTTP_BODIES = [
    ("/v1/completions", {"prompt": "The sidecar keeps the memory", "max_tokens": 240, "temperature": 0,
                         "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 220, "temperature": 0.9, "seed": 7,
                         "ignore_eos": True, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 200,
                              "temperature": 0, "ignore_eos": True, "stream": True}),
    ("/v1/completions", {"prompt": "A memory owner", "max_tokens": 230, "temperature": 0.7, "seed": 11,
                         "top_p": 0.9, "ignore_eos": True, "stream": True}),
]
SDK_REQUESTS = [dict(prompt_ids=list(range(2, 60)), max_tokens=200, temperature=0.8, seed=5, ignore_eos=True),
                dict(prompt="The frontend", max_tokens=210, temperature=0.0, ignore_eos=True)]
PROBE = {"prompt": "ping", "max_tokens": 1, "temperature": 0}


def summarize(values) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    v = np.asarray(values, dtype=float)
    return {"n": int(v.size), "p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99)),
            "max": float(v.max()), "mean": float(v.mean())}


def _gone(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def whole(srv: ServeProcess, path: str, body: dict) -> list:
    with httpx.stream("POST", srv.base + path, json=body, timeout=120) as r:
        r.raise_for_status()
        return Events(r, clock=time.monotonic_ns).read().events


def owner_state(st: dict) -> dict:
    return {"owner_pid": st["pid"], "executors": sorted(e["pid"] for e in st["executors"]),
            "generation": st["generation"]}


def http_stream(srv: ServeProcess, path: str, body: dict, started: threading.Barrier, kill: dict, out: dict,
                timeout_s: float) -> None:
    """One HTTP stream: read until the kill breaks it (or it ends), then resume it."""
    try:
        with httpx.stream("POST", srv.base + path, json=body, timeout=timeout_s) as r:
            r.raise_for_status()
            sse = Events(r, clock=time.monotonic_ns).read(3)
            started.wait()
            sse.read()
        events = sse.events
        out["before"] = len(events)
        if events and events[-1][1] == "[DONE]":
            out["events"] = events            # it ended before the kill
            return
        last = next(e[0] for e in reversed(events) if e[0])
        rid = last.split("-")[0]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with httpx.stream("GET", f"{srv.base}/v1/streams/{rid}", headers={"Last-Event-ID": last},
                                  timeout=timeout_s) as r:
                    if r.status_code in (502, 503):     # the new server not yet serving
                        out.setdefault("resume_503", 0)
                        out["resume_503"] += 1
                        time.sleep(0.02)
                        continue
                    out["resume_status"] = r.status_code
                    if r.status_code != 200:
                        out["error"] = r.read().decode(errors="replace")[:500]
                        break
                    rest = Events(r, clock=time.monotonic_ns).read().events
                    out["resumed_first_ns"] = rest[0][2] if rest else None
                    out["events"] = events + rest
                    return
            except httpx.TransportError:
                time.sleep(0.02)
        out.setdefault("events", events)
    except Exception as exc:  # noqa: BLE001 - the stream's failure is a measured result
        out["error"] = repr(exc)


def probe(srv: ServeProcess, kill: dict, out: dict, timeout_s: float) -> None:
    """A new request, sent right after the kill: when it is answered, the server serves again."""
    kill["done"].wait()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = httpx.post(srv.base + "/v1/completions", json=PROBE, timeout=timeout_s)
            if r.status_code == 200:
                out["serving_again_ns"] = time.monotonic_ns()
                return
            out.setdefault("probe_codes", []).append(r.status_code)
        except httpx.TransportError as exc:
            out.setdefault("probe_errors", []).append(type(exc).__name__)
        time.sleep(0.02)


def resumed_at(times: list[int], last_before: int, kill_ns: int) -> int | None:
    """The arrival of a stream's first event after the pause a kill made: the event that ends
    the longest gap between its events after the kill (events still on their way at the kill,
    sent before it, arrive first at the usual spacing; then the stream is silent until the
    restarted part serves it). None if none came after the kill."""
    if not times:
        return None
    best, gap, prev = None, -1, max(last_before, kill_ns) if last_before else kill_ns
    for t in times:
        if t - prev > gap:
            best, gap = t, t - prev
        prev = t
    return best


def trial(srv: ServeProcess, mode: str, index: int, reference, sdk_reference, timeout_s: float) -> dict:
    srv.wait_healthy(timeout=180)
    before = owner_state(srv.sidecar_status(timeout=10))
    victim = srv.child("serve-http" if mode == "http" else "frontend")
    n = len(HTTP_BODIES)
    started = threading.Barrier(n + 1 + (mode == "frontend"))
    kill = {"done": threading.Event()}
    outs = [dict() for _ in range(n)]
    threads = [threading.Thread(target=http_stream, args=(srv, p, b, started, kill, o, timeout_s), daemon=True)
               for (p, b), o in zip(HTTP_BODIES, outs)]
    probe_out: dict = {}
    if mode == "http":
        threads.append(threading.Thread(target=probe, args=(srv, kill, probe_out, timeout_s), daemon=True))
    sdk_box: dict = {}
    sdk_first: dict[int, list[int]] = {}      # SDK stream -> its events' arrival after the kill
    client = None
    if mode == "frontend":
        client = Client.for_instance(srv.instance, srv.runtime_root, timeout=timeout_s)
        sdk = [client.generate(r.get("prompt"), **{k: v for k, v in r.items() if k != "prompt"})
               if r.get("prompt") else client.generate(**r) for r in SDK_REQUESTS]

        def sdk_run():
            for s in sdk:
                next(s)
            started.wait()

            def on_event(stream, event):
                if kill.get("ns"):
                    sdk_first.setdefault(id(stream), []).append(time.monotonic_ns())
            sdk_box["results"] = wait_all(sdk, on_event)
        threads.append(threading.Thread(target=sdk_run, daemon=True))
    for t in threads:
        t.start()
    started.wait()
    kill["ns"] = time.monotonic_ns()
    os.kill(victim, signal.SIGKILL)
    kill["done"].set()
    while not _gone(victim):
        time.sleep(0.0005)
    kill["gone_ns"] = time.monotonic_ns()
    for t in threads:
        t.join(timeout_s)
    if client is not None:
        client.close()
    t0 = kill["ns"]
    ms = lambda ns: None if ns is None else (ns - t0) / 1e6      # noqa: E731
    identical, firsts, problems, buffered = 0, [], [], []
    for o, ref in zip(outs, reference):
        events = o.get("events") or []
        same = bool(events) and events[-1][1] == "[DONE]" and comparable(events) == comparable(ref)
        identical += same
        if not same:
            problems.append({k: v for k, v in o.items() if k != "events"} | {"events": len(events)})
        if mode == "http":
            firsts.append(o.get("resumed_first_ns"))
        else:
            before_ns = [e[2] for e in events if e[2] <= kill["ns"]]
            firsts.append(resumed_at([e[2] for e in events if e[2] > kill["ns"]],
                                     before_ns[-1] if before_ns else kill["ns"], kill["ns"]))
            buffered.append(next((e[2] for e in events if e[2] > kill["ns"]), None))
    sdk_identical = None
    if mode == "frontend":
        res = sdk_box.get("results") or []
        sdk_identical = sum(r.token_ids == ref for r, ref in zip(res, sdk_reference))
        for times in sdk_first.values():
            firsts.append(resumed_at(times, kill["ns"], kill["ns"]))
            buffered.append(times[0] if times else None)
        firsts += [None] * (len(SDK_REQUESTS) - len(sdk_first))
    got = [f for f in firsts if f is not None]
    after = owner_state(srv.sidecar_status(timeout=10))
    streams = n + (len(SDK_REQUESTS) if mode == "frontend" else 0)
    row = {
        "kill": index, "victim_pid": victim, "new_pid": srv.child("serve-http" if mode == "http" else "frontend"),
        "victim_gone_ms": ms(kill["gone_ns"]),
        "first_token_after_kill_ms": ms(min(got)) if got else None,
        "all_streams_resumed_ms": ms(max(got)) if len(got) == len(firsts) else None,
        # frontend: the first event read after the kill at all (sent before it, buffered on the way)
        "first_event_after_kill_ms": ms(min(b for b in buffered if b is not None))
        if any(b is not None for b in buffered) else None,
        "streams": streams, "identical": identical + (sdk_identical or 0),
        "lost": streams - identical - (sdk_identical or 0),
        "owner_and_executors_kept": before == after,
        "tokens_recomputed": sum(r.recomputed_tokens for r in sdk_box.get("results") or []) if mode == "frontend" else None,
        "problems": problems,
    }
    if mode == "http":
        row["serving_again_ms"] = ms(probe_out.get("serving_again_ns"))
        row["probe"] = {k: v for k, v in probe_out.items() if k != "serving_again_ns"}
        row["resume_retries_503"] = sum(o.get("resume_503", 0) for o in outs)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kill", required=True, choices=("http", "frontend"), help="the process SIGKILLed")
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--backoff", default=None, metavar="FIRST,MAX",
                    help="the killed part's restart delays (default: its first delay, not doubled)")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="per stream and per trial")
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/domains_<kill>_cpu.json")
    args = ap.parse_args(argv)
    args.out = args.out or Path(f"bench/results/domains_{args.kill}_cpu.json")
    backoff = args.backoff or ("0.5,0.5" if args.kill == "http" else "0.1,0.1")
    model, _ = ensure_demo_model()
    root = Path(tempfile.mkdtemp(prefix="kvh-dom-"))
    flags = ["--max-seq-len", "1024", "--lease-ms", "3000", "--log-level", "WARNING",
             f"--{args.kill}-restart-backoff-s", backoff]
    out = {"command": "python -m tools.bench_domains " + " ".join(argv or sys.argv[1:]),
           "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "kill": args.kill, "serve_flags": flags, "restart_backoff_s": backoff,
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "loadavg_at_start": os.getloadavg()},
           "http_requests": HTTP_BODIES, "sdk_requests": SDK_REQUESTS if args.kill == "frontend" else [],
           "goals": {"lost": 0}}
    srv = ServeProcess(flags, root, model=model, log_path=root / "serve.log").spawn()
    rows = []
    try:
        srv.wait_healthy(timeout=180)
        reference = [whole(srv, p, b) for p, b in HTTP_BODIES]
        with Client.for_instance(srv.instance, root, timeout=60) as c:
            sdk_reference = [r.token_ids for r in wait_all(
                [c.generate(r["prompt"], **{k: v for k, v in r.items() if k != "prompt"}) if "prompt" in r
                 else c.generate(**r) for r in SDK_REQUESTS])]
        for i in range(args.kills):
            row = trial(srv, args.kill, i, reference, sdk_reference, args.timeout_s)
            rows.append(row)
            extra = f", serving again {row['serving_again_ms'] or -1:.0f} ms" if args.kill == "http" else ""
            print(f"{args.kill} kill {i + 1}/{args.kills}{extra}, first resumed token "
                  f"{row['first_token_after_kill_ms'] or -1:.0f} ms, all {row['all_streams_resumed_ms'] or -1:.0f} ms, "
                  f"identical {row['identical']}/{row['streams']}, kept {row['owner_and_executors_kept']}", flush=True)
    finally:
        out["final_status"] = {}
        try:
            st = srv.sidecar_status(timeout=10)
            out["final_status"] = {"recoveries": len(st.get("recoveries") or []),
                                   "finished": st["requests"].get("finished")}
        except Exception as exc:  # noqa: BLE001
            out["final_status"] = {"error": repr(exc)}
        srv.stop(60)
        log_tail = (root / "serve.log").read_text(errors="replace")[-3000:]
    out["machine"]["loadavg_at_end"] = os.getloadavg()
    out["kills"] = rows
    out["summary"] = {
        "kills": len(rows),
        "serving_again_ms": summarize([r.get("serving_again_ms") for r in rows]) if args.kill == "http" else None,
        "first_token_after_kill_ms": summarize([r["first_token_after_kill_ms"] for r in rows]),
        "all_streams_resumed_ms": summarize([r["all_streams_resumed_ms"] for r in rows]),
        "first_event_after_kill_ms": summarize([r.get("first_event_after_kill_ms") for r in rows]),
        "streams": sum(r["streams"] for r in rows), "lost": sum(r["lost"] for r in rows),
        "owner_or_executors_changed_kills": sum(not r["owner_and_executors_kept"] for r in rows),
        "tokens_recomputed": (sum(r["tokens_recomputed"] or 0 for r in rows) if args.kill == "frontend" else None),
    }
    out["goals"]["met"] = bool(rows) and out["summary"]["lost"] == 0
    out["serve_log_tail"] = log_tail
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["summary"], indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
