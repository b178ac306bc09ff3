"""Benchmark: the prefix cache against no cache, on one workload of shared prompts.

    python -m tools.bench_prefix_cache                        # CPU, the tiny demo model
    python -m tools.bench_prefix_cache --device cuda:0 --model DIR --streams 64 --prefix-tokens 2048 \\
        --suffix-tokens 64,256 --max-seq-len 4096 --kv-memory 24GiB

A workload like chat or agent traffic: every conversation starts with one long shared system
prompt followed by its own user turn (`--suffix-tokens`, random lengths); a second turn
extends each conversation by its first answer and a new user turn (`--follow-up-tokens`).
One request with the system prompt alone runs first (a service's system prompt is hot in
its cache); then the `--streams` first turns are sent at once, and when they have all
finished, the `--streams` second turns. Then the second turns run again while the active
executor is SIGKILLed once every one of them has streamed a quarter of its tokens (all are
decoding then, with the cache or without), `--kills` times.

The same workload runs on a real sidecar with `--enable-prefix-caching` and on one with
`--no-enable-prefix-caching`, one after the other. Per request: time to first token (the
client's, from its submission to its first token), `cached_tokens` and the tokens. Figures:
the hit rate (prompt tokens served from the cache / prompt tokens, of the measured turns,
and the frontend's own counters), TTFT P50 / P99 and the speedup (off / on), throughput
(generated tokens / the turns' wall time), kill -> first resumed token (the sidecar's
recovery record, CLOCK_MONOTONIC from the SIGKILL; P50 over the kills), requests lost, and whether every output
is identical: cache on against off, and each kill run against its uninterrupted run.
Writes JSON under bench/results/ (prefix_cache_<device>.json).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvhold.client.client import wait_all
from kvhold.testing.sidecar_process import SidecarProcess

GOALS = {"cpu": {"hit_rate": 0.9, "ttft_p50_speedup": 1.5}, "cuda": {"hit_rate": 0.9, "ttft_p50_speedup": 3.0}}


def make_workload(args, vocab: int) -> dict:
    rng = random.Random(args.seed)
    lo, hi = (int(x) for x in args.suffix_tokens.split(","))
    system = [rng.randrange(3, vocab) for _ in range(args.prefix_tokens)]
    convs = []
    for i in range(args.streams):
        sampling = rng.choice([dict(temperature=0.0), dict(temperature=0.8, seed=i),
                               dict(temperature=1.0, top_p=0.9, seed=i)])
        convs.append(dict(user=[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))],
                          follow_up=[rng.randrange(3, vocab) for _ in range(args.follow_up_tokens)],
                          sampling=sampling))
    return {"system": system, "conversations": convs}


def request(prompt_ids: list[int], max_tokens: int, sampling: dict) -> dict:
    return dict(prompt_ids=prompt_ids, max_tokens=max_tokens, ignore_eos=True, **sampling)


def run_wave(client, requests: list[dict], on_token=None) -> tuple[list[dict], float]:
    """Send every request at once; each one's TTFT (client side: its submission to the
    receipt of its first token), result, and the wave's wall time."""
    submitted, first, streams = [], {}, []
    t0 = time.monotonic()
    for r in requests:
        submitted.append(time.monotonic())
        streams.append(client.generate(**r))
    index = {s.request_id: i for i, s in enumerate(streams)}

    def on_event(stream, event):
        i = index[stream.request_id]
        first.setdefault(i, time.monotonic())
        if on_token is not None:
            on_token(i, event)

    results = wait_all(streams, on_event)
    wall = time.monotonic() - t0
    return [{"ttft_s": first[i] - submitted[i] if i in first else None, "tokens": list(r.token_ids),
             "finish_reason": r.finish_reason, "prompt_tokens": r.prompt_tokens,
             "cached_tokens": r.cached_tokens, "recomputed_tokens": r.recomputed_tokens}
            for i, r in enumerate(results)], wall


def run_mode(args, workload: dict, caching: bool, log_dir: Path) -> dict:
    flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    argv = ["--model", str(args.model), "--device", args.device, "--max-seq-len", str(args.max_seq_len),
            "--max-batch-tokens", str(args.max_batch_tokens), "--max-batch", str(args.max_batch),
            "--log-level", "WARNING", flag]
    if args.device.startswith("cuda"):
        argv += ["--backend", "cuda"]
    if args.kv_memory:
        argv += ["--kv-memory", args.kv_memory]
    if args.kv_pages:
        argv += ["--kv-pages", str(args.kv_pages)]
    system, convs = workload["system"], workload["conversations"]
    mode = "on" if caching else "off"
    with SidecarProcess(argv, log_path=log_dir / f"prefix_cache_{mode}.log") as sc:
        sc.wait_steady(timeout=900)
        with sc.new_client(timeout=600) as client:
            warm, _ = run_wave(client, [request(system, 1, dict(temperature=0.0))])
            first, first_s = run_wave(client, [request(system + c["user"], args.max_tokens, c["sampling"])
                                               for c in convs])
            seconds = [request(system + c["user"] + f["tokens"] + c["follow_up"], args.max_tokens, c["sampling"])
                       for c, f in zip(convs, first)]
            second, second_s = run_wave(client, seconds)
            kills = [kill_run(sc, client, seconds, second) for _ in range(args.kills)]
            status = sc.status()
    return {"warm_up": warm, "first_turns": first, "first_turns_s": first_s, "second_turns": second,
            "second_turns_s": second_s, "kills": kills, "frontend_prefix_cache": status.get("prefix_cache"),
            "pages_at_end": status.get("pages")}


