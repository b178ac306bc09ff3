"""Benchmark: durable admissions per second, and kill -> fenced during a burst of admissions.

    python -m tools.bench_admission [--rounds 5] [--burst 1024] [--kills 30] [--kill-burst 256]

Runs a real sidecar on the tiny demo model (CPU engine, a hot standby, executors re-armed
from a zygote) with its durable journal on local disk (a temporary directory under
--journal-root, default /var/tmp: never a tmpfs, whose fsync costs nothing). A client
pipelines its requests over one DEALER socket (prompt ids, 1 token each), as fast as the
sidecar takes them:
* admissions: `--burst` requests sent at once, timed from the first send to the last
  `Accepted` (each one acknowledged only once its record is on disk), `--rounds` times;
* kill -> fenced: a burst of `--kill-burst` requests is sent and the active executor
  SIGKILLed a moment later, while the sidecar admits them; the sidecar's own record of when
  it detected and fenced the executor (CLOCK_MONOTONIC, the clock the benchmark read just
  before the kill) gives the latencies. A trial counts as "during the burst" when the kill
  fell between the first send and the last `Accepted`.
Writes bench/results/admission_cpu.json. Goals (2 cores): >= 5,000 durable admissions/s;
kill -> fenced P99 <= 5 ms during a burst of 256.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import zmq

from kvhold.protocol import messages as m, wire
from kvhold.protocol.errors import SidecarUnavailable
from kvhold.protocol.naming import InstancePaths
from kvhold.protocol.sampling import SamplingParams
from kvhold.testing.make_model import ensure_demo_model
from kvhold.testing.sidecar_process import SidecarProcess

PARAMS = SamplingParams(max_tokens=1, temperature=0.0).to_dict()


class Burst:
    """`n` Generate requests pipelined over one DEALER socket; `run` returns once every one has
    its answer (Accepted or Error), with the times of the first send and the last answer."""

    def __init__(self, endpoint: str, n: int, first_tag: int):
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(endpoint)
        self.frames = [wire.encode(m.Generate(tag=first_tag + i, params=PARAMS,
                                              prompt_ids=[5, 6, 7 + i % 200])) for i in range(n)]
        self.tags = {first_tag + i for i in range(n)}
        self.sent_ns = self.answered_ns = 0
        self.accepted = self.errors = self.done = 0
        self.error_texts: list[str] = []

    def run(self, timeout_s: float = 60.0) -> "Burst":
        self.sent_ns = time.monotonic_ns()
        for frame in self.frames:
            self.sock.send(frame)
        deadline = time.monotonic() + timeout_s
        waiting = set(self.tags)
        while waiting and time.monotonic() < deadline:
            if not self.sock.poll(100):
                continue
            msg = wire.decode(self.sock.recv())
            tag = getattr(msg, "tag", 0)
            self.done += isinstance(msg, m.Done)
            if tag in waiting and isinstance(msg, (m.Accepted, m.Error)):
                waiting.discard(tag)
                if isinstance(msg, m.Accepted):
                    self.accepted += 1
                else:
                    self.errors += 1
                    self.error_texts.append(msg.message)
        self.answered_ns = time.monotonic_ns()
        if waiting:
            raise TimeoutError(f"{len(waiting)} of {len(self.tags)} admissions unanswered")
        return self

    def finish(self, timeout_s: float = 60.0) -> None:
        """Stay connected until every accepted request's `Done`, as a client does: a socket closed
        earlier leaves the sidecar results to keep for pickup, which is not the path measured."""
        deadline, done = time.monotonic() + timeout_s, self.done
        while done < self.accepted and time.monotonic() < deadline:
            if self.sock.poll(100):
                done += isinstance(wire.decode(self.sock.recv()), m.Done)
        self.done = done

    def close(self) -> None:
        self.sock.close(0)


def summarize(values) -> dict:
    v = np.asarray(values, dtype=float)
    return {"n": int(v.size), "p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99)),
            "max": float(v.max()), "mean": float(v.mean())}


def status(sc: SidecarProcess, tries: int = 30) -> dict:
    """The sidecar's status, asked again while a busy loop leaves it unanswered (2 s each)."""
    for _ in range(tries - 1):
        try:
            return sc.status()
        except SidecarUnavailable:
            sc._client.close()          # a fresh client: the late reply must not answer the next ask
            sc._client = None
    return sc.status()


