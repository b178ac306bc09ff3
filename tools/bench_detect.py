"""Benchmark: how fast the sidecar notices a dead or hung executor.

    python -m tools.bench_detect [--kills 100] [--hangs 100] [--lease-ms 1000]

Runs a real sidecar (idle workload: executors hold leases and heartbeat, no
model) with one standby. Each kill trial SIGKILLs the active executor and reads
the sidecar's own record of when it fenced it (CLOCK_MONOTONIC, the same clock
the benchmark read just before the kill). Each hang trial SIGSTOPs the active
executor and measures SIGSTOP -> fence decision. Also reported: kill -> standby
promoted. Prints P50/P99 and writes raw samples to bench/results/detect.json.
Goals: kill -> fenced P99 <= 5 ms; hang detected within the lease + 10%.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path

import numpy as np

from kvhold.testing.sidecar_process import SidecarProcess


def _find(events: list[dict], kind: str, pid: int, key: str = "pid") -> dict | None:
    return next((e for e in events if e["kind"] == kind and e.get(key) == pid), None)


def trial(sc: SidecarProcess, sig: int, timeout: float) -> dict:
    active = sc.wait_steady(standbys=1)
    pid = active["pid"]
    t0 = time.monotonic_ns()
    os.kill(pid, sig)

    def fenced(st):
        fence = _find(st["events"], "fence", pid)
        promote = next((e for e in st["events"] if e["kind"] == "promote" and e["ns"] >= t0), None)
        return (fence, promote) if fence and promote else None

    fence, promote = sc.wait_for(fenced, timeout=timeout, interval=0.05)
    return {"pid": pid, "detect_ms": (fence["detect_ns"] - t0) / 1e6,
            "fenced_ms": (fence["fenced_ns"] - t0) / 1e6,
            "promoted_ms": (promote["ns"] - t0) / 1e6, "reason": fence["reason"]}


def summarize(samples: list[dict], key: str) -> dict:
    values = np.array([s[key] for s in samples])
    return {"n": len(values), "p50_ms": float(np.percentile(values, 50)),
            "p99_ms": float(np.percentile(values, 99)), "max_ms": float(values.max()),
            "mean_ms": float(values.mean())}


def run(args) -> dict:
    flags = ["--workload", "idle", "--standbys", "1", "--lease-ms", str(args.lease_ms),
             "--log-level", "WARNING", "--restart-backoff-ms", "0,0"]
    results: dict = {"command": " ".join([Path(sys.executable).name, "-m", "tools.bench_detect",
                                          *sys.argv[1:]]),
                     "lease_ms": args.lease_ms, "machine": {
                         "cpus": os.cpu_count(), "python": platform.python_version(),
                         "kernel": platform.release(), "host": platform.node()}}
    with SidecarProcess(flags) as sc:
        kills, hangs = [], []
        for i in range(args.kills):
            kills.append(trial(sc, signal.SIGKILL, timeout=10))
            _progress("kill", i + 1, args.kills, kills[-1]["fenced_ms"])
        for i in range(args.hangs):
            hangs.append(trial(sc, signal.SIGSTOP, timeout=10 + args.lease_ms / 1e3))
            _progress("hang", i + 1, args.hangs, hangs[-1]["fenced_ms"])
    if kills:
        results["kill"] = {"fenced": summarize(kills, "fenced_ms"),
                           "promoted": summarize(kills, "promoted_ms"), "samples": kills,
                           "goal_p99_ms": 5.0}
        results["kill"]["goal_met"] = results["kill"]["fenced"]["p99_ms"] <= 5.0
    if hangs:
        limit = args.lease_ms * 1.1
        results["hang"] = {"fenced": summarize(hangs, "fenced_ms"),
                           "promoted": summarize(hangs, "promoted_ms"), "samples": hangs,
                           "goal_max_ms": limit}
        results["hang"]["goal_met"] = max(s["fenced_ms"] for s in hangs) <= limit
    return results


def _progress(kind: str, i: int, n: int, value: float) -> None:
    print(f"\r{kind} trial {i}/{n}: {value:8.2f} ms", end="" if i < n else "\n", file=sys.stderr,
          flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=100, help="SIGKILL trials (default 100)")
    parser.add_argument("--hangs", type=int, default=100, help="SIGSTOP trials (default 100)")
    parser.add_argument("--lease-ms", type=int, default=1000, help="heartbeat lease (default 1000)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/detect.json"))
    args = parser.parse_args(argv)
    results = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    for kind in ("kill", "hang"):
        if kind in results:
            f, p = results[kind]["fenced"], results[kind]["promoted"]
            print(f"{kind:4s} -> fenced:   P50 {f['p50_ms']:8.2f} ms  P99 {f['p99_ms']:8.2f} ms  "
                  f"max {f['max_ms']:8.2f} ms  (n={f['n']}, goal met: {results[kind]['goal_met']})")
            print(f"{kind:4s} -> promoted: P50 {p['p50_ms']:8.2f} ms  P99 {p['p99_ms']:8.2f} ms")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
