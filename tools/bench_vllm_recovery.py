"""Benchmark: SIGKILL of a vLLM engine mid-stream, under kvhold and without it.

    VLLM_HOST_IP=127.0.0.1 ~/.cache/kvhold-vllm-venv/bin/python -m tools.bench_vllm_recovery --kills 20

kvhold: `kvhold serve --workload vllm --kv-mode foreign` (a sidecar whose executors are vLLM
engines, one hot standby; kvhold.vllm_bridge) with streams over both the OpenAI-compatible
HTTP API and the ZeroMQ SDK. The streams' prompts share a prefix of 3 full blocks (vLLM's
prefix caching, on by default under the bridge, hits on kvhold's shared cached pages; after a
kill mid-stream the successor loads the resumed requests' prefixes into its blocks and vLLM
caches them, so the next trial hits vLLM's own cache); two HTTP streams and one SDK stream ask for
`logprobs` top 2, another SDK stream for `prompt_logprobs` top 2. An uninterrupted run gives
the reference, a second one (its prompts cached, as a trial's are) shows how far two runs
without a kill differ in their log-probs (CPU float32: in the last bits, as batches form
differently); then, per trial, the same streams start, the active engine is SIGKILLed once a random number of tokens has
streamed, and the bench records on CLOCK_MONOTONIC when each stream's next token arrives.
Figures: kill -> first resumed token (the first token any stream receives after the kill)
P50/P99, the slowest stream's resumption, the sidecar's own recovery record (detect ->
first token; KV tokens loaded from kvhold's pages and tokens recomputed, as the connector
counted them), requests lost, outputs (tokens and text) equal to the reference, log-probs
equal to each uninterrupted run's (or where they first differ and the largest difference),
and each stream's cached prompt tokens (usage.prompt_tokens_details.cached_tokens). Before each trial the bench
waits for the re-armed standby to be ready. Then `--idle-kills` times: SIGKILL of the active
engine with no request running, and the same streams on its successor, whose vLLM cache is
empty: their prefixes come from kvhold's cached pages, offered to vLLM as external hits (the
connector logs each; the bench counts those lines in the server's log).

Plain vLLM: its OpenAI server (`python -m vllm.entrypoints.openai.api_server`, the same
engine settings), the same HTTP streams, SIGKILL of its EngineCore process: what each stream
receives, /health after the kill, whether and when the server exits, whether it serves
again on its own, and how long a restarted server takes to serve (every in-flight request
is lost either way).

Writes bench/results/vllm_recovery_cpu.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
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
from kvhold.testing.serve_process import ServeProcess

SIDECAR_FLAGS = ["--workload", "vllm", "--kv-mode", "foreign", "--page-tokens", "32", "--kv-pages", "128",
                 "--max-seq-len", "320", "--max-batch", "8", "--max-batch-tokens", "256",
                 "--startup-lease-ms", "900000", "--lease-ms", "3000"]
STARTUP_S = 900
MAX_TOKENS = 160                 # long enough that a kill lands while the engine still generates
SHARED_PREFIX = 96               # prompt tokens every kvhold stream shares: 3 full blocks of 32 tokens
TOP_LOGPROBS = 2


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_requests(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [dict(prompt_ids=[rng.randrange(3, 500) for _ in range(rng.randint(20, 80))], max_tokens=MAX_TOKENS,
                 temperature=0.0, ignore_eos=True) for _ in range(n)]


def make_shared_requests(n: int, seed: int, prefix: list[int], logprobs: tuple,
                         prompt_logprobs: tuple = ()) -> list[dict]:
    """kvhold's streams: `prefix` (whole blocks, so vLLM's prefix cache hits on kvhold's shared
    pages) and 4..40 tokens of their own; stream i asks for `logprobs` top k where i is in
    `logprobs`, and for prompt_logprobs top k where i is in `prompt_logprobs`."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        r = dict(prompt_ids=prefix + [rng.randrange(3, 500) for _ in range(rng.randint(4, 40))],
                 max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        if i in logprobs:
            r["logprobs"] = TOP_LOGPROBS
        if i in prompt_logprobs:
            r["prompt_logprobs"] = TOP_LOGPROBS
        reqs.append(r)
    return reqs