def idle(sc: SidecarProcess, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while status(sc)["requests"]["in_flight"]:
        if time.monotonic() > deadline:
            raise TimeoutError("requests still in flight")
        time.sleep(0.05)


def cpu_s(pid: int) -> float:
    """CPU time (user + system, all threads) the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def throughput(sc: SidecarProcess, endpoint: str, rounds: int, n: int) -> dict:
    """Durable admissions per second of wall time, and per second of the sidecar's CPU time (what
    the sidecar alone would take on a quiet core: the machine is shared with the executors)."""
    samples = []
    for r in range(rounds):
        idle(sc)
        before = status(sc)["admissions"].get("durable") or {}   # absent before group commit
        cpu0 = cpu_s(sc.proc.pid)
        burst = Burst(endpoint, n, first_tag=1 + r * n).run()
        cpu1 = cpu_s(sc.proc.pid)
        burst.finish()
        burst.close()
        after = status(sc)["admissions"].get("durable") or {}
        seconds = (burst.answered_ns - burst.sent_ns) / 1e9
        samples.append({"admissions": burst.accepted, "errors": burst.errors, "seconds": seconds,
                        "per_s": burst.accepted / seconds, "sidecar_cpu_s": cpu1 - cpu0,
                        "per_sidecar_cpu_s": burst.accepted / max(cpu1 - cpu0, 0.01),
                        "batches": after.get("batches", 0) - before.get("batches", 0)})
        print(f"round {r + 1}/{rounds}: {burst.accepted} durable admissions in {seconds * 1e3:.1f} ms "
              f"= {samples[-1]['per_s']:.0f}/s in {samples[-1]['batches']} batches; sidecar CPU "
              f"{(cpu1 - cpu0) * 1e3:.0f} ms", file=sys.stderr)
    return {"burst": n, "samples": samples, "per_s": summarize([s["per_s"] for s in samples]),
            "per_sidecar_cpu_s": summarize([s["per_sidecar_cpu_s"] for s in samples])}


def kills(sc: SidecarProcess, endpoint: str, trials: int, n: int, delay_ms: float) -> dict:
    samples = []
    for i in range(trials):
        idle(sc)
        active = sc.wait_steady(standbys=1, timeout=180)
        pid = active["pid"]
        burst = Burst(endpoint, n, first_tag=10_000_000 + i * n)
        thread = threading.Thread(target=burst.run)
        thread.start()
        while not burst.sent_ns:
            time.sleep(0.0001)
        time.sleep(delay_ms / 1e3)
        t0 = time.monotonic_ns()
        os.kill(pid, signal.SIGKILL)
        thread.join(120)
        burst.finish()
        burst.close()
        deadline = time.monotonic() + 60
        while not (fence := next((e for e in status(sc)["events"] if e["kind"] == "fence"
                                  and e.get("pid") == pid), None)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"executor {pid} not fenced")
            time.sleep(0.02)
        loop = status(sc).get("loop", {})
        samples.append({"pid": pid, "detect_ms": (fence["detect_ns"] - t0) / 1e6,
                        "fenced_ms": (fence["fenced_ns"] - t0) / 1e6,
                        "kill_after_first_send_ms": (t0 - burst.sent_ns) / 1e6,
                        "last_answer_after_kill_ms": (burst.answered_ns - t0) / 1e6,
                        "during_burst": burst.sent_ns <= t0 <= burst.answered_ns,
                        "accepted": burst.accepted, "errors": burst.errors,
                        "fenced_after_detect_ms": (fence["fenced_ns"] - fence["detect_ns"]) / 1e6,
                        "loop_max_stall_ms": loop.get("max_stall_ms")})
        s = samples[-1]
        print(f"kill {i + 1}/{trials}: fenced {s['fenced_ms']:.2f} ms (detected {s['detect_ms']:.2f}), "
              f"{s['kill_after_first_send_ms']:.1f} ms into the burst, last answer "
              f"{s['last_answer_after_kill_ms']:.1f} ms after, {burst.accepted} accepted", file=sys.stderr)
    during = [s for s in samples if s["during_burst"]]
    return {"burst": n, "delay_ms": delay_ms, "samples": samples,
            "fenced_ms": summarize([s["fenced_ms"] for s in samples]),
            "detect_ms": summarize([s["detect_ms"] for s in samples]),
            "fenced_after_detect_ms": summarize([s["fenced_after_detect_ms"] for s in samples]),
            "during_burst": {"n": len(during),
                             "fenced_ms": summarize([s["fenced_ms"] for s in during]) if during else None}}


def run(args) -> dict:
    model, _ = ensure_demo_model()
    journal = Path(tempfile.mkdtemp(prefix="kvhold-bench-journal-", dir=args.journal_root))
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(journal)], capture_output=True, text=True).stdout.strip()
    flags = ["--model", str(model), "--standbys", "1", "--zygote", "--kv-pages", "512",
             "--max-seq-len", "256", "--max-requests", str(max(args.burst, args.kill_burst) + 64),
             "--max-batch", "64", "--max-batch-tokens", "512", "--journal-dir", str(journal),
             "--log-level", "WARNING", "--lease-ms", "3000", "--restart-backoff-ms", "0,0"]
    load = os.getloadavg()
    results: dict = {"command": " ".join([Path(sys.executable).name, "-m", "tools.bench_admission",
                                          *sys.argv[1:]]),
                     "journal_fs": fs, "machine": {
                         "cpus": os.cpu_count(), "python": platform.python_version(),
                         "kernel": platform.release(), "host": platform.node(),
                         "loadavg_at_start": load}}
    try:
        with SidecarProcess(flags, log_path=args.log) as sc:
            sc.wait_steady(standbys=1, timeout=180)
            endpoint = InstancePaths.for_instance(sc.instance, sc.runtime_root).client_endpoint
            results["admissions"] = throughput(sc, endpoint, args.rounds, args.burst)
            if args.kills:
                results["kill"] = kills(sc, endpoint, args.kills, args.kill_burst, args.kill_delay_ms)
            results["loop"] = status(sc).get("loop")
            idle(sc)          # nothing left in flight for the stop to journal
    finally:
        shutil.rmtree(journal, ignore_errors=True)
    results["machine"]["loadavg_at_end"] = os.getloadavg()
    per_s = results["admissions"]["per_s"]
    results["goals"] = {"admissions_per_s": 5000, "kill_fenced_p99_ms": 5.0,
                        "admissions_met": per_s["p50"] >= 5000}
    if "kill" in results and results["kill"]["during_burst"]["fenced_ms"]:
        results["goals"]["kill_met"] = results["kill"]["during_burst"]["fenced_ms"]["p99"] <= 5.0
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="admission bursts timed (default 5)")
    parser.add_argument("--burst", type=int, default=1024, help="requests per timed burst (default 1024)")
    parser.add_argument("--kills", type=int, default=30, help="SIGKILL trials (default 30)")
    parser.add_argument("--kill-burst", type=int, default=256, help="requests per kill burst (default 256)")
    parser.add_argument("--kill-delay-ms", type=float, default=3.0,
                        help="from the burst's first send to the kill (default 3)")
    parser.add_argument("--journal-root", default="/var/tmp", help="where the journal directory goes")
    parser.add_argument("--log", type=Path, default=None, help="the sidecar's log file")
    parser.add_argument("--out", type=Path, default=Path("bench/results/admission_cpu.json"))
    args = parser.parse_args(argv)
    results = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    a = results["admissions"]["per_s"]
    print(f"durable admissions/s: P50 {a['p50']:.0f}, min {min(s['per_s'] for s in results['admissions']['samples']):.0f} "
          f"(bursts of {results['admissions']['burst']}, journal on {results['journal_fs']}); per second "
          f"of the sidecar's CPU time: P50 {results['admissions']['per_sidecar_cpu_s']['p50']:.0f}")
    if "kill" in results:
        k = results["kill"]
        d = k["during_burst"]
        print(f"kill -> fenced, all {k['fenced_ms']['n']}: P50 {k['fenced_ms']['p50']:.2f} ms, "
              f"P99 {k['fenced_ms']['p99']:.2f} ms, max {k['fenced_ms']['max']:.2f} ms; of which "
              f"detected -> fenced (the loop's part): P50 {k['fenced_after_detect_ms']['p50']:.2f} ms, "
              f"P99 {k['fenced_after_detect_ms']['p99']:.2f} ms")
        if d["fenced_ms"]:
            print(f"kill -> fenced, {d['n']} during the burst: P50 {d['fenced_ms']['p50']:.2f} ms, "
                  f"P99 {d['fenced_ms']['p99']:.2f} ms")
    print(f"load average {results['machine']['loadavg_at_start']} -> {results['machine']['loadavg_at_end']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
