"""Benchmark: recovery of a tensor-parallel executor group from the death of one rank.

    python -m tools.bench_recovery_tp --tensor-parallel-size 2 --kills 10

Runs a group of N rank processes (torch.distributed, gloo on CPU) over owner-kept state
(kvhold.testing.tensor_parallel_group): per-rank weight shards and KV regions, per-rank
token tables, one lease with a group epoch. First an uninterrupted run at TP=1 and at TP=N
(the references), then one run in which a random rank of the active group is SIGKILLed
--kills times, each at a random committed-token count once a hot-standby group is ready.
Measures kill -> detection and kill -> first token committed by the standby group
(P50/P99), tokens lost, and whether the outputs equal the uninterrupted runs'.
`--device cuda` is refused: a CUDA group needs an NCCL communicator and KV regions in VMM
memory that outlive a rank, which kvhold does not build yet (the shapes it would run,
Llama-3-70B at TP=2, are recorded in the refusal). Writes JSON under bench/results/.

    python -m tools.bench_recovery_tp --sidecar --tensor-parallel-size 2 --kills 10

`--sidecar`: the same measurement through a real `kvhold sidecar -tp N` (its executor groups,
kvhold.executor.tensor_parallel.ranks) and the SDK: a TP=1 sidecar's uninterrupted outputs
are the reference; then, --kills times, once the hot-standby group is ready, a random rank of
the active group is SIGKILLed at a random streamed-token count. From the sidecar's recovery
record of that kill: kill -> detection, -> promotion and -> first resumed token committed and
streamed (the sidecar's `first_token_ns`), P50/P99; requests lost and outputs against the
reference. Writes bench/results/recovery_cpu_tp2_sidecar.json by default.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvhold.testing.tensor_parallel_group import GroupOwner
from kvhold.protocol.tensor_parallel import tensor_parallel_refusal


def _state() -> Path:
    return Path(tempfile.mkdtemp(prefix="kvh-tpbench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))


def _run(model, world, prompts, max_new, standby, on_tick=None, step_delay_s=0.0, hang_s=5.0):
    d = _state()
    try:
        owner = GroupOwner.create(d, model, world, prompts, max_new, standby=standby, hang_s=hang_s,
                                  step_delay_s=step_delay_s)
        t = time.monotonic()
        # the first kill may come early: the run starts once its standby group is ready
        out = owner.run(on_tick=on_tick, timeout_s=3600, standby_first=standby)
        wall = time.monotonic() - t
        target = [len(p) + max_new for p in prompts]
        lost = int(sum(max(0, a - int(b)) for a, b in zip(target, owner.committed())))
        return owner, out, wall, lost
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensor-parallel-size", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: the tiny demo model)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=None, help="default: enough for every kill")
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--step-delay-ms", type=float, default=30.0,
                    help="pause after each step of the run with kills (a slower stream)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/recovery_cpu_tp2.json"))
    ap.add_argument("--sidecar", action="store_true",
                    help="through a real kvhold sidecar -tp N and the SDK (see above)")
    a = ap.parse_args(argv)
    if a.sidecar and a.out == Path("bench/results/recovery_cpu_tp2.json"):
        a.out = Path(f"bench/results/recovery_cpu_tp{a.tensor_parallel_size}_sidecar.json")
    if (why := tensor_parallel_refusal(None, a.tensor_parallel_size, a.device)) is not None:
        print(f"bench_recovery_tp: {why} (wanted: Llama-3-70B shapes, random bf16, TP={a.tensor_parallel_size}, "
              "64 streams)", file=sys.stderr)
        return 2
    if a.model is None:
        from kvhold.testing.make_model import ensure_demo_model
        a.model = ensure_demo_model()[0]
    rng = random.Random(a.seed)
    if a.sidecar:
        return _sidecar_main(a, argv, rng)
    prompts = [[1] + [rng.randrange(3, 500) for _ in range(rng.randint(4, 24))] for _ in range(a.requests)]
    gap = (8, 24)                                      # committed tokens between a resume and the next kill
    # a standby group starts in seconds (a Python process importing torch per rank): the run waits
    # for the first one, and must last long enough for the next one before every later kill
    max_new = a.max_tokens or 1900 - max(len(p) for p in prompts)
    world = a.tensor_parallel_size

    _, ref1, wall1, _ = _run(a.model, 1, prompts, max_new, standby=False)
    _, refn, walln, _ = _run(a.model, world, prompts, max_new, standby=False)
    print(f"references: TP=1 {wall1:.1f}s, TP={world} {walln:.1f}s, equal {ref1 == refn}", flush=True)

    kills = []
    plan = {"next": None}

    def inject(owner: GroupOwner, group) -> None:
        if len(kills) >= a.kills or not owner.standby_ready():
            return
        c = int(owner.committed()[0])
        if plan["next"] is None:
            plan["next"] = c + rng.randint(*gap)
        if c >= plan["next"] and all(p.poll() is None for p in group.procs):
            rank = rng.randrange(world)
            owner.fault_at = time.time()
            os.kill(group.procs[rank].pid, signal.SIGKILL)
            kills.append({"epoch": group.epoch, "rank": rank, "at_committed": c})
            plan["next"] = None

    owner, out, wall, lost = _run(a.model, world, prompts, max_new, standby=True, on_tick=inject,
                                  step_delay_s=a.step_delay_ms / 1000)
    resumed = [t.resumed_s * 1000 for t in owner.takeovers if t.resumed_s is not None]
    detected = [t.detected_s * 1000 for t in owner.takeovers]

    def pct(xs, q):
        return round(float(np.percentile(xs, q)), 2) if xs else None

    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "command": "python -m tools.bench_recovery_tp " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": rev, "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "device": a.device},
        "model": str(a.model), "tensor_parallel_size": world, "backend": "gloo",
        "requests": a.requests, "max_tokens": max_new,
        "kills_asked": a.kills, "kills": kills, "takeovers": len(owner.takeovers),
        "kill_to_detect_ms": {"p50": pct(detected, 50), "p99": pct(detected, 99), "max": pct(detected, 100)},
        "kill_to_first_resumed_token_ms": {"p50": pct(resumed, 50), "p99": pct(resumed, 99),
                                           "max": pct(resumed, 100), "all": [round(x, 2) for x in resumed]},
        "lost_tokens": lost,
        "identical_to_uninterrupted_tp": out == refn,
        "identical_to_uninterrupted_tp1": out == ref1,
        "tp_equals_tp1_uninterrupted": ref1 == refn,
        "wall_s": {"reference_tp1": round(wall1, 2), "reference_tp": round(walln, 2), "with_kills": round(wall, 2)},
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("takeovers", "kill_to_first_resumed_token_ms", "lost_tokens",
                                             "identical_to_uninterrupted_tp", "identical_to_uninterrupted_tp1")}))
    ok = lost == 0 and out == refn and len(kills) == a.kills == len(resumed)
    return 0 if ok else 1


def _sidecar_main(a, argv, rng: random.Random) -> int:
    from kvhold.client.client import wait_all
    from kvhold.protocol.leases import now_ns
    from kvhold.testing.sidecar_process import SidecarProcess, submit_requests

    world = a.tensor_parallel_size
    max_new = a.max_tokens or 120
    requests = [dict(prompt_ids=[1] + [rng.randrange(3, 500) for _ in range(rng.randint(4, 24))],
                     max_tokens=max_new, temperature=0.0 if i % 2 == 0 else 0.9, seed=i)
                for i in range(a.requests)]
    flags = ["--model", str(a.model), "--kv-pages", "512", "--max-seq-len", "512", "--max-batch-tokens", "64",
             "--max-batch", "16", "--cpu-threads", "1"]

    def run(sc, on_event=None):
        with sc.new_client(timeout=120) as client:
            return [r.token_ids for r in wait_all(submit_requests(client, requests), on_event)]

    with SidecarProcess([*flags, "--standbys", "0"]) as sc:
        sc.wait_steady(standbys=0, timeout=300)
        t = time.monotonic()
        ref1 = run(sc)
        wall1 = time.monotonic() - t
    kills, outputs_equal, lost = [], [], 0
    with SidecarProcess([*flags, "-tp", str(world), "--standbys", "1"]) as sc:
        sc.wait_steady(standbys=1, timeout=300)
        t = time.monotonic()
        refn = run(sc)
        walln = time.monotonic() - t
        print(f"references: TP=1 {wall1:.1f}s, TP={world} {walln:.1f}s, equal {ref1 == refn}", flush=True)
        total = sum(len(r) for r in ref1)
        for i in range(a.kills):
            active = sc.wait_steady(standbys=1, timeout=300)
            ranks = _group_pids(active["pid"], world)
            threshold, rank, seen, kill = rng.randrange(total // 8, total // 2), rng.randrange(world), [0], {}

            def on_event(stream, event):
                seen[0] += 1
                if seen[0] == threshold:
                    kill.update(ns=now_ns(), rank=rank, pid=ranks[rank], epoch=active["epoch"])
                    os.kill(ranks[rank], signal.SIGKILL)

            out = run(sc, on_event)
            outputs_equal.append(out == ref1)
            lost += sum(len(r) < len(ref) for r, ref in zip(out, ref1))

            def find(st):
                return next((r for r in st["recoveries"] if r.get("fenced_epoch") == kill["epoch"]
                             and "first_token_ns" in r), None)

            rec = sc.wait_for(find, timeout=120)
            st = sc.status()
            fence = next(e for e in st["events"] if e["kind"] == "fence" and e.get("fenced_epoch") == kill["epoch"])
            ms = lambda ns: round((ns - kill["ns"]) / 1e6, 2)  # noqa: E731
            kills.append({"rank": rank, "pid": kill["pid"], "epoch": kill["epoch"], "at_event": threshold,
                          "detect_ms": ms(fence["detect_ns"]), "promoted_ms": ms(rec["promoted_ns"]),
                          "first_token_ms": ms(rec["first_token_ns"]), "pages_checked": rec["pages_checked"],
                          "pages_bad": rec["pages_bad"], "requests_lost": rec["requests_lost"]})
            print(f"kill {i + 1}/{a.kills}: rank {rank}, first resumed token {kills[-1]['first_token_ms']} ms",
                  flush=True)

    def pct(key, q):
        xs = [k[key] for k in kills]
        return round(float(np.percentile(xs, q)), 2) if xs else None

    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "command": "python -m tools.bench_recovery_tp " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": rev, "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "device": a.device,
                    "load_average": os.getloadavg()},
        "path": "kvhold sidecar -tp N (executor groups), SDK client",
        "model": str(a.model), "tensor_parallel_size": world, "backend": "gloo", "requests": a.requests,
        "max_tokens": max_new, "kills": kills,
        "kill_to_detect_ms": {"p50": pct("detect_ms", 50), "p99": pct("detect_ms", 99)},
        "kill_to_promoted_ms": {"p50": pct("promoted_ms", 50), "p99": pct("promoted_ms", 99)},
        "kill_to_first_resumed_token_ms": {"p50": pct("first_token_ms", 50), "p99": pct("first_token_ms", 99),
                                           "max": pct("first_token_ms", 100)},
        "requests_lost": lost + sum(k["requests_lost"] for k in kills),
        "identical_to_uninterrupted_tp1": all(outputs_equal),
        "tp_equals_tp1_uninterrupted": ref1 == refn,
        "wall_s": {"reference_tp1": round(wall1, 2), "reference_tp": round(walln, 2)},
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("kill_to_first_resumed_token_ms", "requests_lost",
                                             "identical_to_uninterrupted_tp1", "tp_equals_tp1_uninterrupted")}))
    return 0 if result["requests_lost"] == 0 and all(outputs_equal) and len(kills) == a.kills else 1


def _group_pids(leader: int, world: int, timeout_s: float = 30.0) -> list[int]:
    """The leader (rank 0) and its follower ranks (its children), in rank order."""
    from kvhold.executor.tensor_parallel.ranks import group_pids

    deadline = time.monotonic() + timeout_s
    while True:
        pids = group_pids(leader)
        if len(pids) == world or time.monotonic() > deadline:
            return pids
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
