"""Soak: streaming HTTP clients against `kvhold serve` while its executors are killed, many times.

    python -m tools.bench_soak [--faults 1000] [--max-seconds 3600] [--clients 16]

Starts a real `kvhold serve` (HTTP API, sidecar, an active executor and a hot standby,
re-armed from the zygote unless --no-zygote) on the tiny demo model (CPU), then:

1. reference: runs the request set (greedy and seeded-sampled requests, prompts and
   output lengths varied; --requests of them) once with --clients concurrent streams and
   no faults, and keeps every output text;
2. soak: --clients streaming clients (OpenAI-style POST /v1/completions, stream=true,
   over HTTP) each send request after request of that set, while the fault injector
   signals the active executor, in turn:
   * `sigkill_with_standby`: SIGKILL the active while a standby is ready;
   * `sigkill_no_standby`: SIGKILL the active, wait for the standby's takeover to
     complete, SIGKILL the new active before another standby is ready;
   * `sigkill_during_takeover`: SIGKILL the active, then SIGKILL the promoted standby as
     soon as the sidecar's status shows it active, before it reports its takeover;
   * `sigstop_hang`: SIGSTOP the active; the sidecar's heartbeat lease finds the hang,
     fences it and kills it;
   and the processes around them (tools.soak_owner_faults): `sidecar_sigkill` (the memory
   owner, while its spare waits), `frontend_sigkill`, `spare_sigkill`, and `pool_restart`
   (`kvhold pool-restart --continue`); one of these whose process is not there to hit (no
   spare waiting yet) waits: that cycle takes an executor plan, and a later cycle takes the
   waiting plan as soon as it can.
   The executors' pids come from the sidecar's status (the SDK's Status message, what
   `kvhold status` shows). It stops when --faults faults have happened or after
   --max-seconds, whichever comes first; the clients then finish their requests.

Each fault is counted by what the sidecar recorded, not by what was planned: the fence
event of a signalled executor (reason, role), whether the executor that took over had
been ready before the fence (a standby) or became ready after it, and whether a killed
active had reported its own takeover before the kill. Fences of executors nobody
signalled (a false hang on a loaded machine) are counted apart.

Every finished request is compared with its reference output: completed (a [DONE]
after a finish reason), errored (an HTTP error status or an error object in the
stream), lost (a transport error or a stream that ended without [DONE]), differing
(completed with a text, finish reason or token count other than the reference's).
Also: the recovery records' times (detection and kill -> first resumed token, per fault
kind), the /metrics recovery histogram, and the sidecar's, the HTTP server's and the
executors' RSS and open file count, the instance's /dev/shm segments and the processes
and zombies of the sidecar's session, before and after the soak (the sidecar's and the
HTTP server's also every 50 fault cycles: `resources_trend`).
Writes bench/results/soak_cpu.json (--out), rewritten as the soak goes.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from kvhold.client.client import Client
from kvhold.protocol.errors import KvholdError
from kvhold.protocol.naming import InstancePaths
from kvhold.testing.serve_process import ServeProcess
from tools.soak_owner_faults import OWNER_PLANS, OWNER_UPTIME_S, OwnerFaults

EXECUTOR_PLANS = ("sigkill_with_standby", "sigkill_no_standby", "sigkill_during_takeover", "sigstop_hang")
PLANS = EXECUTOR_PLANS + OWNER_PLANS
PHRASES = ["The sidecar keeps the memory of every request", "Once upon a time", "One two three four",
           "Never lose a stream", "A standby takes over", "Pages are checksummed and versioned"]


# ---------------------------------------------------------------------------- requests
def make_requests(n: int, vocab: int, max_prompt: int, max_tokens: int, seed: int) -> list[dict]:
    """Request bodies: text or token-id prompts of varied length, varied output lengths,
    greedy or seeded sampling (temperature, top-p, top-k), with and without EOS."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if rng.random() < 0.5:
            words = " ".join(rng.choice(PHRASES) for _ in range(rng.randint(1, 8)))
            prompt: str | list[int] = words
        else:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(2, max_prompt))]
        sampling = rng.choice([dict(temperature=0.0), dict(temperature=0.0),
                               dict(temperature=0.8, seed=rng.randrange(2**31)),
                               dict(temperature=1.0, top_p=0.9, seed=rng.randrange(2**31)),
                               dict(temperature=0.7, top_k=40, seed=rng.randrange(2**31))])
        out.append(dict(prompt=prompt, max_tokens=rng.randint(4, max_tokens), ignore_eos=rng.random() < 0.7,
                        stream=True, stream_options={"include_usage": True}, **sampling))
    return out


