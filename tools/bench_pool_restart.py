"""Pool-restart time (CPU, or a GPU with --device cuda:N): drain start -> first token of a restored request, and its parts.

    python -m tools.bench_pool_restart [--restarts 5] [--streams 8] [--out bench/results/pool_restart_cpu.json]

Starts a sidecar on the demo model (one active executor, no standby: a pool restart
replaces every executor anyway), runs `--streams` long SDK streams with different
sampling params, and while they run calls `kvhold pool-restart --continue --json` (the
real CLI, as an operator would). Each restart's figures come from the sidecars' own
clocks (CLOCK_MONOTONIC, shared by the old and the new process image), in ms from the
drain's start: executors stopped, journaled (fsynced to disk), new sidecar started
(close + execv + Python imports), requests restored, executor active (spawn, torch
import, weights reloaded, warm-up), first token (prefill of prompt + committed tokens).
Also: the pause the SDK client saw (largest gap between two tokens of one stream), the
cost of the durable admission record (fsync) per request, and whether every output
equals an uninterrupted run.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvhold.client.client import wait_all
from kvhold.testing.make_model import ensure_demo_model
from kvhold.testing.sidecar_process import SidecarProcess

FLAGS = ["--kv-pages", "512", "--max-seq-len", "512", "--max-batch-tokens", "128", "--max-batch", "16",
         "--standbys", "0", "--log-level", "WARNING"]


def requests(n: int, max_tokens: int = 440) -> list[dict]:
    return [dict(prompt=f"Request {i}: once upon a time", max_tokens=max_tokens, ignore_eos=True,
                 temperature=[0.0, 0.8, 1.0, 0.7][i % 4], top_p=[1.0, 1.0, 0.9, 1.0][i % 4],
                 top_k=[0, 0, 0, 20][i % 4], seed=100 + i) for i in range(n)]


def run_once(sc: SidecarProcess, reqs: list[dict], reference) -> dict:
    with sc.new_client(timeout=30) as client:
        t_admit = time.perf_counter()
        streams = [client.generate(**r) for r in reqs]
        admit_ms = (time.perf_counter() - t_admit) * 1e3 / len(reqs)
        last, gaps, fired = {}, {}, []

        def on_event(stream, event):
            now = time.monotonic()
            rid = stream.request_id
            gaps[rid] = max(gaps.get(rid, 0.0), now - last.get(rid, now))
            last[rid] = now
            if not fired and sum(1 for _ in last) == len(reqs):
                fired.append(subprocess.Popen(
                    [sys.executable, "-m", "kvhold", "pool-restart", "--instance", sc.instance,
                     "--runtime-root", str(sc.runtime_root), "--continue", "--json", "--timeout", "120"],
                    stdout=subprocess.PIPE, text=True))
        results = wait_all(streams, on_event)
        out, _ = fired[0].communicate(timeout=120)
    fig = json.loads(out[out.index("{"):])
    fig["identical"] = [r.token_ids for r in results] == reference
    fig["client_pause_ms"] = round(max(gaps.values()) * 1e3, 1)
    fig["admit_ms_per_request"] = round(admit_ms, 2)
    return fig


def summarize(runs: list[dict]) -> dict:
    parts = {}
    for name in runs[0]["ms_from_drain_start"]:
        values = [r["ms_from_drain_start"][name] for r in runs if name in r["ms_from_drain_start"]]
        parts[name] = {"p50": round(statistics.median(values), 1), "max": round(max(values), 1)}
    return {"ms_from_drain_start": parts,
            "client_pause_ms_p50": statistics.median(r["client_pause_ms"] for r in runs),
            "requests_lost": sum(r["requests_journaled"] - r["requests_restored"] for r in runs),
            "all_identical": all(r["identical"] for r in runs)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--restarts", type=int, default=5)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path("bench/results/pool_restart_cpu.json"))
    p.add_argument("--device", default="cpu", help="cpu, or cuda:N (CUDA VMM memory, bf16/fp32 engine)")
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: the tiny demo model)")
    p.add_argument("--sidecar-args", default="", help="more sidecar flags, e.g. --exact-prefill "
                   "(after the defaults: --max-seq-len, --kv-pages given here win)")
    p.add_argument("--max-tokens", type=int, default=440, help="per stream (within --max-seq-len)")
    args = p.parse_args(argv)
    model = args.model or ensure_demo_model()[0]
    device_flags = ["--device", args.device] + (["--backend", "cuda"] if args.device.startswith("cuda") else [])
    reqs = requests(args.streams, args.max_tokens)
    with tempfile.TemporaryDirectory(prefix="kvh-bench-journal-") as journal:
        with SidecarProcess(["--model", str(model), *FLAGS, *device_flags, "--journal-dir", journal,
                             *shlex.split(args.sidecar_args)]) as sc:
            sc.wait_steady(standbys=0, timeout=600)
            with sc.new_client(timeout=30) as client:
                reference = [r.token_ids for r in wait_all([client.generate(**r) for r in reqs])]
            runs = []
            for i in range(args.restarts):
                sc.wait_steady(standbys=0, timeout=600)
                run = run_once(sc, reqs, reference)
                if "ms_from_drain_start" not in run:   # every stream had finished: nothing to time
                    print(json.dumps({"restart": i + 1, "skipped": "no request in flight at the drain"}))
                    continue
                runs.append(run)
                print(json.dumps({"restart": i + 1, **runs[-1]["ms_from_drain_start"],
                                  "pause_ms": runs[-1]["client_pause_ms"]}), flush=True)
    if not runs:
        raise SystemExit("no restart found a request in flight: use more --streams or a slower model")
    result = {"command": "python -m tools.bench_pool_restart " + " ".join(argv or sys.argv[1:]),
              "model": str(args.model) if args.model else "demo (kvhold.testing.make_model, float64 on CPU)",
              "device": args.device, "streams": args.streams,
              "journal": "fsync on local disk (tempfile dir)", "summary": summarize(runs), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    return 0 if result["summary"]["all_identical"] and not result["summary"]["requests_lost"] else 1


if __name__ == "__main__":
    sys.exit(main())