class Recorder:
    """Arrival times of tokens on every stream (monotonic ns), and the kill."""

    def __init__(self):
        self.lock = threading.Lock()
        self.count = 0
        self.kill_at: int | None = None
        self.kill_ns = 0
        self.after: dict[str, int] = {}           # stream -> first token time after the kill
        self.killed = threading.Event()

    def token(self, name: str) -> None:
        now = time.monotonic_ns()
        with self.lock:
            self.count += 1
            if self.kill_ns and name not in self.after:
                self.after[name] = now
            fire = self.kill_at is not None and self.count == self.kill_at
        if fire:
            self.killed.set()


def http_stream(base: str, req: dict, name: str, rec: Recorder | None, out: dict, model: str,
                usage: bool = False) -> None:
    """One streamed completion; with `usage`, the final usage chunk is asked for (its cached
    tokens recorded), and the request's `logprobs` k, if any, is sent and every chunk's
    log-probs kept."""
    body = {"model": model, "prompt": req["prompt_ids"], "max_tokens": req["max_tokens"], "temperature": 0.0,
            "stream": True, "ignore_eos": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    if req.get("logprobs") is not None:
        body["logprobs"] = req["logprobs"]
    text, error, logprobs, cached = [], None, [], None
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=httpx.Timeout(300.0)) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}"
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = str(chunk["error"])[:200]
                    continue
                if chunk.get("usage"):
                    cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                if not chunk.get("choices"):
                    continue
                if chunk["choices"][0].get("logprobs"):
                    logprobs.append(chunk["choices"][0]["logprobs"])
                piece = chunk["choices"][0].get("text", "")
                if piece:
                    text.append(piece)
                    if rec is not None:
                        rec.token(name)
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"[:200]
    out[name] = {"text": "".join(text), "error": error, "logprobs": _merge_logprobs(logprobs),
                 "cached_tokens": cached}


def _merge_logprobs(chunks: list[dict]) -> dict | None:
    """A completion stream's log-prob chunks as one: each list field concatenated (the text
    offsets are left out: they count from each chunk's own text)."""
    if not chunks:
        return None
    return {k: [x for c in chunks for x in (c.get(k) or [])] for k in ("tokens", "token_logprobs", "top_logprobs")}


