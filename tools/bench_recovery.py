"""Benchmark: recovery from executor crashes under streaming load, per executor tier.

    python -m tools.bench_recovery --device cpu --kills 50
    python -m tools.bench_recovery --device cuda --model DIR --requests 64 --kills 20 --tiers standby,cold
    python -m tools.bench_recovery --device cuda --model DIR --kv-mode foreign --tiers standby

Runs a real sidecar, measures an uninterrupted reference run of the request set,
then repeats the set while SIGKILLing the active executor at a random point
(random count of streamed tokens), once per trial. Every figure is taken from
the kill, on CLOCK_MONOTONIC, from the sidecar's and the executor's own records:
detect, fence, promote, validate done, resume done, first resumed token, and the
dead process's exit confirmation. Also: tokens recomputed, requests per recovery
class, requests lost, and whether every output equals the reference.
Tiers: `standby` (a warm standby is promoted at once), `standby-wait` (the same,
but the promotion waits until the dead process has fully exited: `--takeover
wait-exit`), `zygote` (no standby: an executor forked from the torch-imported
zygote maps, warms up and takes over), `cold` (no standby, no zygote: a new
process starts from nothing). `--kv-mode foreign` runs the sidecar's executors in
foreign-pool mode (kvhold.executor.foreign_pool): each computes in a private KV pool and
recovery goes through the KV mirror. Writes JSON (and a PNG if matplotlib is
available) under bench/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np

from kvhold.client.client import wait_all
from kvhold.testing.sidecar_process import SidecarProcess

PARTS = ("detect", "fenced", "promoted", "takeover_start", "validated", "resumed", "first_token",
         "exit_confirmed")
TIERS = ("standby", "standby-wait", "zygote", "cold")


def make_requests(n: int, prompt_range: tuple[int, int], max_tokens: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        length = rng.randint(*prompt_range)
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        sampling = rng.choice([dict(temperature=0.0), dict(temperature=0.8, seed=i),
                               dict(temperature=1.0, top_p=0.9, seed=i), dict(temperature=0.7, top_k=40, seed=i)])
        reqs.append(dict(prompt_ids=ids, max_tokens=max_tokens, ignore_eos=True, **sampling))
    return reqs


def run_set(client, requests, on_event=None):
    return wait_all([client.generate(**r) for r in requests], on_event)


def one_kill(sc: SidecarProcess, client, requests, reference, rng, standbys: int,
             zygote: bool = False) -> dict:
    sc.wait_steady(standbys=standbys, timeout=600)
    if zygote:   # measure the zygote path, not the cold fallback used while it starts
        sc.wait_for(lambda st: (st.get("zygote") or {}).get("ready"), timeout=600)
    total = sum(len(r) for r in reference)
    started_ns = time.monotonic_ns()
    threshold = rng.randrange(len(requests), max(len(requests) + 1, total * 3 // 4))
    kill: dict = {}
    streamed = [0]

    def on_event(stream, event):
        streamed[0] += 1
        if streamed[0] == threshold:
            victim = sc.wait_steady(standbys=0)
            kill.update(pid=victim["pid"], epoch=victim["epoch"], ns=time.monotonic_ns())
            os.kill(victim["pid"], signal.SIGKILL)

    results = run_set(client, requests, on_event)
    identical = [r.token_ids == ref for r, ref in zip(results, reference)]
    mismatches = [{"request": i, "first_difference": next((j for j, (a, b) in enumerate(zip(r.token_ids, ref))
                                                           if a != b), min(len(r.token_ids), len(ref))),
                   "got_tokens": len(r.token_ids), "reference_tokens": len(ref), "finish_reason": r.finish_reason}
                  for i, (r, ref) in enumerate(zip(results, reference)) if r.token_ids != ref]
    t0 = kill["ns"]

    def find(st):
        rec = next((r for r in st["recoveries"] if r.get("fenced_epoch") == kill["epoch"]), None)
        exit_ev = next((e for e in st["events"] if e["kind"] == "exit" and e["pid"] == kill["pid"]), None)
        return (rec, exit_ev, st) if rec and exit_ev and "first_token_ns" in rec else None

    rec, exit_ev, st = sc.wait_for(find, timeout=600)
    fence = next(e for e in st["events"] if e["kind"] == "fence" and e["pid"] == kill["pid"])
    promote = next(e for e in st["events"] if e["kind"] == "promote" and e["ns"] >= fence["fenced_ns"])
    ms = lambda ns: (ns - t0) / 1e6  # noqa: E731
    return {
        "killed_pid": kill["pid"], "streamed_before_kill": threshold,
        "detect_ms": ms(fence["detect_ns"]), "fenced_ms": ms(fence["fenced_ns"]),
        "promoted_ms": ms(promote["ns"]), "takeover_start_ms": ms(rec["promoted_ns"]),
        "validated_ms": ms(rec["validated_ns"]), "resumed_ms": ms(rec["resumed_ns"]),
        "first_token_ms": ms(rec["first_token_ns"]), "exit_confirmed_ms": ms(exit_ev["ns"]),
        **{f"{k[:-3]}_ms": ms(rec[k]) for k in ("cleared_ns", "tails_ns", "step_start_ns",
                                                 "forward_queued_ns", "sampled_ns", "committed_ns",
                                                 "step_received_ns") if k in rec},
        "kv_mode": rec.get("kv_mode", "native"),
        "host_marks_ms": host_marks(sc.log_path, promote["pid"]),
        "pages_checked": rec["pages_checked"], "pages_bad": rec["pages_bad"],
        "pages_copied": rec["pages_copied"], "pages_quarantined": rec.get("pages_quarantined", 0),
        "tails_dropped": rec.get("tails_dropped", 0), "requests_finished": rec.get("requests_finished", 0),
        "fences": [{"pid": e["pid"], "reason": e.get("reason")} for e in st["events"]
                   if e["kind"] == "fence" and e["ns"] >= started_ns],   # this run's: a hang shows here
        "tokens_recomputed": rec["tokens_recomputed"],
        "tokens_kept": rec["tokens_kept"], "requests_resumable": rec["requests_resumable"],
        "requests_damaged": rec["requests_damaged"], "requests_lost": rec["requests_lost"],
        "requests_failed": sum(1 for r in results if r.finish_reason not in ("length", "stop")),
        "outputs_identical": all(identical), "requests": len(results), "mismatches": mismatches,
    }


def host_marks(log_path: Path | None, pid: int) -> dict[str, float] | None:
    """The last "takeover host marks" line the executor `pid` logged (at INFO: --log-level INFO),
    as {mark: ms from its takeover's start}, or None."""
    if log_path is None or not log_path.exists():
        return None
    prefix, found = f"pid={pid} ", None
    for line in log_path.read_text(errors="replace").splitlines():
        if prefix in line and "takeover host marks (ms from its start): " in line:
            found = line.split("takeover host marks (ms from its start): ", 1)[1]
    if found is None:
        return None
    return {label: float(ms) for label, ms in (part.rsplit(" ", 1) for part in found.split(", "))}


def summarize(samples: list[dict]) -> dict:
    out = {}
    for part in PARTS:
        v = np.array([s[f"{part}_ms"] for s in samples])
        out[part] = {"p50_ms": float(np.percentile(v, 50)), "p99_ms": float(np.percentile(v, 99)),
                     "max_ms": float(v.max())}
    out["tokens_recomputed_per_kill"] = {"mean": float(np.mean([s["tokens_recomputed"] for s in samples])),
                                         "max": int(max(s["tokens_recomputed"] for s in samples))}
    out["kills"] = len(samples)
    out["requests_failed"] = int(sum(s["requests_failed"] for s in samples))
    for key in ("requests_lost", "requests_damaged", "pages_bad"):
        out[key] = int(sum(s[key] for s in samples))
    marked = [s["host_marks_ms"] for s in samples if s.get("host_marks_ms")]
    if marked:     # median of each takeover host mark over the kills that logged it
        labels = dict.fromkeys(label for m in marked for label in m)
        out["host_marks_p50_ms"] = {label: float(np.percentile([m[label] for m in marked if label in m], 50))
                                    for label in labels}
    out["kv_modes"] = sorted({s["kv_mode"] for s in samples})      # what the executors reported
    out["all_outputs_identical"] = all(s["outputs_identical"] for s in samples)
    return out


def gpu_memory(status: dict) -> dict | None:
    """What each process of the sidecar holds on its GPU, from NVML (None without one): the
    device's used and total MiB, and per process its role (the sidecar, or an executor's role)
    and the MiB NVML charges it. The sidecar allocates the weights and the KV pool and exports
    them; executors map them, so NVML may charge a mapping to the importer, the owner or neither:
    the device's total used, against the weights and pool, says what is held once."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:                   # no NVML (CPU runs)
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        roles = {status["pid"]: "sidecar"} | {e["pid"]: e["role"] for e in status["executors"]}
        procs = [{"pid": p.pid, "role": roles.get(p.pid, "other"),
                  "used_mib": round((p.usedGpuMemory or 0) / 2**20, 1)}
                 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
        return {"device_used_mib": round(info.used / 2**20, 1), "device_total_mib": round(info.total / 2**20, 1),
                "processes": sorted(procs, key=lambda p: p["role"])}
    finally:
        pynvml.nvmlShutdown()


def run_tier(args, tier: str, model: Path, requests, kills: int, save=None) -> dict:
    """`save(samples)` after each kill keeps what was measured if the run is cut short."""
    if tier not in TIERS:
        raise SystemExit(f"unknown tier {tier!r}; choose from {', '.join(TIERS)}")
    standbys = 1 if tier.startswith("standby") else 0
    flags = ["--model", str(model), "--device", args.device, "--standbys", str(standbys),
             "--max-seq-len", str(args.max_seq_len), "--max-batch", str(max(64, args.requests)),
             "--max-batch-tokens", str(args.max_batch_tokens), "--log-level", args.log_level, "--restart-backoff-ms", "0,0",
             "--startup-lease-ms", "600000", "--kv-mode", args.kv_mode]
    if tier == "standby-wait":
        flags += ["--takeover", "wait-exit"]
    if tier == "zygote":
        flags += ["--zygote"]
    elif tier == "cold":
        flags += ["--no-zygote"]     # on CPU the zygote is on by default
    if args.device.startswith("cuda"):
        flags += ["--backend", "cuda"]
    if args.kv_memory:
        flags += ["--kv-memory", args.kv_memory]
    if args.kv_pages:
        flags += ["--kv-pages", str(args.kv_pages)]
    if args.no_prefix_caching:
        flags += ["--no-enable-prefix-caching"]
    for name in ("page_tokens", "prefill_chunk", "lease_ms"):
        if getattr(args, name):
            flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    rng = random.Random(args.seed)
    log_path = args.out.with_suffix(f".{tier}.log")
    log_path.unlink(missing_ok=True)          # one run per log: SidecarProcess appends
    with SidecarProcess(flags, log_path=log_path) as sc:
        sc.wait_steady(standbys=standbys, timeout=1200)
        memory = gpu_memory(sc.status()) if args.device.startswith("cuda") else None
        with sc.new_client(timeout=600) as client:
            t0, t0_ns = time.monotonic(), time.monotonic_ns()
            reference = [r.token_ids for r in run_set(client, requests)]
            ref_s = time.monotonic() - t0
            # a reference that went through a takeover (e.g. a hang fence) is worth knowing
            ref_fences = [{"pid": e["pid"], "reason": e.get("reason")} for e in sc.status()["events"]
                          if e["kind"] == "fence" and e["ns"] >= t0_ns]
            samples = []
            for i in range(kills):
                samples.append(one_kill(sc, client, requests, reference, rng, standbys, tier == "zygote"))
                if save is not None:
                    save(samples)
                s = samples[-1]
                print(f"{tier} kill {i + 1}/{kills}: first token {s['first_token_ms']:8.1f} ms "
                      f"(resumed {s['resumed_ms']:.1f}), recomputed {s['tokens_recomputed']}, "
                      f"identical {s['outputs_identical']}", file=sys.stderr, flush=True)
        executors = sc.status()["executors"]
    return {"reference_run_s": ref_s, "reference_fences": ref_fences, "summary": summarize(samples),
            "samples": samples, "gpu_memory_before_kills": memory,
            "executors_at_end": executors}


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    tiers = list(results["tiers"])
    fig, axes = plt.subplots(len(tiers), 1, figsize=(10, 3 + 2.5 * len(tiers)), squeeze=False)
    for ax, tier in zip(axes[:, 0], tiers):
        samples = results["tiers"][tier]["samples"]
        for i, s in enumerate(samples):
            prev = 0.0
            for part, color in zip(PARTS[:7], ("C0", "C1", "C2", "C3", "C4", "C5", "C6")):
                v = s[f"{part}_ms"]
                ax.barh(i, max(v - prev, 0), left=prev, color=color, label=part if i == 0 else None)
                prev = max(prev, v)
        ax.set_title(f"{tier}: kill -> first resumed token, per kill (ms from SIGKILL)")
        ax.set_xlabel("ms after SIGKILL")
        ax.set_ylabel("kill #")
        ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: the tiny demo model)")
    p.add_argument("--kills", type=int, default=50)
    p.add_argument("--tiers", default="standby", help=f"comma list of {','.join(TIERS)}")
    p.add_argument("--cold-kills", type=int, default=0, help="kills for the cold tier (default: --kills)")
    p.add_argument("--zygote-kills", type=int, default=0, help="kills for the zygote tier (default: --kills)")
    p.add_argument("--wait-kills", type=int, default=0, help="kills for the standby-wait tier (default: --kills)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", default="32,128", help="min,max prompt tokens")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--kv-memory", default=None)
    p.add_argument("--kv-pages", type=int, default=None, help="KV pool size in pages (pressure: preemption)")
    p.add_argument("--page-tokens", type=int, default=None, help="the sidecar's --page-tokens")
    p.add_argument("--prefill-chunk", type=int, default=None, help="the sidecar's --prefill-chunk")
    p.add_argument("--lease-ms", type=int, default=None,
                   help="the sidecar's heartbeat lease (short: slow steps get fenced for a hang)")
    p.add_argument("--log-level", default="WARNING", help="the sidecar's and executors' log level (log per tier)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="run the sidecar with --no-enable-prefix-caching (the cache is on by default: "
                        "the benchmark's runs repeat their prompts, so every run after the first hits it)")
    p.add_argument("--kv-mode", default="native", choices=("native", "foreign"),
                   help="the sidecar's --kv-mode: foreign recovers through the KV mirror")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.out = args.out or Path(f"bench/results/recovery_{args.device.split(':')[0]}.json")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        from kvhold.testing.make_model import ensure_demo_model
        args.model = ensure_demo_model()[0]
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    requests = make_requests(args.requests, (lo, hi), args.max_tokens, vocab, args.seed)
    results = {"command": " ".join(["python", "-m", "tools.bench_recovery", *(argv or sys.argv[1:])]),
               "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "host": platform.node()},
               "model": str(args.model), "requests": args.requests, "max_tokens": args.max_tokens,
               "prompt_len": [lo, hi], "kv_mode": args.kv_mode, "tiers": {}}
    for tier in args.tiers.split(","):
        kills = {"cold": args.cold_kills, "zygote": args.zygote_kills,
                 "standby-wait": args.wait_kills}.get(tier) or args.kills

        def save(samples, tier=tier):
            results["tiers"][tier] = {"partial": True, "summary": summarize(samples), "samples": samples}
            args.out.write_text(json.dumps(results, indent=1) + "\n")

        results["tiers"][tier] = run_tier(args, tier, args.model, requests, kills, save)
        args.out.write_text(json.dumps(results, indent=1) + "\n")   # after each tier: keep what we have
    png = args.out.with_suffix(".png")
    plotted = plot(results, png)
    for tier, r in results["tiers"].items():
        s = r["summary"]
        print(f"[{tier}, kv mode {args.kv_mode}] {s['kills']} kills, all outputs identical: "
              f"{s['all_outputs_identical']}, requests failed: {s['requests_failed']}")
        for part in PARTS:
            print(f"  kill -> {part:15s} P50 {s[part]['p50_ms']:9.2f} ms   P99 {s[part]['p99_ms']:9.2f} ms")
        print(f"  tokens recomputed per kill: mean {s['tokens_recomputed_per_kill']['mean']:.1f}, "
              f"max {s['tokens_recomputed_per_kill']['max']}; requests lost {s['requests_lost']}, "
              f"damaged {s['requests_damaged']}; executors' kv mode {s['kv_modes']}")
    print(f"wrote {args.out}" + (f" and {png}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