def kill_run(sc: SidecarProcess, client, requests: list[dict], reference: list[dict]) -> dict:
    """The second turns again; the active executor SIGKILLed once every one of them has streamed a
    quarter of its tokens to the client (all of them decoding then, with caching or without, so
    that both modes recover the same requests)."""
    sc.wait_steady(standbys=1, timeout=600)
    quarter = max(1, min(len(r["tokens"]) for r in reference) // 4)
    kill: dict = {}
    counts = [0] * len(requests)
    behind = [len(requests)]

    def on_token(i, event):
        counts[i] += 1
        if counts[i] == quarter:
            behind[0] -= 1
            if behind[0] == 0:
                victim = sc.wait_steady(standbys=0)
                kill.update(pid=victim["pid"], epoch=victim["epoch"], ns=time.monotonic_ns())
                os.kill(victim["pid"], signal.SIGKILL)

    results, wall = run_wave(client, requests, on_token)

    def find(st):
        return next((r for r in st["recoveries"] if r.get("fenced_epoch") == kill.get("epoch")
                     and "first_token_ns" in r), None)

    rec = sc.wait_for(find, timeout=600)
    ms = lambda ns: (ns - kill["ns"]) / 1e6  # noqa: E731
    return {"results": results, "wall_s": wall, "kill_after_tokens_each": quarter,
            "first_token_ms": ms(rec["first_token_ns"]),
            **{f"{k[:-3]}_ms": ms(rec[k]) for k in ("detect_ns", "promoted_ns", "validated_ns", "cleared_ns",
                                                     "tails_ns", "resumed_ns", "step_start_ns", "committed_ns")
               if rec.get(k)},
            "pages_checked": rec["pages_checked"], "pages_bad": rec["pages_bad"],
            "tokens_recomputed": rec["tokens_recomputed"], "requests_resumable": rec["requests_resumable"],
            "requests_damaged": rec["requests_damaged"], "requests_lost": rec["requests_lost"],
            "identical": [r["tokens"] for r in results] == [r["tokens"] for r in reference]}


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else None


def mode_figures(run: dict) -> dict:
    turns = run["first_turns"] + run["second_turns"]
    ttft = [r["ttft_s"] * 1e3 for r in turns if r["ttft_s"] is not None]
    prompt = sum(r["prompt_tokens"] for r in turns)
    cached = sum(r["cached_tokens"] for r in turns)
    generated = sum(len(r["tokens"]) for r in turns)
    wall = run["first_turns_s"] + run["second_turns_s"]
    return {"ttft_ms": {"p50": pct(ttft, 50), "p99": pct(ttft, 99), "mean": float(np.mean(ttft))},
            "ttft_ms_first_turns_p50": pct([r["ttft_s"] * 1e3 for r in run["first_turns"]], 50),
            "ttft_ms_second_turns_p50": pct([r["ttft_s"] * 1e3 for r in run["second_turns"]], 50),
            "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else None,
            "generated_tokens": generated, "wall_s": wall, "tokens_per_s": generated / wall,
            "kill_first_token_ms": {"p50": pct([k["first_token_ms"] for k in run["kills"]], 50),
                                    "max": max(k["first_token_ms"] for k in run["kills"])},
            "kill_validated_ms_p50": pct([k["validated_ms"] for k in run["kills"]], 50),
            "kill_pages_checked": [k["pages_checked"] for k in run["kills"]],
            "kill_requests_resumed": [k["requests_resumable"] + k["requests_damaged"] for k in run["kills"]],
            "kill_tokens_recomputed": sum(k["tokens_recomputed"] for k in run["kills"])}


def lost(run: dict) -> int:
    every = run["first_turns"] + run["second_turns"] + [r for k in run["kills"] for r in k["results"]]
    return (sum(1 for r in every if r["finish_reason"] not in ("length", "stop"))
            + sum(k["requests_lost"] for k in run["kills"]))


def summarize(args, runs: dict) -> dict:
    on, off = mode_figures(runs["on"]), mode_figures(runs["off"])
    same = all([r["tokens"] for r in runs["on"][k]] == [r["tokens"] for r in runs["off"][k]]
               for k in ("first_turns", "second_turns"))
    goals = GOALS["cuda" if args.device.startswith("cuda") else "cpu"]
    summary = {
        "hit_rate": on["hit_rate"], "frontend_hit_rate": (runs["on"]["frontend_prefix_cache"] or {}).get("hit_rate"),
        "ttft_p50_speedup": off["ttft_ms"]["p50"] / on["ttft_ms"]["p50"],
        "throughput_ratio": on["tokens_per_s"] / off["tokens_per_s"],
        "requests_lost": lost(runs["on"]) + lost(runs["off"]),
        "all_identical": same and all(k["identical"] for m in ("on", "off") for k in runs[m]["kills"]),
        "kill_first_token_ms_p50": {"on": on["kill_first_token_ms"]["p50"], "off": off["kill_first_token_ms"]["p50"]},
        "on": on, "off": off, "goals": goals,
    }
    summary["goals_met"] = {"hit_rate": summary["hit_rate"] >= goals["hit_rate"],
                            "ttft_p50_speedup": summary["ttft_p50_speedup"] >= goals["ttft_p50_speedup"],
                            "throughput_not_lower": summary["throughput_ratio"] >= 1.0,
                            "requests_lost_0": summary["requests_lost"] == 0,
                            "all_identical": summary["all_identical"],
                            "kill_no_slower": on["kill_first_token_ms"]["p50"] <= off["kill_first_token_ms"]["p50"]}
    return summary


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--device", default="cpu", help="cpu, or cuda:N")
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: the tiny demo model)")
    p.add_argument("--streams", type=int, default=16, help="conversations, each sent at once per turn")
    p.add_argument("--prefix-tokens", type=int, default=512, help="the shared system prompt's length")
    p.add_argument("--suffix-tokens", default="32,128", help="min,max tokens of each first user turn")
    p.add_argument("--follow-up-tokens", type=int, default=32, help="tokens of each second user turn")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per turn")
    p.add_argument("--kills", type=int, default=5, help="SIGKILLs of the active executor per mode, each in "
                   "a run of the second turns")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--kv-memory", default=None, help="the sidecar's --kv-memory")
    p.add_argument("--kv-pages", type=int, default=None, help="the sidecar's --kv-pages")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=Path, default=None, help="keep the sidecars' logs here (default: dropped)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = args.device.split(":")[0]
    args.out = args.out or Path(f"bench/results/prefix_cache_{device}.json")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        from kvhold.testing.make_model import ensure_demo_model
        args.model = ensure_demo_model()[0]
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    need = args.prefix_tokens + int(args.suffix_tokens.split(",")[1]) + 2 * args.max_tokens + args.follow_up_tokens
    if need > args.max_seq_len:
        p.error(f"a second turn can reach {need} tokens: raise --max-seq-len (now {args.max_seq_len})")
    workload = make_workload(args, vocab)
    results = {"command": " ".join(["python", "-m", "tools.bench_prefix_cache", *(argv or sys.argv[1:])]),
               "commit": git_commit(),
               "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "host": platform.node()},
               "model": str(args.model), "device": args.device, "streams": args.streams,
               "prefix_tokens": args.prefix_tokens, "suffix_tokens": args.suffix_tokens,
               "follow_up_tokens": args.follow_up_tokens, "max_tokens": args.max_tokens, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="kvhold-bench-prefix-") as tmp:
        for caching in (True, False):
            mode = "on" if caching else "off"
            print(f"prefix caching {mode}: {args.streams} streams, 2 turns, then a kill ...", file=sys.stderr,
                  flush=True)
            results["runs"][mode] = run_mode(args, workload, caching, args.log_dir or Path(tmp))
            args.out.write_text(json.dumps(results) + "\n")        # keep what we have
    results["summary"] = summarize(args, results["runs"])
    args.out.write_text(json.dumps(results) + "\n")
    s = results["summary"]
    print(f"hit rate {s['hit_rate']:.3f} (frontend {s['frontend_hit_rate']}), TTFT P50 on "
          f"{s['on']['ttft_ms']['p50']:.1f} ms, off {s['off']['ttft_ms']['p50']:.1f} ms: speedup "
          f"{s['ttft_p50_speedup']:.2f}x; throughput on/off {s['throughput_ratio']:.2f}; kill -> first token P50 "
          f"on {s['kill_first_token_ms_p50']['on']:.1f} ms, off {s['kill_first_token_ms_p50']['off']:.1f} ms "
          f"({args.kills} kills each); "
          f"lost {s['requests_lost']}, all identical {s['all_identical']}")
    print(f"goals met: {s['goals_met']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
