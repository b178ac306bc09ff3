"""Benchmark: a takeover's host parts in one process, at a serving load's shapes.

    python -m tools.bench_takeover --requests 64 --prompt-len 512,2048 --kv-pages 12288 --trials 9
    python -m tools.bench_takeover --device cuda --model DIR --requests 64 --prompt-len 512,2048

An engine (bench_engine_setup: private tables and KV pool; by default the tiny demo model on
the CPU) prefills the requests and decodes a few tokens; that state (tables segment and KV
pool) is saved and, for each trial, put back: the engine's lease is fenced and a second engine
takes over with the first's exit unconfirmed (tails copied, as after a SIGKILL). The journal,
page table and free list have the serving load's shapes (64 streams of 512-2048 prompt tokens
in 16-token pages: ~5,700 listed pages, a 12,288-page pool as 24 GiB of Llama-3-8B KV); only
the bytes per page are the small model's, so the KV work (checksums of the listed pages, tail
copies) is timed apart from the bookkeeping: the checksum and the copies are timed where they
are called, and each part's host time is its time less that. With `--checksum replay` (the
default) each distinct checksum pass is computed once (its time in `checksum_computed_ms`) and
replayed in the trials, as every trial starts from the same state: a CPU checksum of thousands of
pages takes seconds and disturbs the timing of what follows it. `--state FILE` keeps the state
before the kill, so that runs of different code start from the same one.

Per trial, from the RecoveryReport's marks: validate (pages checked and classified), clear
(unkept pages released or quarantined, free list built), tails (partial pages placed and
published), resume (each request attached and scheduled); `host_validated_to_resumed` is
clear + tails + resume less their KV work, the part between the "validated" and "resumed" marks
of a recovery record. With the prefix cache, `cache_after_ms` is what entering the resumed
sequences' newly full pages into the cache costs right after the takeover (the engine does it
at the start of a step, and leaves it from a takeover's first step to the next one): not part
of the takeover's parts. `--profile N` runs N more takeovers under cProfile and prints the top
functions. Writes JSON (default bench/results/takeover_host_<device>.json).

`--prefix-caching` gives both engines a prefix cache (kvhold.executor.prefix_cache), as the
engine workload has by default. `--repeat-prompts` makes the state that of tools/bench_recovery,
which sends the same prompts again for each kill: the prompts first run to completion
(`--first-tokens` each; with the cache, their full pages stay in it, idle), then are admitted
again (with the cache, each starts on its prompt's cached pages, shared with none but listed as
its own first pages), prefill the rest and decode `--decode` tokens before the kill. Without
the cache the second round recomputes every prompt: the baseline of `--no-prefix-caching`.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvhold.executor.engine import Engine
from kvhold.protocol.layout import PageFlag
from kvhold.protocol.leases import Lease, LeaseTable, now_ns
from kvhold.protocol.page_table import PageTable
from tools.bench_engine_setup import admit, build_engine, load_weights
from tools.bench_recovery import make_requests

PARTS = ("validate", "clear", "tails", "resume")


class _Timed:
    """Wraps an object; calls to the named methods are recorded as (start, end) in now_ns time."""

    def __init__(self, inner, names, sync):
        self._inner, self.calls, self._sync = inner, [], sync
        for name in names:
            setattr(self, name, self._wrap(getattr(inner, name)))

    def _wrap(self, fn):
        def timed(*a, **kw):
            t = now_ns()
            out = fn(*a, **kw)
            self._sync()
            self.calls.append((t, now_ns()))
            return out
        return timed

    def within(self, start: int, end: int) -> int:
        """ns spent in calls that began in [start, end)."""
        return sum(b - a for a, b in self.calls if start <= a < end)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _Replayed:
    """A checksum whose results for the same (pages, counts) are computed once, then replayed:
    every trial starts from the same saved state, so the sums are the same, and the host parts
    are then timed without the KV work (a CPU checksum of thousands of pages takes seconds and
    disturbs what follows it; its own time is reported from the first computation)."""

    def __init__(self, inner):
        self._inner, self._memo, self.computed_ns = inner, {}, []

    def pages(self, idx, counts):
        key = (idx.cpu().numpy().tobytes(), counts.cpu().numpy().tobytes())
        if key not in self._memo:
            t = now_ns()
            self._memo[key] = self._inner.pages(idx, counts)
            self.computed_ns.append((len(idx), now_ns() - t))
        return self._memo[key].clone()

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: the tiny demo model)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", default="512,2048", help="min,max prompt tokens")
    p.add_argument("--decode", type=int, default=4, help="tokens each request decodes before the kill")
    p.add_argument("--kv-pages", type=int, default=12288, help="pool size (24 GiB of Llama-3-8B KV)")
    p.add_argument("--max-batch-tokens", type=int, default=4096)
    p.add_argument("--trials", type=int, default=9)
    p.add_argument("--read-ahead", choices=("none", "current"), default="current",
                   help="the tokens a hot standby reads ahead while it idles (JournalTokens): 'current' "
                        "reads them at the state of the kill (a standby whose last read came just "
                        "before it; a real one's is up to a heartbeat older), 'none' reads none, as a "
                        "standby that never idled (default current)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="N more takeovers under cProfile")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix-caching", action="store_true",
                   help="the engines have a prefix cache (the engine workload's default)")
    p.add_argument("--repeat-prompts", action="store_true",
                   help="the prompts run to completion once, then are admitted again and decode "
                        "--decode tokens before the kill (tools/bench_recovery's state: with the cache, "
                        "their prompt pages are cache hits)")
    p.add_argument("--first-tokens", type=int, default=64,
                   help="with --repeat-prompts, tokens each request generates in the first round")
    p.add_argument("--checksum", choices=("replay", "compute"), default="replay",
                   help="replay: each distinct checksum pass is computed once and replayed in later "
                        "trials (the host parts timed without it); compute: every trial computes it")
    p.add_argument("--state", type=Path, default=None,
                   help="npz file of the state before the kill: loaded if it exists, else saved there")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.out = args.out or Path(f"bench/results/takeover_host_{args.device.split(':')[0]}.json")
    if args.trials < 1 or args.requests < 1 or args.profile < 0:
        raise SystemExit("--trials and --requests must be at least 1, --profile at least 0")
    if args.model is None:
        from kvhold.testing.make_model import ensure_demo_model
        args.model = ensure_demo_model()[0]
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    # requests admitted first decode while later ones prefill: none may finish before the last has
    # decoded `--decode` tokens (the loop below stops then)
    max_seq = hi + 512
    requests = make_requests(args.requests, (lo, hi), max_seq - hi - 1, vocab, args.seed)
    sync = (lambda: torch.cuda.synchronize()) if args.device.startswith("cuda") else (lambda: None)
    weights = load_weights(args.model, args.device)
    chunk = min(512, args.max_batch_tokens - max(64, args.requests))
    salt = f"bench-takeover:{args.model.name}".encode() if args.prefix_caching else None
    dead, tables = build_engine(args.model, args.device, args.kv_pages, max_seq, max(64, args.requests),
                                args.max_batch_tokens, chunk, weights=weights, prefix_salt=salt)
    setup = np.array([args.requests, lo, hi, args.seed, args.decode, args.prefix_caching, args.repeat_prompts,
                      args.first_tokens if args.repeat_prompts else 0, args.kv_pages], dtype=np.int64)
    raw = np.frombuffer(tables._buf, dtype=np.uint8)
    if args.state is not None and args.state.exists():
        state = np.load(args.state)
        if "setup" not in state or not np.array_equal(state["setup"], setup):
            raise SystemExit(f"--state {args.state}: saved by a run with other options")
        raw[:] = state["tables"]
        dead.kv.pool.copy_(torch.from_numpy(state["kv"]).to(dead.kv.pool.device))
        prefill_s = float(state["prefill_s"])
    else:
        t0 = time.monotonic()
        if args.repeat_prompts:     # a first round to completion; the frontend frees the slots
            slots: list[int] = []
            admit(tables, [{**r, "max_tokens": args.first_tokens} for r in requests], slots)
            while dead.has_work:
                dead.step()
            dead.flush()
            journal = dead.journal
            for slot in slots:
                journal.release(slot)
        admit(tables, requests)
        while len(dead.seqs) < args.requests or not all(s.num_generated >= args.decode for s in dead.seqs.values()):
            dead.step()
        prefill_s = time.monotonic() - t0
        sync()
        if args.state is not None:
            np.savez(args.state, tables=raw, kv=dead.kv.pool.cpu().numpy(), prefill_s=prefill_s, setup=setup)
    listed = int(tables.requests["num_pages"].sum())
    cached = (tables.pages["flags"] & PageFlag.CACHED) != 0
    cached_pages = int(cached.sum())
    cached_listed = len(np.intersect1d(np.flatnonzero(cached), PageTable(tables).listed_pages()))
    if listed > args.kv_pages * 0.9:
        raise SystemExit(f"--kv-pages {args.kv_pages}: the requests hold {listed} pages; give more")
    saved_tables, saved_kv = raw.copy(), dead.kv.pool.clone()
    leases = LeaseTable(tables)
    kv_copy_names = [n for n in ("copy_tokens", "copy_pages") if hasattr(dead.kv, n)]
    replayed = _Replayed(dead.checksum) if args.checksum == "replay" else None

    def one_takeover(profiler=None):
        raw[:] = saved_tables
        dead.kv.pool.copy_(saved_kv)
        epoch = leases.fence(0)
        lease = Lease(tables, 1, leases.grant(1, os.getpid()))
        survivor = Engine(dead.model, dead.kv, tables, lease, dead.scheduler.max_batch,
                          dead.scheduler.max_batch_tokens, runner=dead.runner,
                          checksum=replayed or dead.checksum, prefill_chunk=chunk, prefix_salt=salt)
        if args.read_ahead == "current":
            survivor.tokens_ahead.refresh()
        survivor.checksum = checksum = _Timed(survivor.checksum, ("pages",), sync)
        survivor.kv = kv = _Timed(dead.kv, kv_copy_names, sync)
        sync()
        if profiler is not None:
            profiler.enable()
        report = survivor.take_over([epoch], 0).to_dict()
        if profiler is not None:
            profiler.disable()
        if survivor.blocks.prefix is not None:
            t0 = time.perf_counter_ns()
            survivor._cache_published_pages()
            report["cache_after_ns"] = time.perf_counter_ns() - t0
        return report, (checksum, kv)

    marks = ("promoted_ns", "validated_ns", "cleared_ns", "tails_ns", "resumed_ns")
    samples = []
    one_takeover()      # computes the checksums to replay; not counted
    for _ in range(args.trials):
        report, timed = one_takeover()
        row = {}
        for part, start, end in zip(PARTS, marks, marks[1:]):
            total = report[end] - report[start]
            kv_work = sum(t.within(report[start], report[end]) for t in timed)
            row[f"{part}_ms"] = round(total / 1e6, 4)
            row[f"{part}_kv_ms"] = round(kv_work / 1e6, 4)
            row[f"{part}_host_ms"] = round((total - kv_work) / 1e6, 4)
        row["host_validated_to_resumed_ms"] = round(sum(row[f"{p}_host_ms"] for p in PARTS[1:]), 4)
        if "cache_after_ns" in report:
            row["cache_after_ms"] = round(report["cache_after_ns"] / 1e6, 4)
        row.update({k: report[k] for k in ("pages_checked", "pages_copied", "pages_quarantined",
                                           "requests_resumable", "requests_damaged", "requests_lost")})
        samples.append(row)
    keys = [f"{part}_{kind}ms" for part in PARTS for kind in ("", "kv_", "host_")] + ["host_validated_to_resumed_ms"]
    keys += ["cache_after_ms"] if "cache_after_ms" in samples[-1] else []
    summary = {k: {"p50": round(float(np.median([s[k] for s in samples])), 4),
                   "min": round(float(min(s[k] for s in samples)), 4),
                   "max": round(float(max(s[k] for s in samples)), 4)} for k in keys}
    last = samples[-1]
    print(f"{args.requests} streams, {last['pages_checked']} pages checked, {args.kv_pages}-page pool, "
          f"{last['pages_copied']} tails copied, {last['pages_quarantined']} quarantined; "
          f"prefix cache {'on' if args.prefix_caching else 'off'}, prompts {'repeated' if args.repeat_prompts else 'once'}"
          f" ({cached_pages} pages cached, {cached_listed} listed by a request); "
          f"prefill {prefill_s:.1f} s; {args.trials} trials (ms: P50 min max)")
    for k in keys:
        print(f"  {k:30s} {summary[k]['p50']:8.3f} {summary[k]['min']:8.3f} {summary[k]['max']:8.3f}")
    profile_text = None
    if args.profile:
        prof = cProfile.Profile()
        for _ in range(args.profile):
            one_takeover(prof)
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(os.environ.get("BENCH_SORT", "tottime")).print_stats(30)
        profile_text = buf.getvalue()
        print(profile_text)
    results = {"command": " ".join(["python", "-m", "tools.bench_takeover", *(argv if argv is not None else sys.argv[1:])]),
               "git": _git_rev(),
               "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "numpy": np.__version__, "torch": torch.__version__,
                           "torch_threads": torch.get_num_threads()},
               "device": args.device, "model": str(args.model), "requests": args.requests,
               "prompt_len": [lo, hi], "kv_pages": args.kv_pages, "page_tokens": 16,
               "prefix_caching": args.prefix_caching, "repeat_prompts": args.repeat_prompts,
               "first_tokens": args.first_tokens if args.repeat_prompts else None,
               "pages_cached": cached_pages, "cached_pages_listed": cached_listed,
               "prefill_s": round(prefill_s, 2), "checksum": args.checksum,
               "checksum_computed_ms": [{"pages": n, "ms": round(ns / 1e6, 3)} for n, ns in replayed.computed_ns]
               if replayed else None, "summary_ms": summary, "samples": samples}
    if profile_text is not None:
        results["profile_top"] = profile_text.splitlines()[:45]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    tables.unlink()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
