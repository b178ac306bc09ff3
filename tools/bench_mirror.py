"""Benchmark: what the KV mirror (foreign-pool mode) costs in decode throughput.

    python -m tools.bench_mirror --model DIR --device cuda:0 [--batches 1,8,64]

For each batch size B, three engines on one loaded model, each given the same B requests
(short prompts, long greedy outputs) and run until all of them decode:
  native     the reference engine computing in kvhold's pages, full commit protocol;
  no-commit  the same engine publishing nothing (what the protocols add to);
  foreign    the engine computing in a private pool, protected only by the KV mirror
             (kvhold.executor.foreign_pool): each step's new KV rows are copied into kvhold
             pages, published with count and checksum, then the journal as in native.
The engines take turns, `--rounds` rounds of `--steps` timed decode steps each, so drift
(clocks, growing context) touches all three alike; a step time is the median round.
Afterwards the foreign engine's mirror is checked (every mirrored page equals its engine
block and its published checksum) and the three engines' tokens are compared. Reports
ms/step, tokens/s and the mirror's overhead against native and against no-commit; writes
JSON (with the exact command) under bench/results/.

    python -m tools.bench_mirror --host [--batches 1,8,64]

The mirror's host cost alone, no model: microseconds per decode step of B rows through the
general path (Committed blocks + mirror_committed), the decode fast path (queue_decode +
publish_decode), and publish_decode alone (what stays after the step's read-back when the
runner's `after_forward` hook queues the copy). CPU, rows of 128 bytes, so the copy's bytes
cost nothing and what is left is Python, numpy and torch dispatch.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from kvhold.executor.foreign_pool import foreign_engine_like
from kvhold.executor.kv_cache import KvCache
from kvhold.protocol.checksum import to_u64
from kvhold.protocol.layout import KvGeometry, TableGeometry
from kvhold.protocol.leases import Lease, LeaseTable
from kvhold.protocol.tables import Tables
from tools.bench_engine_setup import admit, build_engine, load_weights
from kvhold.executor.kv_mirror import Committed, KvMirror, PooledBlocks

MODES = ("native", "no-commit", "foreign")
WARM_STEPS = 5
CHECK_CHUNK = 64                 # mirrored pages compared per gather (bounds the temporaries)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(args, weights, batch: int, mode: str):
    """(engine, tables) for one mode; the foreign engine mirrors into a pool of its own."""
    engine, tables = build_engine(args.model, args.device, args.kv_pages, args.max_seq_len, max(64, batch),
                                  8192, 512, commit=mode != "no-commit", weights=weights)
    if mode == "foreign":
        g = engine.kv.geometry
        engine = foreign_engine_like(engine, KvCache.private(g, engine.kv.num_pages, engine.kv.pool.device))
    return engine, tables


def requests(batch: int, args, vocab: int) -> list[dict]:
    n = args.prompt_len
    return [dict(prompt_ids=[3 + (i * 131 + j) % (vocab - 3) for j in range(n)],
                 max_tokens=WARM_STEPS + args.rounds * args.steps + 8) for i in range(batch)]


def until_decoding(engine) -> None:
    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()
    for _ in range(WARM_STEPS):
        engine.step()


def timed(engine, steps: int) -> float:
    """Seconds per step over `steps` decode steps."""
    sync(engine.device)
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine.device)
    return (time.perf_counter() - t) / steps


def tokens(engine) -> list[list[int]]:
    return [s.tokens for _, s in sorted(engine.seqs.items())]


def check_mirror(engine) -> dict:
    """Every page the mirror holds: its committed rows equal the engine block's, and the
    checksum published in the page table is the checksum of those rows."""
    m = engine.mirror
    blocks = {(s.request_id, i): b for s in engine.seqs.values() for i, b in enumerate(s.pages)}
    items = [(page, blocks[rid, index], count) for rid, index, page, count in m.holdings()]
    bytes_ok, sums_ok = True, True
    table = m.page_table.snapshot()
    dev = m.pool.device
    for i in range(0, len(items), CHECK_CHUNK):
        pages, blks, counts = (torch.tensor(c, dtype=torch.long, device=dev) for c in zip(*items[i:i + CHECK_CHUNK]))
        rows = torch.arange(m.page_tokens, device=dev)[None, :] < counts[:, None]       # [N, T]
        mirrored, engine_rows = (x.flatten(4).contiguous().view(torch.uint8)        # bits, not values
                                 for x in (m.pool[pages], m.layout.read(blks).to(dev)))
        differ = (mirrored != engine_rows).any(-1).any(2).any(1)
        bytes_ok &= not bool((differ & rows).any())
        sums = to_u64(m.checksum.pages(pages, counts))
        sums_ok &= bool((sums == table["checksum"][pages.cpu().numpy()]).all())
    return {"pages": len(items), "bytes_match": bytes_ok, "checksums_match": sums_ok}


def measure_batch(args, weights, batch: int, vocab: int) -> list[dict]:
    built = {mode: build(args, weights, batch, mode) for mode in MODES}
    engines = {mode: e for mode, (e, _) in built.items()}
    try:
        reqs = requests(batch, args, vocab)
        for mode, (engine, tables) in built.items():
            admit(tables, reqs)
            until_decoding(engine)
        mirror_pages = engines["foreign"].commits.pages
        published0 = mirror_pages.mirrored_blocks
        rounds: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                rounds[mode].append(timed(engines[mode], args.steps))
        check = check_mirror(engines["foreign"])
        same = tokens(engines["native"]) == tokens(engines["foreign"]) == tokens(engines["no-commit"])
        published = (mirror_pages.mirrored_blocks - published0) / (args.rounds * args.steps)
    finally:
        for _, tables in built.values():
            tables.unlink()
    rows = []
    for mode in MODES:
        dt = statistics.median(rounds[mode])
        rows.append({"batch": batch, "mode": mode, "step_ms": dt * 1e3, "tokens_per_s": batch / dt,
                     "round_step_ms": [r * 1e3 for r in rounds[mode]]})
    native, off, foreign = rows
    foreign["overhead_vs_native_pct"] = 100 * (foreign["step_ms"] / native["step_ms"] - 1)
    foreign["overhead_vs_no_commit_pct"] = 100 * (foreign["step_ms"] / off["step_ms"] - 1)
    native["overhead_vs_no_commit_pct"] = 100 * (native["step_ms"] / off["step_ms"] - 1)
    foreign["pages_published_per_step"] = published
    foreign["mirror_check"] = check
    for r in rows:
        r["tokens_identical"] = same
    return rows


HOST_KV = KvGeometry(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", page_tokens=16)
HOST_PAGES = 4096


def host_step_us(batch: int, path: str, steps: int) -> float:
    """Median over rounds of the host microseconds one decode step of `batch` rows spends in
    the mirror (`path`: general, fast or publish), inputs built as ForeignEngine builds them."""
    geometry = TableGeometry(kv=HOST_KV, num_pages=HOST_PAGES, num_slots=4, max_seq_len=64, num_leases=2)
    tables = Tables.create(f"/kvhold-bench-host-{os.getpid()}-{time.monotonic_ns()}", geometry, 1)
    try:
        lease = Lease(tables, 0, LeaseTable(tables).grant(0, os.getpid()))
        pt = HOST_KV.page_tokens
        engine = torch.randn(HOST_PAGES, HOST_KV.num_layers, 2, pt * HOST_KV.head_dim)
        layout = PooledBlocks(engine, HOST_KV.num_kv_heads, HOST_KV.head_dim, pt)
        rids, hashes = list(range(1, batch + 1)), [(i * 0x9E3779B97F4A7C15) % (1 << 63) for i in range(batch)]
        rounds = []
        for _ in range(3):
            mirror = KvMirror(tables, KvCache.private(HOST_KV, HOST_PAGES, "cpu").pool, layout, lease)
            blocks, total = {}, 0
            for pos in range(min(steps, (HOST_PAGES // batch - 1) * pt)):
                i, row = divmod(pos, pt)
                blocks.update({rid: i * batch + rid - 1 for rid in rids} if not row else {})
                slot_hashes = {blocks[r]: h for r, h in zip(rids, hashes)}      # as the runner returns them
                t = time.perf_counter_ns()
                if path == "general":
                    work = [Committed(r, i, blocks[r], row + 1) for r in rids]
                    mirror.mirror_committed(work, {(blocks[r], row): slot_hashes[blocks[r]] for r in rids})
                else:
                    queued = mirror.queue_decode(rids, [i] * batch, [blocks[r] for r in rids], [row] * batch)
                    if path == "publish":       # the copy was queued by the runner hook, off this path
                        t = time.perf_counter_ns()
                    mirror.publish_decode(queued, [slot_hashes.get(b) for b in queued.blocks.tolist()])
                total += time.perf_counter_ns() - t
            rounds.append(total / (pos + 1) / 1e3)
            tables.pages[:] = 0
        return statistics.median(rounds)
    finally:
        tables.unlink()


def host_main(args) -> int:
    result = {"command": "python -m tools.bench_mirror " + " ".join(args.argv),
              "device": device_name(torch.device("cpu")), "torch": torch.__version__, "steps": args.steps, "rows": []}
    for batch in (int(b) for b in args.batches.split(",")):
        row = {"batch": batch, **{f"{path}_us": host_step_us(batch, path, args.steps)
                                  for path in ("general", "fast", "publish")}}
        result["rows"].append(row)
        print(f"batch {batch:3d}: general {row['general_us']:7.1f} us/step, fast {row['fast_us']:7.1f}, "
              f"publish only {row['publish_us']:7.1f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="checkpoint directory (not with --host)")
    p.add_argument("--host", action="store_true", help="the mirror's host cost per decode step, no model")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the engines take turns each round")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--kv-pages", type=int, default=4096)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON (default bench/results/mirror_cuda.json, with --host mirror_host.json)")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.host:
        args.out = args.out or Path("bench/results/mirror_host.json")
        torch.set_num_threads(1)
        return host_main(args)
    if args.model is None:
        p.error("--model is required (unless --host)")
    args.out = args.out or Path("bench/results/mirror_cuda.json")
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    weights = load_weights(args.model, args.device)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    result = {"command": "python -m tools.bench_mirror " + " ".join(args.argv),
              "device": device_name(device), "torch": torch.__version__,
              "kvhold_fused": os.environ.get("KVHOLD_FUSED"), "steps": args.steps, "rounds": args.rounds,
              "prompt_len": args.prompt_len, "rows": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for batch in (int(b) for b in args.batches.split(",")):
        rows = measure_batch(args, weights, batch, vocab)
        result["rows"] += rows
        native, off, foreign = rows
        print(f"batch {batch:3d}: native {native['step_ms']:7.2f} ms/step ({native['tokens_per_s']:8.1f} tok/s), "
              f"no commit {off['step_ms']:7.2f}, foreign {foreign['step_ms']:7.2f} "
              f"({foreign['tokens_per_s']:8.1f} tok/s): mirror {foreign['overhead_vs_native_pct']:+.1f}% vs native, "
              f"{foreign['overhead_vs_no_commit_pct']:+.1f}% vs no commit; check {foreign['mirror_check']}, "
              f"tokens identical {foreign['tokens_identical']}", flush=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")      # after each batch: keep what we have
        gc.collect()                      # the engines hold reference cycles; free their pools now
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
