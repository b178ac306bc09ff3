"""Probe: how long does a killed process's queued GPU work hold up another process's kernels?

A hot standby takes over while its dead predecessor's CUDA context is being torn down. If the
work that context had queued (the rest of a decode step, a prefill chunk) keeps running, or
holds the GPU while the driver cleans up, every kernel of the takeover waits behind it: a
floor under the recovery time that no code in the standby can remove.

Two processes on one GPU: a *victim* that queues W ms of matmuls and then blocks, and an
*observer*, warmed up, that on a signal runs a tiny kernel and then a read pass over
--read-gib GiB (a validation pass's shape) and reports when each completed. Per trial, for each
W: the victim is SIGKILLed (`killed`), or left alive and busy (`alive`: its work time-slices
with the observer's), and the observer starts the instant after. `idle` is the observer alone.
All times on CLOCK_MONOTONIC, one clock for every process of the host.

    python3 -m tools.probe_dead_context --out bench/results/dead_context_cuda.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp


def _matmul_ms(n: int, iters: int) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ a
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / iters


def victim(conn) -> None:
    n = 4096
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    per = _matmul_ms(n, 20)
    conn.send(per)
    while True:
        work_ms = conn.recv()
        if work_ms is None:
            return
        for _ in range(max(0, round(work_ms / per))):
            a @ a
        conn.send("queued")          # enqueued, not run: the parent kills now (or lets it run)
        if conn.recv() == "sync":
            torch.cuda.synchronize()
            conn.send("done")


def observer(conn, read_gib: float) -> None:
    buf = torch.empty(int(read_gib * 2**30) // 8, dtype=torch.int64, device="cuda").fill_(1)
    tiny = torch.zeros(1, device="cuda")
    for _ in range(3):
        tiny.add_(1)
        buf.sum()
    torch.cuda.synchronize()
    conn.send("ready")
    while True:
        if not conn.poll(0.0005):
            continue
        msg = conn.recv()
        if msg is None:
            return
        t0 = time.monotonic_ns()
        tiny.add_(1)
        torch.cuda.synchronize()
        t1 = time.monotonic_ns()
        buf.sum()
        torch.cuda.synchronize()
        t2 = time.monotonic_ns()
        conn.send((t0, t1, t2))


def _stats(xs: list[float]) -> dict:
    return {"p50_ms": statistics.median(xs), "max_ms": max(xs), "min_ms": min(xs), "n": len(xs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-ms", default="0,10,30", help="ms of matmuls the victim queues, comma-separated")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--read-gib", type=float, default=11.0, help="the observer's read pass")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_dead_context: needs a CUDA device", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    obs_conn, obs_child = ctx.Pipe()
    obs = ctx.Process(target=observer, args=(obs_child, args.read_gib), daemon=True)
    obs.start()
    assert obs_conn.recv() == "ready"
    rows = []

    def observe(mode: str, work_ms: float, kill_ns: int, reaped_ns: int | None, t) -> None:
        t0, t1, t2 = t
        rows.append({"mode": mode, "work_ms": work_ms, "signal_to_start_ms": (t0 - kill_ns) / 1e6,
                     "tiny_kernel_ms": (t1 - t0) / 1e6, "read_pass_ms": (t2 - t1) / 1e6,
                     "kill_to_read_done_ms": (t2 - kill_ns) / 1e6,
                     "victim_reaped_ms": None if reaped_ns is None else (reaped_ns - kill_ns) / 1e6})

    for trial in range(args.trials):
        t = time.monotonic_ns()
        obs_conn.send("go")
        observe("idle", 0.0, t, None, obs_conn.recv())
        for work_ms in (float(w) for w in args.work_ms.split(",")):
            for mode in ("alive", "killed"):
                vic_conn, vic_child = ctx.Pipe()
                vic = ctx.Process(target=victim, args=(vic_child,), daemon=True)
                vic.start()
                vic_conn.recv()                            # its matmul time: warmed up
                time.sleep(0.2)
                vic_conn.send(work_ms)
                assert vic_conn.recv() == "queued"
                t = time.monotonic_ns()
                if mode == "killed":
                    os.kill(vic.pid, signal.SIGKILL)
                obs_conn.send("go")
                got = obs_conn.recv()
                reaped = None
                if mode == "killed":
                    vic.join(30)
                    reaped = time.monotonic_ns()
                else:
                    vic_conn.send("sync")
                    vic_conn.recv()
                    vic_conn.send(None)
                    vic.join(30)
                observe(mode, work_ms, t, reaped, got)
                r = rows[-1]
                print(f"trial {trial} {mode:6s} work {work_ms:5.1f} ms: tiny kernel done "
                      f"{r['signal_to_start_ms'] + r['tiny_kernel_ms']:7.2f} ms, read pass {r['read_pass_ms']:6.2f} ms, "
                      f"all {r['kill_to_read_done_ms']:7.2f} ms after the signal", flush=True)
    obs_conn.send(None)
    obs.join(10)
    summary = {}
    for mode in ("idle", "alive", "killed"):
        for work_ms in sorted({r["work_ms"] for r in rows if r["mode"] == mode}):
            sel = [r for r in rows if r["mode"] == mode and r["work_ms"] == work_ms]
            summary[f"{mode}_{work_ms:g}ms"] = {
                "tiny_kernel_done": _stats([r["signal_to_start_ms"] + r["tiny_kernel_ms"] for r in sel]),
                "read_pass": _stats([r["read_pass_ms"] for r in sel]),
                "signal_to_read_done": _stats([r["kill_to_read_done_ms"] for r in sel])}
    for k, v in summary.items():
        print(f"{k:14s} tiny kernel done P50 {v['tiny_kernel_done']['p50_ms']:7.2f} ms, read pass P50 "
              f"{v['read_pass']['p50_ms']:6.2f} ms, all P50 {v['signal_to_read_done']['p50_ms']:7.2f} "
              f"max {v['signal_to_read_done']['max_ms']:7.2f} ms")
    if args.out:
        out = {"command": "python3 -m tools.probe_dead_context " + " ".join(argv or sys.argv[1:]),
               "machine": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "read_gib": args.read_gib, "summary": summary, "rows": rows}
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
