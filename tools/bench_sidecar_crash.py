"""Benchmark: SIGKILL of the sidecar (the memory owner) mid-stream -> first resumed token.

    python -m tools.bench_sidecar_crash [--kills 20] [--device cpu|cuda:N] [--out FILE]
    python -m tools.bench_sidecar_crash --device cuda:0 --model DIR --requests 64 --prompt-len 512,2048 \
        --max-tokens 128 --max-seq-len 2304 --max-batch-tokens 8192 --kv-memory 24GiB --kills 5

A sidecar on the tiny demo model (or `--model DIR`, e.g. Llama-3-8B's shapes from
`python -m kvhold.testing.make_model --preset llama3-8b`; `--requests N` then streams N
random-id prompts of `--prompt-len` tokens, mixed greedy and seeded sampling, as
tools/bench_recovery.py does) (the CPU engine on host memory, or with `--device cuda:N` the
CUDA engine on VMM device memory; a hot standby) serves SDK clients that stream
greedy and seeded-sampled requests. For each kill: every request is streaming; the sidecar
alone is SIGKILLed (not its process group: the executors outlive it and wait, keeping their
mappings); a new sidecar of the same instance is started at once and re-adopts the tables,
the memory, the executors and the requests; the SDK resumes its streams. Measured per kill,
from the SIGKILL (CLOCK_MONOTONIC): the new sidecar answering, every executor attached
again, the first token any stream receives after the kill, and every stream's first token
after it. Counted: requests lost or differing from an uninterrupted run, tokens recomputed,
executors replaced (pids that changed) and weight loads. The goals (issue of failure
domains): first resumed token P99 <= 1 s, 0 lost, KV kept (0 recomputed). The restart's
cost is mostly the new sidecar's Python start-up; what the kill costs after that is the
re-attach and the clients' resume (as soon as their socket reconnects; after a second of
silence if they saw no reconnect): `first_token_after_answer_ms` is that part alone. Tokens read
before the old sidecar is reaped were sent before the kill and are not counted.
Writes JSON (and prints a summary).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from kvhold.client.client import wait_all
from kvhold.testing.make_model import ensure_demo_model
from kvhold.testing.sidecar_process import SidecarProcess, submit_requests

REQUESTS = [
    dict(prompt="The sidecar keeps the memory", max_tokens=200, temperature=0.0, ignore_eos=True),
    dict(prompt="Once upon a time", max_tokens=220, temperature=0.0, ignore_eos=True),
    dict(prompt_ids=list(range(2, 90)), max_tokens=180, temperature=0.9, seed=3, ignore_eos=True),
]


def summarize(values) -> dict | None:
    if not values:
        return None
    v = np.asarray(values, dtype=float)
    return {"n": int(v.size), "p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99)),
            "max": float(v.max()), "mean": float(v.mean())}


def trial(current: SidecarProcess, flags, root: Path, logs: Path, index: int, reference,
          requests, start_timeout: float = 120, spare: bool = False) -> tuple[dict, SidecarProcess]:
    current.wait_steady(standbys=1, timeout=start_timeout)
    waiting = current.spare(log_path=logs / f"sidecar-{index + 1}.log", timeout=start_timeout) if spare else None
    before = {e["pid"]: e["role"] for e in current.status()["executors"]}
    client = current.new_client(timeout=start_timeout)
    streams = submit_requests(client, requests)
    for s in streams:                      # every request is streaming at the kill
        next(s)
    kill_ns, reaped_ns = [0], [0]
    first_after: dict[int, int] = {}
    lock = threading.Lock()

    def on_event(stream, event):      # a token read before the old sidecar was reaped was sent before the kill
        if reaped_ns[0]:
            with lock:
                first_after.setdefault(id(stream), time.monotonic_ns())

    results_box: dict = {}
    waiter = threading.Thread(target=lambda: results_box.update(r=wait_all(streams, on_event)), daemon=True)
    waiter.start()
    time.sleep(0.05)
    kill_ns[0] = time.monotonic_ns()
    os.kill(current.proc.pid, signal.SIGKILL)          # the sidecar alone
    current.proc.wait()
    reaped_ns[0] = time.monotonic_ns()
    if waiting is not None:        # it takes the lock the moment the kill lands
        nxt = waiting.wait_serving(timeout=start_timeout)
    else:
        nxt = SidecarProcess(flags, instance=current.instance, runtime_root=root,
                             log_path=logs / f"sidecar-{index + 1}.log").start(timeout=start_timeout)
    answered_ns = time.monotonic_ns()
    attached_ns = None
    deadline = time.monotonic() + start_timeout
    while time.monotonic() < deadline:
        attached = {e["pid"] for e in nxt.status()["events"] if e["kind"] == "attach"}
        if set(before) <= attached:
            attached_ns = time.monotonic_ns()
            break
        time.sleep(0.01)
    waiter.join(3 * start_timeout)
    client.close()
    results = results_box.get("r") or []
    after = {e["pid"]: e["role"] for e in nxt.status()["executors"]}
    st = nxt.status()
    ms = lambda ns: None if ns is None else (ns - kill_ns[0]) / 1e6      # noqa: E731
    row = {
        "kill": index, "sidecar_pid": current.proc.pid, "new_sidecar_pid": nxt.proc.pid,
        "answered_ms": ms(answered_ns), "executors_attached_ms": ms(attached_ns),
        "first_token_after_kill_ms": ms(min(first_after.values())) if first_after else None,
        "all_streams_resumed_ms": ms(max(first_after.values())) if len(first_after) == len(streams) else None,
        # the SDK's part: from the new sidecar answering (its sockets bound) to the first resumed token
        "first_token_after_answer_ms": (min(first_after.values()) - answered_ns) / 1e6 if first_after else None,
        "requests": len(requests), "completed": len(results),
        "identical": sum(r.token_ids == ref for r, ref in zip(results, reference)),
        "tokens_recomputed": sum(r.recomputed_tokens for r in results),
        "executors_kept": before == after,
        "requests_adopted": st["pool_restart"]["restore"].get("requests_adopted"),
        "weights_loaded": st["weights"].get("load_ms") is not None,
        "hand_back": (st.get("adoption") or {}).get("hand_back"),
        "spare": waiting is not None,
        # the new sidecar's start, from taking the lock to re-adopting the pool (its own clock)
        "adoption_ms": (st.get("adoption") or {}).get("ms"),
        "spare_lock_taken_ms": ms((st.get("spare") or {}).get("lock_taken_ns")),
    }
    return row, nxt


def write(out: dict, rows: list[dict], path: Path, partial: bool) -> None:
    out["machine"]["loadavg_at_end"] = os.getloadavg()
    out["kills"] = rows
    if partial:
        out["partial"] = True
    else:
        out.pop("partial", None)
    first = [r["first_token_after_kill_ms"] for r in rows if r["first_token_after_kill_ms"] is not None]
    out["summary"] = {
        "kills": len(rows),
        "first_token_after_kill_ms": summarize(first),
        "all_streams_resumed_ms": summarize([r["all_streams_resumed_ms"] for r in rows if r["all_streams_resumed_ms"]]),
        "sidecar_answered_ms": summarize([r["answered_ms"] for r in rows]),
        "first_token_after_answer_ms": summarize([r["first_token_after_answer_ms"] for r in rows
                                                  if r["first_token_after_answer_ms"] is not None]),
        "executors_attached_ms": summarize([r["executors_attached_ms"] for r in rows if r["executors_attached_ms"]]),
        "adoption_ms": summarize([r["adoption_ms"] for r in rows if r.get("adoption_ms") is not None]),
        "spare_lock_taken_ms": summarize([r["spare_lock_taken_ms"] for r in rows
                                          if r.get("spare_lock_taken_ms") is not None]),
        "requests": sum(r["requests"] for r in rows), "lost": sum(r["requests"] - r["completed"] for r in rows),
        "differing": sum(r["completed"] - r["identical"] for r in rows),
        "tokens_recomputed": sum(r["tokens_recomputed"] for r in rows),
        "executors_replaced_kills": sum(not r["executors_kept"] for r in rows),
        "weights_loaded_kills": sum(r["weights_loaded"] for r in rows),
    }
    p99 = (out["summary"]["first_token_after_kill_ms"] or {}).get("p99")
    out["goals"]["met"] = bool(rows and p99 is not None and p99 <= 1000 and out["summary"]["lost"] == 0
                               and out["summary"]["tokens_recomputed"] == 0)
    path.write_text(json.dumps(out, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=20, help="sidecar SIGKILLs (default 20)")
    ap.add_argument("--device", default="cpu", help="cpu (host memory) or cuda:N (VMM device memory)")
    ap.add_argument("--out", type=Path, default=None,
                    help="default bench/results/sidecar_crash_cpu.json, or _cuda.json with --device cuda")
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: the tiny demo model)")
    ap.add_argument("--requests", type=int, default=None,
                    help="stream N random-id prompts (default: the 3 fixed text and id requests)")
    ap.add_argument("--prompt-len", default="32,128", help="min,max prompt tokens (with --requests)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per request (with --requests)")
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--max-batch-tokens", type=int, default=None,
                    help="default 64 on CPU, 256 on CUDA (a prefill chunk and the batch fit)")
    ap.add_argument("--max-batch", type=int, default=None, help="default 16, or --requests if more")
    ap.add_argument("--kv-pages", type=int, default=None, help="default 256 unless --kv-memory")
    ap.add_argument("--kv-memory", default=None, help="the sidecar's --kv-memory (e.g. 24GiB)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="default 64 on CUDA with the tiny model")
    ap.add_argument("--log-level", default=None, help="the sidecars' and executors' log level")
    ap.add_argument("--start-timeout", type=float, default=None,
                    help="seconds for a sidecar to answer, executors to attach (default 120; 600 with --model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--spare", action=argparse.BooleanOptionalAction, default=True,
                    help="a spare sidecar (`kvhold sidecar --spare`) waits before each kill and takes "
                         "over (the default); --no-spare starts a new sidecar after the kill")
    args = ap.parse_args(argv)
    if args.kv_pages and args.kv_memory:
        ap.error("--kv-pages and --kv-memory both size the pool: give one")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        ap.error(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if args.out is None:
        args.out = Path(f"bench/results/sidecar_crash_{'cpu' if args.device == 'cpu' else 'cuda'}.json")
    model = args.model or ensure_demo_model()[0]
    if args.requests is None:
        requests = REQUESTS
    else:
        from tools.bench_recovery import make_requests
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        lo, hi = (int(x) for x in args.prompt_len.split(","))
        if hi + args.max_tokens > args.max_seq_len:
            ap.error(f"--prompt-len's {hi} + --max-tokens {args.max_tokens} exceed --max-seq-len {args.max_seq_len}")
        requests = make_requests(args.requests, (lo, hi), args.max_tokens, vocab, args.seed)
    start_timeout = args.start_timeout or (600.0 if args.model else 120.0)
    root = Path(tempfile.mkdtemp(prefix="kvh-crash-"))
    logs = root / "logs"
    logs.mkdir()
    mbt = args.max_batch_tokens or (64 if args.device == "cpu" else 256)    # a chunk + the batch fit
    flags = ["--model", str(model), "--max-seq-len", str(args.max_seq_len),
             "--max-batch-tokens", str(mbt), "--max-batch", str(args.max_batch or max(16, len(requests))),
             "--standbys", "1", "--journal-dir", str(root / "journal"), "--lease-ms", "3000"]
    flags += ["--kv-memory", args.kv_memory] if args.kv_memory else ["--kv-pages", str(args.kv_pages or 256)]
    if args.log_level:
        flags += ["--log-level", args.log_level]
    if args.device != "cpu":
        flags += ["--device", args.device, "--backend", "cuda", "--startup-lease-ms", "600000"]
        chunk = args.prefill_chunk or (None if args.model else 64)
        if chunk:
            flags += ["--prefill-chunk", str(chunk)]
    elif args.prefill_chunk:
        flags += ["--prefill-chunk", str(args.prefill_chunk)]
    out = {"command": "python -m tools.bench_sidecar_crash " + " ".join(argv or os.sys.argv[1:]),
           "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "device": args.device, "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "loadavg_at_start": os.getloadavg()},
           "model": str(model), "flags": flags, "spare": args.spare,
           "requests": requests if args.requests is None else
           {"n": len(requests), "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
            "prompt_tokens": [len(r["prompt_ids"]) for r in requests]},
           "goals": {"first_resumed_token_p99_ms": 1000, "requests_lost": 0,
                                           "tokens_recomputed": 0}}
    sc = SidecarProcess(flags, runtime_root=root, log_path=logs / "sidecar-0.log").start(timeout=start_timeout)
    rows = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        sc.wait_steady(standbys=1, timeout=max(600, start_timeout))     # a GPU's first start compiles kernels
        with sc.new_client(timeout=start_timeout) as c:
            reference = [r.token_ids for r in wait_all(submit_requests(c, requests))]
        for i in range(args.kills):
            row, sc = trial(sc, flags, root, logs, i, reference, requests, start_timeout, spare=args.spare)
            rows.append(row)
            write(out, rows, args.out, partial=i + 1 < args.kills)      # kept if the run is cut short
            print(f"kill {i + 1}/{args.kills}: answered {row['answered_ms']:.0f} ms, attached "
                  f"{row['executors_attached_ms'] or -1:.0f} ms, first token {row['first_token_after_kill_ms'] or -1:.0f} ms, "
                  f"identical {row['identical']}/{row['requests']}, recomputed {row['tokens_recomputed']}", flush=True)
    finally:
        try:      # the executors are the first sidecar's children, outside the last one's group
            pids = [e["pid"] for e in sc.status()["executors"]]
        except Exception:  # noqa: BLE001 - a sidecar that does not answer: its group goes anyway
            pids = []
        pids += sc.paths.spare_pids()      # a spare left waiting would take over from this stop
        sc.stop(signal.SIGKILL)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    write(out, rows, args.out, partial=len(rows) < args.kills)
    print(json.dumps(out["summary"], indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
