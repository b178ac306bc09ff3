"""Probe: a real CUDA fault (illegal address) in the active executor, under streaming load.

    python -m tools.probe_cuda_fault --model DIR --trials 5 --out bench/results/cuda_fault_cuda.json

Runs a real sidecar on a CUDA device with a hot standby, measures an uninterrupted
reference run of the request set, then repeats the set once per trial and, after a
random number of streamed tokens, arms the `cuda_illegal` fault
(kvhold.executor.faults): on its next decode step the active executor queues a
kernel that overwrites the start of every running request's first KV page (pages
whose checksums are already published) and then stores to an address near zero.
Every figure is counted from what happened, on CLOCK_MONOTONIC: when the kernel was
queued (the executor writes it into the fault's once-file), when the sidecar fenced
the executor and why, its exit code, the takeover's page and request counts, the
first resumed token, whether every output equals the reference, and what the health
monitor did with the driver's Xid, if one arrived. Writes JSON.

Three faults within 60 s trip the health policy's storm rule (kvhold.sidecar.health),
which closes admissions for a pool restart once the third has been admitted: keep
--trials at 3 or fewer.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

from kvhold.client.client import wait_all
from kvhold.testing.sidecar_process import SidecarProcess


def make_requests(n: int, vocab: int, max_tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(3, vocab) for _ in range(rng.randint(40, 160))]
        sampling = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.8, seed=i)
        out.append(dict(prompt_ids=ids, max_tokens=max_tokens, ignore_eos=True, **sampling))
    return out


def _vocab(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def run(args) -> dict:
    once = Path(tempfile.mkdtemp(prefix="kvh-fault-")) / "fired"
    once.write_text("disarmed\n")          # exists: the fault waits until a trial removes it
    env = {"KVHOLD_FAULT": "decode_queued:1:cuda_illegal", "KVHOLD_FAULT_ONCE": str(once)}
    flags = ["--model", str(args.model), "--device", args.device, "--backend", "cuda",
             "--max-seq-len", "512", "--max-batch", "16", "--max-batch-tokens", "512",
             "--prefill-chunk", "128", "--log-level", args.log_level, "--restart-backoff-ms", "0,0",
             *shlex.split(args.sidecar_args)]
    requests = make_requests(args.requests, _vocab(args.model), args.max_tokens, args.seed)
    rng = random.Random(args.seed)
    trials = []
    log_path = Path(args.out).with_suffix(".log") if args.out else None
    with SidecarProcess(flags, env=env, log_path=log_path) as sc:
        sc.wait_steady(standbys=1, timeout=600)
        with sc.new_client(timeout=120) as client:
            reference = [r.token_ids for r in wait_all([client.generate(**r) for r in requests])]
            for trial in range(args.trials):
                steady = sc.wait_steady(standbys=1, timeout=600)
                victim = steady["pid"]
                before = len(sc.status()["recoveries"])
                seen, armed_ns = [0], [0]
                threshold = rng.randint(args.requests * 4, args.requests * args.max_tokens // 2)

                def on_event(stream, event):
                    seen[0] += 1
                    if seen[0] == threshold:
                        armed_ns[0] = time.monotonic_ns()
                        once.unlink()

                t0 = time.monotonic()
                results = wait_all([client.generate(**r) for r in requests], on_event)
                got = [r.token_ids for r in results]
                wall = time.monotonic() - t0
                rec = sc.wait_for(lambda st: st["recoveries"][before] if len(st["recoveries"]) > before
                                  and "first_token_ns" in st["recoveries"][before] else None, timeout=60)
                st = sc.status()
                pid_s, fired_s = once.read_text().split()
                fired_ns = int(fired_s)
                fence = next((e for e in st["events"] if e.get("kind") == "fence" and e.get("pid") == victim), {})
                exit_ev = next((e for e in st["events"] if e.get("kind") == "exit" and e.get("pid") == victim), {})
                trials.append({
                    "victim_pid": victim, "fault_pid": int(pid_s),
                    "threshold_tokens": threshold,
                    "fence_reason": fence.get("reason"), "fence_detail": fence.get("detail"),
                    "exit_code": exit_ev.get("exit_code"),
                    "fault_queued_to_fenced_ms": round((fence.get("ns", 0) - fired_ns) / 1e6, 3) if fence else None,
                    "fault_queued_to_exit_confirmed_ms":
                        round((exit_ev.get("ns", 0) - fired_ns) / 1e6, 3) if exit_ev else None,
                    "fault_queued_to_first_resumed_token_ms": round((rec["first_token_ns"] - fired_ns) / 1e6, 3),
                    "detect_to_first_resumed_token_ms": round((rec["first_token_ns"] - rec["detect_ns"]) / 1e6, 3),
                    "pages_checked": rec.get("pages_checked"), "pages_bad": rec.get("pages_bad"),
                    # the takeover's KV classes: intact, recomputed from the first bad page, recomputed whole
                    "kv_resumable": rec.get("requests_resumable"),
                    "kv_damaged": rec.get("requests_damaged"),
                    "kv_lost": rec.get("requests_lost"),
                    "streams_finished": sum(r.finish_reason is not None for r in results),
                    "streams_failed": len(requests) - sum(r.finish_reason is not None for r in results),
                    "tokens_recomputed": rec.get("tokens_recomputed"), "tokens_kept": rec.get("tokens_kept"),
                    "identical": got == reference,
                    "differing_requests": sum(a != b for a, b in zip(got, reference)),
                    "wall_s": round(wall, 3),
                })
                print(json.dumps(trials[-1]), flush=True)
                once.write_text("disarmed\n")
        st = sc.status()
        health = st.get("health", {})
    result = {
        "what": "real CUDA illegal-address fault in the active executor (tools/probe_cuda_fault.py)",
        "command": " ".join([os.path.basename(sys.executable), "-m", "tools.probe_cuda_fault", *sys.argv[1:]]),
        "host": platform.node(), "model": str(args.model), "requests": args.requests,
        "max_tokens": args.max_tokens, "trials": trials,
        "all_identical": all(t["identical"] for t in trials),
        "streams_failed": sum(t["streams_failed"] for t in trials),
        "fence_reasons": [t["fence_reason"] for t in trials],
        "health_actions_taken": health.get("actions_taken", []),
        "health_source": {k: v for k, v in health.items() if k != "actions_taken"},
    }
    try:
        import torch
        result["gpu"] = torch.cuda.get_device_name(0)
        result["torch"] = torch.__version__
    except Exception:      # the probe's figures stand without the device name
        pass
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.probe_cuda_fault", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--requests", type=int, default=8, help="concurrent streams per trial (default 8)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--trials", type=int, default=3, help="faults, one per run of the request set (default 3)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sidecar-args", default="", help="more sidecar flags, e.g. --exact-prefill")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--out", default=None, help="write the JSON here (else stdout only)")
    args = p.parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0 if result["all_identical"] and result["streams_failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