def run_http(base: str, requests: list[dict], rec: Recorder | None, model: str, prefix: str = "http") -> dict:
    out: dict = {}
    threads = [threading.Thread(target=http_stream, args=(base, r, f"{prefix}{i}", rec, out, model), daemon=True)
               for i, r in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return out


# --------------------------------------------------------------------------- kvhold
class KvholdServer(ServeProcess):
    def __init__(self, model: Path, root: Path, log: Path):
        super().__init__(["--log-level", "INFO", *SIDECAR_FLAGS, "--standbys", "1"], root, model=model,
                         instance=f"bvllm{os.getpid()}", log_path=log, new_session=True)
        self.name = model.name                         # kvhold serve's served model name
        self.root = root
        self.spawn()

    def client(self, timeout=60.0) -> Client:
        return Client.for_instance(self.instance, self.root, timeout=timeout)

    def status(self) -> dict:
        with self.client(10) as c:
            return c.status()

    def wait_ready(self, timeout=STARTUP_S) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvhold serve exited with {self.proc.returncode}")
            try:
                r = httpx.get(self.base + "/health", timeout=5)
                if r.status_code == 200 and r.json().get("standbys_ready", 0) >= 1:
                    st = self.status()
                    active = [e for e in st["executors"] if e["role"] == "active"]
                    if len(active) == 1:
                        return active[0]
            except (httpx.HTTPError, Exception):
                pass
            time.sleep(0.2)
        raise TimeoutError("kvhold serve not ready")

    def stop(self, timeout: float = 60.0):
        return super().stop(timeout)


def run_mixed(server: KvholdServer, http_reqs, sdk_reqs, rec: Recorder | None):
    """HTTP streams in threads, SDK streams in this thread; returns (http outputs, sdk results)."""
    out: dict = {}
    threads = [threading.Thread(target=http_stream, args=(server.base, r, f"http{i}", rec, out, server.name, True),
                                daemon=True)
               for i, r in enumerate(http_reqs)]
    for t in threads:
        t.start()
    sdk, sdk_error = [], None
    with server.client(300) as c:
        streams = [c.generate(**r) for r in sdk_reqs]
        names = {s.request_id: f"sdk{i}" for i, s in enumerate(streams)}
        try:
            sdk = wait_all(streams, (lambda s, e: rec.token(names[s.request_id])) if rec else None)
        except Exception as exc:        # a lost SDK stream is a finding, not a crash of the bench
            sdk_error = f"{type(exc).__name__}: {exc}"[:200]
    for t in threads:
        t.join(600)
    return out, sdk, sdk_error


def sdk_view(r) -> dict:
    """What an SDK result is compared on: its tokens, text and log-probs."""
    return {"token_ids": r.token_ids, "text": r.text, "logprobs": r.logprobs, "prompt_logprobs": r.prompt_logprobs}


def first_logprob_mismatch(out_http: dict, ref_http: dict, out_sdk: list, ref_sdk: list) -> dict | None:
    """Where a stream's log-probs first differ from the reference's: the stream, the field, the
    position and both values (as text), for the record."""
    pairs = [(n, "logprobs." + k, out_http[n]["logprobs"] and out_http[n]["logprobs"][k],
              ref_http[n]["logprobs"] and ref_http[n]["logprobs"][k])
             for n in sorted(ref_http) for k in ("tokens", "token_logprobs", "top_logprobs")]
    pairs += [(f"sdk{i}", k, o[k], r[k]) for i, (o, r) in enumerate(zip(out_sdk, ref_sdk))
              for k in ("logprobs", "prompt_logprobs")]
    for name, field_, got, want in pairs:
        if got == want:
            continue
        got, want = list(got or []), list(want or [])
        at = next((j for j, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
        return {"stream": name, "field": field_, "index": at, "lengths": [len(got), len(want)],
                "got": repr(got[at])[:300] if at < len(got) else None,
                "reference": repr(want[at])[:300] if at < len(want) else None}
    return None


def _lp_values(http: dict, sdk: list) -> list:
    """Every log-prob number of a run's streams (HTTP and SDK), in a fixed order; None where a
    stream has none there."""
    vals = []
    for n in sorted(http):
        lp = http[n]["logprobs"] or {}
        vals += list(lp.get("token_logprobs") or [])
        vals += [v for d in (lp.get("top_logprobs") or []) for _, v in sorted((d or {}).items())]
    for v in sdk:
        for t in (v["logprobs"] or []) + (v["prompt_logprobs"] or []):
            vals += [t.logprob, *(x for _, x in t.top)]
    return vals


def logprob_max_abs_diff(http: dict, sdk: list, ref_http: dict, ref_sdk: list) -> float | None:
    """The largest |difference| between a run's log-probs and the reference's, position by
    position (None when their shapes differ: compared by mismatch instead)."""
    a, b = _lp_values(http, sdk), _lp_values(ref_http, ref_sdk)
    if len(a) != len(b) or any((x is None) != (y is None) for x, y in zip(a, b)):
        return None
    return max((abs(x - y) for x, y in zip(a, b) if x is not None), default=0.0)


def cached_of(out_http: dict, out_sdk: list) -> dict:
    """Prompt tokens each stream's usage reports cached (usage.prompt_tokens_details.cached_tokens)."""
    return {**{n: v.get("cached_tokens") for n, v in sorted(out_http.items())},
            **{f"sdk{i}": r.cached_tokens for i, r in enumerate(out_sdk)}}


def bench_kvhold(model: Path, args, results_dir: Path) -> dict:
    rng = random.Random(args.seed)
    prefix = [random.Random(args.seed + 2).randrange(3, 500) for _ in range(SHARED_PREFIX)]
    # log-probs top 2 on two HTTP streams and one SDK stream, prompt_logprobs on another SDK stream
    http_reqs = make_shared_requests(args.http_streams, args.seed, prefix, logprobs=(0, 1))
    sdk_reqs = make_shared_requests(args.sdk_streams, args.seed + 1, prefix, logprobs=(0,), prompt_logprobs=(1,))
    root = Path(tempfile.mkdtemp(prefix="kvh-", dir="/tmp"))
    server = KvholdServer(model, root, results_dir / "vllm_recovery.kvhold.log")
    trials = []
    try:
        t0 = time.monotonic()
        server.wait_ready()
        startup_s = time.monotonic() - t0
        counter = Recorder()
        ref_http, ref_sdk, err = run_mixed(server, http_reqs, sdk_reqs, counter)
        events = counter.count                  # stream events of an uninterrupted run
        assert err is None and not any(v["error"] for v in ref_http.values()), (err, ref_http)
        ref_sdk_view = [sdk_view(r) for r in ref_sdk]
        ref_cached = cached_of(ref_http, ref_sdk)
        assert all(v["logprobs"] for n, v in ref_http.items() if http_reqs[int(n[4:])].get("logprobs")), ref_http
        assert all(r.logprobs for r, q in zip(ref_sdk, sdk_reqs) if q.get("logprobs"))
        assert all(r.prompt_logprobs for r, q in zip(ref_sdk, sdk_reqs) if q.get("prompt_logprobs"))
        # a second uninterrupted run, no kill: how the same streams compare to the reference with
        # no takeover (its prompts now hit the prefix cache, batches may form differently)
        rep_http, rep_sdk, rep_err = run_mixed(server, http_reqs, sdk_reqs, None)
        assert rep_err is None and not any(v["error"] for v in rep_http.values()), (rep_err, rep_http)
        rep_view = [sdk_view(r) for r in rep_sdk]
        control = {
            "text_identical": [v["text"] for v in rep_view] == [v["text"] for v in ref_sdk_view]
            and [v["token_ids"] for v in rep_view] == [v["token_ids"] for v in ref_sdk_view]
            and all(rep_http[n]["text"] == ref_http[n]["text"] for n in ref_http),
            "logprobs_mismatch": first_logprob_mismatch(rep_http, ref_http, rep_view, ref_sdk_view),
            "logprobs_max_abs_diff": logprob_max_abs_diff(rep_http, rep_view, ref_http, ref_sdk_view),
            "cached_tokens": cached_of(rep_http, rep_sdk)}
        control["logprobs_identical"] = control["logprobs_mismatch"] is None
        print(f"uninterrupted repeat: {control}", flush=True)
        for k in range(args.kills):
            if time.monotonic() > args.stop_at:
                print(f"time budget spent after {k} kills", flush=True)
                break
            t_wait = time.monotonic()
            active = server.wait_ready()
            rearm_s = time.monotonic() - t_wait
            rec = Recorder()
            rec.kill_at = rng.randint(events // 20, events // 6)   # early: client delivery lags the engine

            def killer():
                rec.killed.wait(600)
                rec.kill_ns = time.monotonic_ns()
                os.kill(active["pid"], signal.SIGKILL)

            kt = threading.Thread(target=killer, daemon=True)
            kt.start()
            out_http, out_sdk, sdk_error = run_mixed(server, http_reqs, sdk_reqs, rec)
            if not rec.killed.is_set():
                raise RuntimeError(f"the streams ended before the kill: {out_http} {sdk_error}")
            kt.join(5)
            lost = sum(1 for v in out_http.values() if v["error"]) + (len(sdk_reqs) if sdk_error else 0)
            text_same = (not sdk_error and [r.token_ids for r in out_sdk] == [v["token_ids"] for v in ref_sdk_view]
                         and [r.text for r in out_sdk] == [v["text"] for v in ref_sdk_view]
                         and all(out_http[n]["text"] == ref_http[n]["text"] for n in ref_http))
            logprobs_same = (not sdk_error
                             and [(r.logprobs, r.prompt_logprobs) for r in out_sdk]
                             == [(v["logprobs"], v["prompt_logprobs"]) for v in ref_sdk_view]
                             and all(out_http[n]["logprobs"] == ref_http[n]["logprobs"] for n in ref_http))
            # identical: every stream's tokens and text; the log-probs are compared apart (below): on
            # CPU two uninterrupted runs of these streams already differ in their last bits, as
            # the batches they share form differently (the repeat run records by how much)
            identical = text_same
            mismatch = None if logprobs_same or sdk_error else first_logprob_mismatch(
                out_http, ref_http, [sdk_view(r) for r in out_sdk], ref_sdk_view)
            cached = cached_of(out_http, out_sdk) if not sdk_error else {}
            out_view = [sdk_view(r) for r in out_sdk]
            lp_diff = None if sdk_error else logprob_max_abs_diff(out_http, out_view, ref_http, ref_sdk_view)
            # the same against the second uninterrupted run (whose prompts hit the cache, as a trial's do)
            mismatch_rep = None if sdk_error else first_logprob_mismatch(out_http, rep_http, out_view, rep_view)
            lp_diff_rep = None if sdk_error else logprob_max_abs_diff(out_http, out_view, rep_http, rep_view)
            firsts = sorted(rec.after.values())
            record = {}
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:      # the record of this failover (status lists the last 16)
                found = [r for r in server.status()["recoveries"] if r.get("fenced_epoch") == active["epoch"]]
                waiting = sum(found[-1].get(f"requests_{c}", 0) for c in ("resumable", "damaged", "lost")) if found else 0
                if found and (found[-1].get("first_token_ns") or not waiting):
                    record = found[-1] if found[-1].get("first_token_ns") else {}
                    break
                time.sleep(0.2)
            trial = {
                "kill_after_tokens": rec.kill_at, "rearm_wait_s": round(rearm_s, 1),
                # client side: the first token any stream receives after the kill (may be one the
                # engine produced before it: delivery lags the engine under load)
                "first_resumed_token_ms": round((firsts[0] - rec.kill_ns) / 1e6, 2) if firsts else None,
                "all_streams_resumed_ms": round((firsts[-1] - rec.kill_ns) / 1e6, 2)
                if len(firsts) == len(http_reqs) + len(sdk_reqs) else None,
                "streams_resumed": len(firsts), "requests_lost": lost, "identical": identical,
                "text_identical": text_same, "logprobs_identical": logprobs_same, "logprobs_mismatch": mismatch,
                "logprobs_max_abs_diff": lp_diff,
                "logprobs_identical_to_repeat": not sdk_error and mismatch_rep is None,
                "logprobs_max_abs_diff_to_repeat": lp_diff_rep,
                "cached_tokens": cached, "cached_tokens_total": sum(v or 0 for v in cached.values()),
                "sdk_error": sdk_error,
                "sidecar_detect_to_first_token_ms": round((record["first_token_ns"] - record["detect_ns"]) / 1e6, 2)
                if record else None,
                # the sidecar's own clock is CLOCK_MONOTONIC too (kvhold.protocol.leases.now_ns)
                "kill_to_first_resumed_token_ms": round((record["first_token_ns"] - rec.kill_ns) / 1e6, 2)
                if record else None,
                "tokens_loaded_from_kvhold": record.get("tokens_kept"),
                "tokens_recomputed": record.get("tokens_recomputed"),
                "pages_checked": record.get("pages_checked"), "pages_bad": record.get("pages_bad"),
                "requests_resumable": record.get("requests_resumable"),
                "requests_damaged": record.get("requests_damaged"),
            }
            trials.append(trial)
            print(f"kill {k + 1}/{args.kills}: {trial}", flush=True)
            if args.progress is not None:
                args.progress(summarize(trials, http_reqs, sdk_reqs, startup_s, args.kills, ref_cached, control))
        idle = []
        for j in range(args.idle_kills):
            if time.monotonic() > args.stop_at:
                print(f"time budget spent after {j} idle kills", flush=True)
                break
            idle.append(idle_kill(server, http_reqs, sdk_reqs, ref_http, ref_sdk_view))
            print(f"idle kill {j + 1}/{args.idle_kills}: {idle[-1]}", flush=True)
            if args.progress is not None:
                args.progress(summarize(trials, http_reqs, sdk_reqs, startup_s, args.kills, ref_cached, control,
                                        idle))
    finally:
        server.stop()
    return summarize(trials, http_reqs, sdk_reqs, startup_s, args.kills, ref_cached, control, idle)


EXTERNAL_HIT = re.compile(r"request (0x[0-9a-f]+): (\d+) KV tokens loaded from kvhold's prefix cache")


def idle_kill(server: KvholdServer, http_reqs, sdk_reqs, ref_http, ref_sdk_view) -> dict:
    """SIGKILL of the active engine while no request runs, then the same streams on the engine
    that took over: its vLLM cache starts empty (nothing to resume, nothing loaded), so their
    prefixes can only come from kvhold's cached pages the takeover kept, offered as external hits.
    Records the executor log's external-hit lines (the connector's, per request) and each stream's
    cached tokens, and compares tokens, text and log-probs with the reference."""
    active = server.wait_ready()
    os.kill(active["pid"], signal.SIGKILL)
    t_kill = time.monotonic()
    deadline = t_kill + STARTUP_S
    while time.monotonic() < deadline:              # the successor, with a re-armed standby
        now_active = server.wait_ready()
        if now_active["pid"] != active["pid"]:
            break
        time.sleep(0.2)
    rearm_s = time.monotonic() - t_kill
    offset = server.log_path.stat().st_size
    out_http, out_sdk, sdk_error = run_mixed(server, http_reqs, sdk_reqs, None)
    time.sleep(0.5)                                  # the executor's log lines of these requests
    with open(server.log_path, "rb") as f:
        f.seek(offset)
        hits = [int(m.group(2)) for m in EXTERNAL_HIT.finditer(f.read().decode("utf-8", "replace"))]
    out_view = [sdk_view(r) for r in out_sdk]
    lost = sum(1 for v in out_http.values() if v["error"]) + (len(sdk_reqs) if sdk_error else 0)
    text_same = (not sdk_error and [v["token_ids"] for v in out_view] == [v["token_ids"] for v in ref_sdk_view]
                 and [v["text"] for v in out_view] == [v["text"] for v in ref_sdk_view]
                 and all(out_http[n]["text"] == ref_http[n]["text"] for n in ref_http))
    mismatch = None if sdk_error else first_logprob_mismatch(out_http, ref_http, out_view, ref_sdk_view)
    cached = cached_of(out_http, out_sdk) if not sdk_error else {}
    return {"rearm_s": round(rearm_s, 1), "requests_lost": lost, "sdk_error": sdk_error,
            "identical": text_same, "logprobs_identical": not sdk_error and mismatch is None,
            "logprobs_max_abs_diff": None if sdk_error else logprob_max_abs_diff(out_http, out_view, ref_http,
                                                                                 ref_sdk_view),
            "external_hit_requests": len(hits), "external_hit_tokens": sum(hits), "external_hits": hits,
            "cached_tokens": cached, "cached_tokens_total": sum(v or 0 for v in cached.values())}


def summarize(trials, http_reqs, sdk_reqs, startup_s, planned, ref_cached=None, control=None, idle=()) -> dict:
    """Latencies over the kills that interrupted generation (the takeover resumed requests);
    a kill that lands after the engine has finished every request only delays delivery."""
    mid = [t for t in trials if (t["requests_resumable"] or 0) + (t["requests_damaged"] or 0) > 0]
    # the goal's figure: the kill to the first token the sidecar recorded as resumed; a client can
    # see a token sooner (one in flight at the kill), counted apart
    lat = np.array([t["kill_to_first_resumed_token_ms"] for t in mid if t.get("kill_to_first_resumed_token_ms")
                    is not None])
    client = np.array([t["first_resumed_token_ms"] for t in mid if t["first_resumed_token_ms"] is not None])
    allr = np.array([t["all_streams_resumed_ms"] for t in mid if t["all_streams_resumed_ms"] is not None])
    side = np.array([t["sidecar_detect_to_first_token_ms"] for t in mid
                     if t["sidecar_detect_to_first_token_ms"] is not None])

    def pct(a, q):
        return round(float(np.percentile(a, q)), 2) if len(a) else None

    return {
        "streams": {"http": len(http_reqs), "sdk": len(sdk_reqs), "max_tokens": MAX_TOKENS, "greedy": True,
                    "prompt_tokens": f"{SHARED_PREFIX + 4}..{SHARED_PREFIX + 40}",
                    "shared_prefix_tokens": SHARED_PREFIX,
                    "logprobs_top": {n: TOP_LOGPROBS for n, r in _named(http_reqs, sdk_reqs) if r.get("logprobs")},
                    "prompt_logprobs_top": {n: TOP_LOGPROBS for n, r in _named(http_reqs, sdk_reqs)
                                            if r.get("prompt_logprobs")}},
        "reference_cached_tokens": ref_cached,
        "uninterrupted_repeat": control,
        "startup_to_ready_s": round(startup_s, 1), "kills_planned": planned, "kills": len(trials),
        "kills_mid_generation": len(mid),
        "kill_to_first_resumed_token_ms": {"p50": pct(lat, 50), "p99": pct(lat, 99), "max": pct(lat, 100)},
        "client_first_token_after_kill_ms": {"p50": pct(client, 50), "p99": pct(client, 99),
                                             "max": pct(client, 100)},
        "kill_to_all_streams_resumed_ms": {"p50": pct(allr, 50), "p99": pct(allr, 99)},
        "sidecar_detect_to_first_token_ms": {"p50": pct(side, 50), "p99": pct(side, 99)},
        "tokens_loaded_from_kvhold_total": sum(t["tokens_loaded_from_kvhold"] or 0 for t in trials),
        "tokens_recomputed_total": sum(t["tokens_recomputed"] or 0 for t in trials),
        "requests_lost_total": sum(t["requests_lost"] for t in trials),
        "all_identical": all(t["identical"] for t in trials),
        "text_identical": sum(1 for t in trials if t["text_identical"]),
        "logprobs_identical": sum(1 for t in trials if t["logprobs_identical"]),
        "logprobs_max_abs_diff": max((t["logprobs_max_abs_diff"] for t in trials
                                      if t["logprobs_max_abs_diff"] is not None), default=None),
        "logprobs_identical_to_repeat": sum(1 for t in trials if t["logprobs_identical_to_repeat"]),
        "logprobs_max_abs_diff_to_repeat": max((t["logprobs_max_abs_diff_to_repeat"] for t in trials
                                                if t["logprobs_max_abs_diff_to_repeat"] is not None), default=None),
        "cached_tokens_total": sum(t["cached_tokens_total"] for t in trials),
        "cached_tokens_per_kill": {"min": min((t["cached_tokens_total"] for t in trials), default=None),
                                   "max": max((t["cached_tokens_total"] for t in trials), default=None)},
        "rearm_wait_s_median": pct(np.array([t["rearm_wait_s"] for t in trials]), 50),
        # kills of an idle engine, then the same streams on its successor: kvhold's external hits
        "idle_kills": {"kills": len(idle), "requests_lost_total": sum(t["requests_lost"] for t in idle),
                       "identical": sum(1 for t in idle if t["identical"]),
                       "logprobs_identical": sum(1 for t in idle if t["logprobs_identical"]),
                       "external_hit_tokens_total": sum(t["external_hit_tokens"] for t in idle),
                       "cached_tokens_total": sum(t["cached_tokens_total"] for t in idle), "trials": list(idle)},
        "trials": trials,
    }


def _named(http_reqs, sdk_reqs):
    return [(f"http{i}", r) for i, r in enumerate(http_reqs)] + [(f"sdk{i}", r) for i, r in enumerate(sdk_reqs)]


# --------------------------------------------------------------------------- plain vLLM
def vllm_server(model: Path, port: int, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                             "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32",
                             "--block-size", "32", "--max-model-len", "256", "--max-num-seqs", "8",
                             "--max-num-batched-tokens", "256", "--no-enable-prefix-caching", "--enforce-eager",
                             "--num-gpu-blocks-override", "128", "--seed", "0"],
                            stdout=log, stderr=log, start_new_session=True)


def wait_health(base: str, proc: subprocess.Popen, timeout=STARTUP_S) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("vLLM server not healthy")


def engine_core_pid(server_pid: int) -> int:
    import psutil
    kids = psutil.Process(server_pid).children(recursive=True)
    named = [p for p in kids if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name()]
    if not named:
        raise RuntimeError(f"no EngineCore child of {server_pid}: {[(p.pid, p.name()) for p in kids]}")
    return named[0].pid


def bench_plain_vllm(model: Path, args, results_dir: Path) -> dict:
    http_reqs = make_requests(args.http_streams, args.seed)

    rng = random.Random(args.seed + 7)
    trials = []
    log = open(results_dir / "vllm_recovery.plain.log", "wb")
    for k in range(args.plain_kills):
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        proc = vllm_server(model, port, log)
        try:
            startup_s = wait_health(base, proc)
            core = engine_core_pid(proc.pid)
            counter = Recorder()
            run_http(base, http_reqs, counter, str(model))            # uninterrupted: how many events
            rec = Recorder()
            rec.kill_at = rng.randint(counter.count // 5, counter.count // 2)
            health: list[tuple[float, object]] = []

            def killer():
                rec.killed.wait(600)
                rec.kill_ns = time.monotonic_ns()
                os.kill(core, signal.SIGKILL)
                t_end = time.monotonic() + args.plain_watch_s
                while time.monotonic() < t_end:
                    t = (time.monotonic_ns() - rec.kill_ns) / 1e6
                    try:
                        health.append((round(t, 1), httpx.get(base + "/health", timeout=2).status_code))
                    except httpx.HTTPError as exc:
                        health.append((round(t, 1), type(exc).__name__))
                    if proc.poll() is not None:
                        break
                    time.sleep(0.1)

            kt = threading.Thread(target=killer, daemon=True)
            kt.start()
            out = run_http(base, http_reqs, rec, str(model))
            if not rec.killed.is_set():
                raise RuntimeError(f"the streams ended before the kill: {out}")
            kt.join(args.plain_watch_s + 10)
            exited_ms = None
            try:
                proc.wait(max(1.0, args.plain_watch_s - (time.monotonic_ns() - rec.kill_ns) / 1e9))
                exited_ms = round((time.monotonic_ns() - rec.kill_ns) / 1e6, 1)
            except subprocess.TimeoutExpired:
                pass
            served_again = any(code == 200 for t, code in health if t > 100)
            complete = sum(1 for v in out.values() if not v["error"])
            trials.append({
                "startup_to_healthy_s": round(startup_s, 1), "kill_after_tokens": rec.kill_at,
                "stream_outcomes": sorted({(v["error"] or "completed") for v in out.values()}),
                "streams_with_error": sum(1 for v in out.values() if v["error"]),
                "streams_completed_without_error": complete,
                "health_after_kill": _compress(health), "server_exit_code": proc.returncode,
                "server_exited_after_ms": exited_ms, "served_again_by_itself": served_again,
            })
            print(f"plain vLLM kill {k + 1}: {trials[-1]}", flush=True)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    log.close()
    return {"kills": len(trials), "watch_after_kill_s": args.plain_watch_s,
            "restart_to_healthy_s_median": float(np.median([t["startup_to_healthy_s"] for t in trials]))
            if trials else None,
            "requests_lost_total": sum(t["streams_with_error"] for t in trials), "trials": trials}


def _compress(samples):
    """Runs of equal /health answers: [(from ms, answer)]."""
    out = []
    for t, code in samples:
        if not out or out[-1][1] != code:
            out.append((t, code))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--idle-kills", type=int, default=3,
                   help="after the kills mid-stream: kills of an idle engine, each followed by the streams "
                        "on its successor (kvhold's cached pages offered to vLLM as external hits)")
    p.add_argument("--plain-kills", type=int, default=2)
    p.add_argument("--plain-watch-s", type=float, default=20.0)
    p.add_argument("--http-streams", type=int, default=3)
    p.add_argument("--sdk-streams", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, default=None, help="default: the tiny demo checkpoint")
    p.add_argument("--skip-plain", action="store_true")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="stop starting kvhold kills after this long (the JSON says how many ran)")
    p.add_argument("--out", type=Path, default=Path("bench/results/vllm_recovery_cpu.json"))
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()),
                   help="where the servers' logs go (default: the temporary directory)")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = args.model or ensure_demo_model()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    import vllm

    result = {"bench": "vllm_recovery", "vllm": vllm.__version__, "host": platform.node(),
              "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(),
              "model": "kvhold tiny demo (Llama, 4 layers, float32, random weights)",
              "goals": {"p99_first_resumed_token_ms": 250, "requests_lost": 0, "greedy_identical": True},
              "command": " ".join(["python -m tools.bench_vllm_recovery", *(argv or sys.argv[1:])])}
    args.stop_at = time.monotonic() + (args.time_budget_s or float("inf"))

    def save(part=None):
        if part is not None:
            result["kvhold"] = part
        result["load_average_at_end"] = os.getloadavg()
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    args.progress = save
    if not args.skip_plain:          # first: its figures do not depend on how many kvhold kills fit
        try:
            result["plain_vllm"] = bench_plain_vllm(model, args, args.log_dir)
        except Exception as exc:     # recorded, and the kvhold part still runs
            result["plain_vllm"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        save()
    save(bench_kvhold(model, args, args.log_dir))
    print(json.dumps({k: v for k, v in result["kvhold"].items() if k != "trials"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