async def stream_until_admitted(http: httpx.AsyncClient, body: dict, on_chunk, give_up_s: float) -> dict:
    """`stream_one`, sent again after each refusal for now (429 or 503: a pool restart, a
    takeover of the memory owner) once its Retry-After has passed, as OpenAI's SDKs do, for at
    most `give_up_s`; the result counts the refusals."""
    deadline, refused = time.monotonic() + give_up_s, 0
    while True:
        res = await stream_one(http, body, on_chunk)
        if res["outcome"] != "refused" or time.monotonic() > deadline:
            return dict(res, refused=refused)
        refused += 1
        await asyncio.sleep(res["retry_after_s"])


async def stream_one(http: httpx.AsyncClient, body: dict, on_chunk=lambda: None) -> dict:
    """One streamed completion: outcome, text, finish reason, tokens, longest chunk gap."""
    t0 = time.monotonic()
    text, finish, usage, done, error = [], None, None, False, None
    last, max_gap = t0, 0.0
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code in (429, 503):      # not admitted now (a pool restart): try again
                await r.aread()
                return {"outcome": "refused", "retry_after_s": float(r.headers.get("retry-after", 1)),
                        "error": f"HTTP {r.status_code}: {r.text[:200]}", "s": time.monotonic() - t0}
            if r.status_code != 200:
                await r.aread()
                return {"outcome": "errored", "error": f"HTTP {r.status_code}: {r.text[:200]}",
                        "s": time.monotonic() - t0}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.monotonic()
                max_gap, last = max(max_gap, now - last), now
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    error = obj["error"]
                    continue
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj.get("choices", []):
                    text.append(ch.get("text") or "")
                    on_chunk()
                    finish = ch.get("finish_reason") or finish
    except Exception as exc:  # noqa: BLE001 - whatever broke the stream, the client lost it
        return {"outcome": "lost", "error": f"{type(exc).__name__}: {exc}", "s": time.monotonic() - t0,
                "tokens_seen": len(text)}
    res = {"text": "".join(text), "finish_reason": finish,
           "completion_tokens": usage["completion_tokens"] if usage else None,
           "s": time.monotonic() - t0, "max_gap_s": max_gap}
    if error is not None:
        res.update(outcome="errored", error=str(error)[:300])
    elif not done or finish is None:
        res.update(outcome="lost", error="stream ended without [DONE]" if not done else "no finish reason")
    else:
        res["outcome"] = "completed"
    return res


class Clients:
    """`n` concurrent streaming clients in a thread of their own (one asyncio loop)."""

    def __init__(self, base: str, requests: list[dict], n: int, timeout_s: float, seed: int):
        self.base, self.requests, self.n, self.timeout_s = base, requests, n, timeout_s
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.results: list[tuple[int, dict]] = []    # (request index, result)
        self.chunks = 0                               # stream chunks received, all clients
        self.thread: threading.Thread | None = None

    async def _run(self, once: bool) -> None:
        limits = httpx.Limits(max_connections=self.n, max_keepalive_connections=self.n)
        timeout = httpx.Timeout(self.timeout_s, connect=30)
        async with httpx.AsyncClient(base_url=self.base, timeout=timeout, limits=limits) as http:
            if once:   # the reference: every request once, n at a time
                queue = list(range(len(self.requests)))

                async def worker():
                    while queue:
                        i = queue.pop(0)
                        self.results.append((i, await stream_until_admitted(http, self.requests[i], self._chunk,
                                                                            self.timeout_s)))
            else:
                async def worker():
                    while not self.stop.is_set():
                        i = self.rng.randrange(len(self.requests))
                        self.results.append((i, await stream_until_admitted(http, self.requests[i], self._chunk,
                                                                            self.timeout_s)))
            await asyncio.gather(*(worker() for _ in range(self.n)))

    def _chunk(self) -> None:
        self.chunks += 1

    def run_once(self) -> list[tuple[int, dict]]:
        asyncio.run(self._run(once=True))
        return self.results

    def start(self) -> None:
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run(once=False)), daemon=True,
                                       name="clients")
        self.thread.start()

    def finish(self, timeout_s: float) -> bool:
        self.stop.set()
        self.thread.join(timeout_s)
        return not self.thread.is_alive()


# ---------------------------------------------------------------------------- the server
def _die_with_parent() -> None:
    """In the server's child: SIGTERM when this tool dies, even by SIGKILL (it then drains and stops)."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)   # PR_SET_PDEATHSIG


class Observer:
    """The sidecar's status, polled; its events and recovery records accumulated (the status
    shows only the latest ones)."""

    def __init__(self, client: Client):
        self.client = client
        self.events: dict[tuple, dict] = {}
        self.records: dict[tuple, dict] = {}
        self.last: dict = {}

    def poll(self) -> dict:
        st = self.client.status()
        for ev in st.get("events", []):
            self.events[(ev["kind"], ev["ns"], ev.get("pid"))] = ev
        for rec in st.get("recoveries", []):
            self.records[(rec.get("fenced_epoch"), rec.get("detect_ns"))] = dict(rec)
        self.last = st
        return st

    @staticmethod
    def executors(st: dict, role: str) -> list[dict]:
        return [e for e in st.get("executors", []) if e["role"] == role]

    def steady(self, st: dict, zygote: bool, stepped: bool = True) -> dict | None:
        """The active executor when it serves (ready, has stepped) and a standby is ready."""
        # an active executor that has stepped: its first step is done, the normal lease applies
        active = [e for e in self.executors(st, "active") if e["ready"] and (e.get("steps", 0) >= 1 or not stepped)]
        ready = [e for e in self.executors(st, "standby") if e["ready"]]
        if len(active) != 1 or not ready or (zygote and not (st.get("zygote") or {}).get("ready")):
            return None
        if self.executors(st, "fenced") or self.executors(st, "starting"):
            return None   # let the last fault settle (exits confirmed, no executor starting)
        return active[0]

    def wait(self, predicate, timeout_s: float, interval_s: float = 0.02):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = predicate(self.poll())
            except KvholdError:
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                return None
            time.sleep(interval_s)

    def sorted_events(self, kind: str) -> list[dict]:
        return sorted((e for e in self.events.values() if e["kind"] == kind), key=lambda e: e["ns"])


def _proc_stat(pid: int) -> dict | None:
    """RSS, open files, threads of one process (None if gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    def field(name: str) -> int | None:      # a zombie (exited, not reaped yet) has no VmRSS
        found = re.search(rf"^{name}:\s+(\d+)", status, re.M)
        return int(found.group(1)) if found else None
    return {"pid": pid, "rss_kib": field("VmRSS"), "open_fds": fds, "threads": field("Threads")}


def _session(sid: int) -> dict:
    """Processes of a session (the sidecar's: its executors, its zygote and the zygote's children)
    and how many of them are zombies."""
    procs, zombies = 0, 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fields = Path(f"/proc/{d}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == sid:
            procs += 1
            zombies += fields[0] == "Z"
    return {"processes": procs, "zombies": zombies}


def resources(st: dict, serve_pid: int, paths: InstancePaths) -> dict:
    shm = sorted(n for n in os.listdir("/dev/shm") if n.startswith(paths.shm_prefix))
    out = {"sidecar": _proc_stat(st["pid"]), "http_server": _proc_stat(serve_pid),
           "executors": {e["role"]: _proc_stat(e["pid"]) for e in st["executors"]},
           "zygote": _proc_stat(st["zygote"]["pid"]) if (st.get("zygote") or {}).get("pid") else None,
           "shm_segments": len(shm), "shm_names": shm, "sidecar_session": _session(st["pid"]),
           "runtime_dir_entries": sorted(os.listdir(paths.runtime_dir))}
    return out


# ---------------------------------------------------------------------------- faults
class Injector:
    def __init__(self, obs: Observer, args, zygote: bool):
        self.obs, self.args, self.zygote = obs, args, zygote
        self.signalled: dict[int, dict] = {}   # pid -> {signal, ns, plan, cycle}
        self.cycles: list[dict] = []
        self.notes: Counter = Counter()

    def _signal(self, pid: int, sig: int, plan: str, cycle: int, epoch: int) -> bool:
        ns = time.monotonic_ns()
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            self.notes["victim already gone"] += 1
            return False
        self.signalled[pid] = {"signal": signal.Signals(sig).name, "ns": ns, "plan": plan, "cycle": cycle,
                               "epoch": epoch}
        return True

    def wait_steady(self, timeout_s: float) -> dict | None:
        return self.obs.wait(lambda st: self.obs.steady(st, self.zygote), timeout_s)

    def run_cycle(self, cycle: int, plan: str) -> dict:
        """One planned fault (two signals for the double kills), from a steady state."""
        a = self.obs.steady(self.obs.last, self.zygote)
        standby = next(e for e in self.obs.executors(self.obs.last, "standby") if e["ready"])
        rec = {"cycle": cycle, "plan": plan, "victims": []}
        if plan == "sigstop_hang":
            if self._signal(a["pid"], signal.SIGSTOP, plan, cycle, a["epoch"]):
                rec["victims"].append(a["pid"])
                fenced = self.obs.wait(lambda st: self._fence_of(a["pid"]), self.args.lease_ms / 1e3 * 20)
                if not fenced:       # not found as hung: do not leave a stopped process behind
                    self.notes["stopped executor not fenced in 20 leases: SIGKILL"] += 1
                    os.kill(a["pid"], signal.SIGKILL)
            return rec
        if not self._signal(a["pid"], signal.SIGKILL, plan, cycle, a["epoch"]):
            return rec
        rec["victims"].append(a["pid"])
        if plan == "sigkill_with_standby":
            return rec
        b = standby["pid"]
        if plan == "sigkill_during_takeover":
            # the standby is active in the status as soon as it is promoted; its takeover ends
            # with its recovery record
            st = self.obs.wait(lambda st: st if any(e["pid"] == b for e in self.obs.executors(st, "active"))
                               else None, 10, interval_s=0.0)
        else:   # sigkill_no_standby: after b's takeover is reported, before a new standby is ready
            st = self.obs.wait(lambda st: st if any(r.get("pid") == b for r in st.get("recoveries", []))
                               else None, 10, interval_s=0.0)
        if st is None:
            self.notes[f"{plan}: second victim never reached its state"] += 1
            return rec
        epoch_b = next((e["epoch"] for e in st["executors"] if e["pid"] == b), 0)
        if self._signal(b, signal.SIGKILL, plan, cycle, epoch_b):
            rec["victims"].append(b)
        return rec

    def _fence_of(self, pid: int) -> dict | None:
        return next((e for e in self.obs.sorted_events("fence") if e["pid"] == pid), None)

    def classify(self) -> tuple[Counter, list[dict], list[dict]]:
        """Each signalled executor's fault kind from the sidecar's records; fences of executors
        nobody signalled; the signalled executors whose fence has not been seen."""
        fences = self.obs.sorted_events("fence")
        promotes = self.obs.sorted_events("promote")
        readies = {(e["pid"], e["epoch"]): e["ns"] for e in self.obs.sorted_events("ready")}
        recs = list(self.obs.records.values())
        kinds: Counter = Counter()
        faults, unplanned = [], []
        seen = set()
        for f in fences:
            pid = f["pid"]
            victim = self.signalled.get(pid)
            if victim is None:
                unplanned.append({k: f.get(k) for k in ("pid", "reason", "role", "detect_ns")})
                continue
            seen.add(pid)
            kind = self._kind(f, victim, promotes, readies, recs)
            kinds[kind] += 1
            rec = next((r for r in recs if r.get("fenced_epoch") == f["fenced_epoch"]), None)
            fault = {"cycle": victim["cycle"], "plan": victim["plan"], "kind": kind, "pid": pid,
                     "reason": f.get("reason"), "role": f.get("role"),
                     "detect_ms": (f["detect_ns"] - victim["ns"]) / 1e6}
            if rec and rec.get("first_token_ns"):
                fault["first_token_from_detect_ms"] = (rec["first_token_ns"] - rec["detect_ns"]) / 1e6
                fault["first_token_from_signal_ms"] = (rec["first_token_ns"] - victim["ns"]) / 1e6
            for mark in ("promoted", "validated", "resumed"):
                if rec and rec.get(f"{mark}_ns") and rec.get("detect_ns"):
                    fault[f"{mark}_from_detect_ms"] = (rec[f"{mark}_ns"] - rec["detect_ns"]) / 1e6
            if rec:
                fault["tokens_recomputed"] = rec.get("tokens_recomputed", 0)
                fault["requests"] = {c: rec.get(f"requests_{c}", 0)
                                     for c in ("finished", "resumable", "damaged", "lost")}
            faults.append(fault)
        missing = [dict(pid=pid, **v) for pid, v in self.signalled.items() if pid not in seen]
        return kinds, faults, unplanned, missing

    @staticmethod
    def _kind(f, victim, promotes, readies, recs) -> str:
        if victim["signal"] == "SIGSTOP":
            return "sigstop_hang" if f.get("reason") == "hang" else f"sigstop_fenced_{f.get('reason')}"
        if f.get("role") != "ACTIVE":
            return f"sigkill_{str(f.get('role')).lower()}"
        pid, epoch = f["pid"], f["fenced_epoch"]
        mine = [p for p in promotes if p["pid"] == pid and p["ns"] <= f["detect_ns"]]
        if mine and mine[-1].get("fenced_epoch"):   # it became active through a failover
            took_over = any(r.get("pid") == pid and r.get("received_ns", 1 << 62) <= f["detect_ns"]
                            for r in recs)
            if not took_over:
                return "sigkill_during_takeover"
        nxt = next((p for p in promotes if p.get("fenced_epoch") == epoch), None)
        if nxt is None:
            return "sigkill_active_unresolved"
        ready_ns = readies.get((nxt["pid"], nxt["epoch"]))
        if ready_ns is None:
            return "sigkill_active_unresolved"
        return "sigkill_with_standby" if ready_ns < f["detect_ns"] else "sigkill_no_standby"


# ---------------------------------------------------------------------------- report
def _pct(values: list[float]) -> dict | None:
    if not values:
        return None
    v = sorted(values)
    at = lambda q: v[min(len(v) - 1, int(round(q * (len(v) - 1))))]  # noqa: E731
    return {"n": len(v), "p50": at(0.5), "p99": at(0.99), "max": v[-1], "mean": statistics.fmean(v)}


def compare(results: list[tuple[int, dict]], reference: dict[int, dict]) -> dict:
    counts: Counter = Counter()
    details = {"differing": [], "lost": [], "errored": [], "refused": []}
    gaps = []
    for i, r in results:
        counts[r["outcome"]] += 1
        counts["refusals"] += r.get("refused", 0)
        if r["outcome"] != "completed":
            details[r["outcome"]].append({"request": i, "error": r.get("error"), "s": round(r["s"], 3)})
            continue
        gaps.append(r["max_gap_s"] * 1e3)
        ref = reference[i]
        if (r["text"], r["finish_reason"], r["completion_tokens"]) != (ref["text"], ref["finish_reason"],
                                                                      ref["completion_tokens"]):
            counts["differing"] += 1
            n = next((j for j, (x, y) in enumerate(zip(r["text"], ref["text"])) if x != y),
                     min(len(r["text"]), len(ref["text"])))
            details["differing"].append({"request": i, "first_difference_char": n,
                                         "got": [r["finish_reason"], r["completion_tokens"], len(r["text"])],
                                         "reference": [ref["finish_reason"], ref["completion_tokens"],
                                                       len(ref["text"])]})
        else:
            counts["identical"] += 1
    return {"requests": len(results), "completed": counts["completed"], "identical": counts["identical"],
            "differing": counts["differing"], "lost": counts["lost"], "errored": counts["errored"],
            "refused_still": counts["refused"], "refusals_then_sent_again": counts["refusals"],
            "longest_chunk_gap_ms": _pct(gaps),
            "examples": {k: v[:20] for k, v in details.items()}}


def scrape_metrics(base: str) -> dict:
    try:
        text = httpx.get(base + "/metrics", timeout=10).text
    except httpx.HTTPError as exc:
        return {"error": str(exc)}
    keep = ("kvhold_recovery_seconds_count", "kvhold_recovery_seconds_sum", "kvhold_executor_restarts_total",
            "kvhold_recovered_requests_total", "kvhold_tokens_recomputed_total", "kvhold_recovery_pages_bad_total",
            "kvhold_requests_finished_total", "kvhold_http_requests_total")
    out = {}
    for line in text.splitlines():
        if line.startswith(keep):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def git_commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict:
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "host": platform.node(),
            "loadavg": os.getloadavg()}


# ---------------------------------------------------------------------------- main
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", type=int, default=1000,
                   help="stop once this many faults have happened, as the sidecar recorded them (default 1000)")
    p.add_argument("--max-seconds", type=float, default=3600.0,
                   help="stop the soak (not counting start-up and the reference run) after this long "
                        "(default 3600)")
    p.add_argument("--clients", type=int, default=16, help="concurrent streaming HTTP clients (default 16)")
    p.add_argument("--requests", type=int, default=64, help="distinct requests in the set (default 64)")
    p.add_argument("--max-prompt", type=int, default=200, help="longest token-id prompt (default 200)")
    p.add_argument("--max-tokens", type=int, default=96, help="longest output (default 96)")
    p.add_argument("--plans", default=",".join(PLANS),
                   help=f"fault plans taken in turn, comma list of {','.join(PLANS)} (default: all)")
    p.add_argument("--lease-ms", type=int, default=1000,
                   help="the sidecar's heartbeat lease: how long a SIGSTOPped executor takes to be found "
                        "(default 1000)")
    p.add_argument("--owner-uptime", type=float, default=OWNER_UPTIME_S,
                   help="sidecar_sigkill and frontend_sigkill wait until the process they kill has served "
                        f"this long (default {OWNER_UPTIME_S:.0f} s: kvhold serve treats closer deaths "
                        "as a crash loop: it stops after three deaths of its owner within a minute and "
                        "restarts the frontend after a growing backoff)")
    p.add_argument("--no-zygote", dest="zygote", action="store_false",
                   help="re-arm standbys by cold starts instead of zygote forks (slower cycles)")
    p.add_argument("--chunks-between", type=int, default=32,
                   help="stream chunks the clients must receive between two fault cycles, so that each "
                        "fault hits a serving system (default 32)")
    p.add_argument("--steady-timeout", type=float, default=180.0,
                   help="seconds to wait for an active executor and a ready standby between faults; "
                        "past it the soak stops and says so (default 180)")
    p.add_argument("--client-timeout", type=float, default=120.0,
                   help="seconds of silence after which a client gives a stream up as lost (default 120)")
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: the tiny demo model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress-every", type=int, default=10, help="a progress line every N fault cycles")
    p.add_argument("--log-level", default="WARNING", help="the server's log level (serve.log in the runtime dir)")
    p.add_argument("--keep-runtime", action="store_true", help="keep the runtime dir and serve.log")
    p.add_argument("--note", default=None, help="a remark kept in the JSON (e.g. what else loaded the machine)")
    p.add_argument("--out", type=Path, default=Path("bench/results/soak_cpu.json"))
    args = p.parse_args(argv)
    args.plans = args.plans.split(",")
    bad = [x for x in args.plans if x not in PLANS]
    if bad or args.faults < 1 or args.clients < 1 or args.requests < 1:
        p.error(f"unknown plan {bad}" if bad else "--faults, --clients and --requests must be >= 1")
    return args


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model is None:
        from kvhold.testing.make_model import ensure_demo_model
        args.model = ensure_demo_model()[0]
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    requests = make_requests(args.requests, vocab, args.max_prompt, args.max_tokens, args.seed)
    root = Path(tempfile.mkdtemp(prefix="kvh-soak-", dir="/tmp"))
    os.chmod(root, 0o700)
    instance = f"soak-{os.getpid()}"
    paths = InstancePaths.for_instance(instance, root)
    log_path = root / "serve.log"
    server = ServeProcess(["--max-seq-len", "512", "--max-batch", str(max(16, args.clients)), "--standbys", "1",
                           "--lease-ms", str(args.lease_ms), "--restart-backoff-ms", "0,0",
                           "--log-level", args.log_level] + (["--zygote"] if args.zygote else []),
                          root, model=args.model, instance=instance, log_path=log_path,
                          env={"KVHOLD_STATE_DIR": str(root / "state")}, preexec_fn=_die_with_parent)
    base, cmd = server.base, server.cmd
    result = {"command": shlex.join(["python", "-m", "tools.bench_soak", *(sys.argv[1:] if argv is None else argv)]),
              "commit": git_commit(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "note": args.note, "machine": machine(), "serve_command": " ".join(cmd[2:]), "model": str(args.model),
              "clients": args.clients, "request_set": {
                  "requests": len(requests), "greedy": sum(r["temperature"] == 0 for r in requests),
                  "seeded_sampled": sum(r["temperature"] > 0 for r in requests),
                  "token_id_prompts": sum(isinstance(r["prompt"], list) for r in requests),
                  "max_tokens_range": [min(r["max_tokens"] for r in requests),
                                       max(r["max_tokens"] for r in requests)]}}
    serve = server.spawn().proc
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save = lambda: args.out.write_text(json.dumps(result, indent=1) + "\n")  # noqa: E731
    try:
        return run(args, requests, serve, base, paths, result, save, log_path)
    finally:
        server.stop(60)
        result["serve_exit_code"] = serve.returncode
        result["shm_segments_after_stop"] = sorted(n for n in os.listdir("/dev/shm")
                                                   if n.startswith(paths.shm_prefix))
        tail = log_path.read_text(errors="replace").splitlines()[-40:] if log_path.exists() else []
        result["serve_log_tail"] = tail
        save()
        if args.keep_runtime:
            log(f"runtime kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def run(args, requests, serve, base, paths, result, save, log_path) -> int:
    with Client.for_instance(paths.instance, paths.runtime_dir.parent, timeout=10) as sdk:
        obs = Observer(sdk)
        injector = Injector(obs, args, args.zygote)
        owner = OwnerFaults(obs, paths.instance, paths.runtime_dir.parent, args.steady_timeout,
                            args.owner_uptime)
        executor_plans = [p for p in args.plans if p in EXECUTOR_PLANS] or list(EXECUTOR_PLANS)
        log(f"starting kvhold serve on {base} (instance {paths.instance}, log {log_path})")
        up = lambda st: serve.poll() is None and obs.steady(st, args.zygote, stepped=False)  # noqa: E731
        started = obs.wait(up, 600, 0.1) if serve.poll() is None else None
        if not started:
            # the HTTP server may still be binding: wait for /health too
            raise SystemExit(f"the server did not come up (exit {serve.poll()}); see {log_path}")
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or serve.poll() is not None:
                raise SystemExit(f"HTTP /health never turned 200; see {log_path}")
            time.sleep(0.1)

        # reference: the request set with no faults
        t0, t0_ns = time.monotonic(), time.monotonic_ns()
        ref_runs = Clients(base, requests, args.clients, args.client_timeout, args.seed).run_once()
        obs.poll()
        ref_fences = [e for e in obs.sorted_events("fence") if e["ns"] >= t0_ns]
        reference = {i: r for i, r in ref_runs}
        bad = {i: r for i, r in reference.items() if r["outcome"] != "completed"}
        result["reference"] = {"s": time.monotonic() - t0, "fences_during": ref_fences,
                               "not_completed": {i: r.get("error") for i, r in bad.items()}}
        log(f"reference: {len(reference)} requests in {result['reference']['s']:.1f} s, "
            f"{len(bad)} not completed, {len(ref_fences)} fences")
        if bad or ref_fences:
            save()
            raise SystemExit("the reference run was not clean: see the JSON")
        st = injector.wait_steady(args.steady_timeout)
        if st is None:
            raise SystemExit("no steady state after the reference run")
        result["resources_before"] = resources(obs.last, serve.pid, paths)
        result["metrics_before"] = scrape_metrics(base)

        clients = Clients(base, requests, args.clients, args.client_timeout, args.seed + 1)
        clients.start()
        soak_t0 = time.monotonic()
        stopped_by, cycle, faults, chunks_mark = "faults", 0, 0, 0
        taken, waiting = 0, []        # plans taken in turn; the owner plans that had to wait
        kinds: Counter = Counter()
        planned: Counter = Counter()
        try:
            while True:
                elapsed = time.monotonic() - soak_t0
                if faults >= args.faults:
                    break
                if elapsed >= args.max_seconds:
                    stopped_by = "max-seconds"
                    break
                if serve.poll() is not None:
                    stopped_by = f"server exited ({serve.returncode})"
                    break
                wait_s = min(args.steady_timeout, args.max_seconds - elapsed + 1)
                # the clients stream again (the last recovery is complete), then a steady state
                flowing = injector.obs.wait(lambda st: clients.chunks >= chunks_mark + args.chunks_between,
                                            wait_s)
                if not flowing or not injector.wait_steady(wait_s):
                    stopped_by = ("max-seconds" if time.monotonic() - soak_t0 >= args.max_seconds
                                  else f"{'no stream progress' if not flowing else 'not steady'} "
                                       f"within {args.steady_timeout:.0f} s")
                    break
                kinds, *_ = injector.classify()
                faults = sum(kinds.values()) + sum(owner.observed().values())
                if faults >= args.faults:
                    break
                # an owner plan that had to wait goes first once it can; the others go on in turn
                plan = next((p for p in waiting if owner.ready(obs.last, p)), None)
                if plan is not None:
                    waiting.remove(plan)
                else:
                    plan = args.plans[taken % len(args.plans)]
                    taken += 1
                    if plan in OWNER_PLANS and not owner.ready(obs.last, plan):
                        planned[f"{plan} deferred"] += 1
                        if plan not in waiting:
                            waiting.append(plan)
                        plan = executor_plans[cycle % len(executor_plans)]
                planned[plan] += 1
                if plan in OWNER_PLANS:
                    injector.cycles.append(owner.run(cycle, plan))
                else:
                    injector.cycles.append(injector.run_cycle(cycle, plan))
                chunks_mark = clients.chunks     # the next fault waits for chunks streamed after this one
                cycle += 1
                if cycle % args.progress_every == 0 or cycle <= 4:
                    done = len(clients.results)
                    log(f"cycle {cycle}: {faults} faults so far {dict(kinds)} {dict(owner.observed())}; "
                        f"{done} requests finished, "
                        f"{sum(r['outcome'] != 'completed' for _, r in clients.results)} not completed; "
                        f"{elapsed:.0f} s")
                if cycle % 50 == 0:
                    x = resources(obs.last, serve.pid, paths)
                    result.setdefault("resources_trend", []).append({
                        "cycle": cycle, "faults": faults, "s": round(elapsed, 1),
                        **{f"{who}_{k}": (x[who] or {}).get(k) for who in ("sidecar", "http_server")
                           for k in ("rss_kib", "open_fds")},
                        "shm_segments": x["shm_segments"], "session_processes": x["sidecar_session"]["processes"]})
                    result["partial"] = {"cycles": cycle, "faults": dict(kinds), "owner_faults": owner.summary(),
                                         "requests": compare(list(clients.results), reference)}
                    save()
        finally:
            soak_s = time.monotonic() - soak_t0
            log(f"soak stopped ({stopped_by}) after {soak_s:.0f} s; letting the clients finish")
            clean = clients.finish(args.client_timeout + 30)
        obs.wait(lambda st: obs.steady(st, args.zygote, stepped=False), args.steady_timeout)
        time.sleep(2.0)
        obs.poll()
        kinds, faults_list, unplanned, missing = injector.classify()
        result.pop("partial", None)
        owner_kinds = owner.observed()
        result["soak"] = {"s": soak_s, "stopped_by": stopped_by, "cycles": cycle, "planned": dict(planned),
                          "faults": sum(kinds.values()) + sum(owner_kinds.values()),
                          "faults_by_kind": {**dict(kinds), **dict(owner_kinds)},
                          "owner_faults": owner.summary(),
                          "unplanned_fences": unplanned, "signalled_without_fence": missing,
                          "injector_notes": {**dict(injector.notes), **dict(owner.notes)}, "clients_finished": clean}
        result["requests"] = compare(list(clients.results), reference)
        by_kind = {}
        for k in sorted(kinds):
            sel = [f for f in faults_list if f["kind"] == k]
            by_kind[k] = {"detect_ms": _pct([f["detect_ms"] for f in sel]),
                          **{f"{m}_from_detect_ms": _pct([f[f"{m}_from_detect_ms"] for f in sel
                                                          if f"{m}_from_detect_ms" in f])
                             for m in ("promoted", "validated", "resumed")},
                          "first_token_from_detect_ms": _pct([f["first_token_from_detect_ms"] for f in sel
                                                              if "first_token_from_detect_ms" in f]),
                          "first_token_from_signal_ms": _pct([f["first_token_from_signal_ms"] for f in sel
                                                              if "first_token_from_signal_ms" in f]),
                          "tokens_recomputed": sum(f.get("tokens_recomputed", 0) for f in sel),
                          "requests_damaged": sum(f.get("requests", {}).get("damaged", 0) for f in sel),
                          "requests_lost_at_takeover": sum(f.get("requests", {}).get("lost", 0) for f in sel)}
        result["recovery"] = {"by_kind": by_kind, "note": (
            "first_token_*: the recovery record of the failover that followed the fault (the sidecar's "
            "recovery timeline: first resumed token streamed); from_detect counts from the sidecar's "
            "detection, from_signal from the signal this tool sent. A kill during a takeover is "
            "recovered by the record of the executor that took over from the killed one.")}
        result["metrics_after"] = scrape_metrics(base)
        result["resources_after"] = resources(obs.last, serve.pid, paths)
        result["machine_end"] = machine()
        result["faults"] = faults_list
        result["cycles"] = injector.cycles
        save()
        r = result["requests"]
        log(f"{result['soak']['faults']} faults {result['soak']['faults_by_kind']} in {soak_s:.0f} s; "
            f"requests {r['requests']}: "
            f"{r['identical']} identical, {r['differing']} differing, {r['lost']} lost, {r['errored']} errored; "
            f"{len(unplanned)} unplanned fences")
        for when in ("resources_before", "resources_after"):
            x = result[when]
            log(f"{when}: sidecar rss {x['sidecar']['rss_kib']} KiB fds {x['sidecar']['open_fds']}; "
                f"http rss {x['http_server']['rss_kib']} KiB fds {x['http_server']['open_fds']}; "
                f"shm {x['shm_segments']}; session {x['sidecar_session']}")
        log(f"wrote {args.out}")
        return 0 if not (r["differing"] or r["lost"] or r["errored"] or r["refused_still"]) else 1


if __name__ == "__main__":
    sys.exit(main())
