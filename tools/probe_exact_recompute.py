"""Probe: recompute after preemption gives the uninterrupted run's tokens (CUDA, bf16).

    python -m tools.probe_exact_recompute --make-bf16 DIR            # the tiny demo model in bf16
    python -m tools.probe_exact_recompute --model DIR --device cuda:0 [--kv-pages 48] [--control]
                                          --out bench/results/exact_preemption_cuda.json

Runs the request set on a real sidecar with a KV pool large enough for every request at
once (the reference, no preemption), then on one with `--kv-pages` pages, so small that
the scheduler preempts running requests and recomputes them (prefill over the prompt and
the tokens they had generated, positions that decode steps computed the first time).
Reports the preemptions the clients were told about, streams lost,
and whether every output equals the reference. `--control` repeats both runs
with `--no-exact-prefill` (prefill on cuBLAS and SDPA), to show what exact prefill buys. Greedy
and seeded-sampling requests alternate. Writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
from pathlib import Path

from kvhold.client.client import wait_all
from kvhold.testing.sidecar_process import SidecarProcess


def make_bf16(dst: Path) -> Path:
    """The tiny demo checkpoint with its tensors in bfloat16 (config torch_dtype too)."""
    import torch
    from safetensors.torch import load_file, save_file

    from kvhold.testing.make_model import ensure_demo_model

    src, _ = ensure_demo_model()
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.suffix == ".safetensors":
            save_file({k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(f)).items()}, str(dst / f.name))
        elif f.name == "config.json":
            cfg = json.loads(f.read_text())
            cfg["torch_dtype"] = "bfloat16"
            (dst / f.name).write_text(json.dumps(cfg, indent=1))
        elif f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def requests(n: int, vocab: int, max_tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(3, vocab) for _ in range(rng.randint(40, 160))]
        sampling = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.8, seed=i)
        out.append(dict(prompt_ids=ids, max_tokens=max_tokens, ignore_eos=True, **sampling))
    return out


def run_set(args, kv_pages: int, extra: list[str], reqs: list[dict]) -> dict:
    backend = ["--backend", "cuda"] if args.device.startswith("cuda") else []
    flags = ["--model", str(args.model), "--device", args.device, *backend, "--kv-pages", str(kv_pages),
             "--max-seq-len", "384", "--max-batch", "16", "--max-batch-tokens", "256", "--prefill-chunk", "128",
             "--standbys", "0", "--log-level", "WARNING", *extra]
    with SidecarProcess(flags) as sc:
        sc.wait_steady(standbys=0, timeout=600)
        with sc.new_client(timeout=300) as client:
            results = wait_all([client.generate(**r) for r in reqs])
    return {"kv_pages": kv_pages, "flags": extra,
            "tokens": [r.token_ids for r in results],
            "finished": sum(r.finish_reason is not None for r in results),
            "preemptions": sum(r.preemptions for r in results),
            "requests_preempted": sum(r.preemptions > 0 for r in results)}


def run(args) -> dict:
    vocab = int(json.loads((args.model / "config.json").read_text())["vocab_size"])
    reqs = requests(args.requests, vocab, args.max_tokens, args.seed)
    modes = [("exact", ["--exact-prefill"])] + ([("no_exact_prefill", ["--no-exact-prefill"])] if args.control else [])
    out = {}
    for name, extra in modes:
        ref = run_set(args, args.reference_pages, extra, reqs)
        small = run_set(args, args.kv_pages, extra, reqs)
        differing = [i for i, (a, b) in enumerate(zip(small["tokens"], ref["tokens"])) if a != b]
        out[name] = {
            "reference": {k: v for k, v in ref.items() if k != "tokens"},
            "small_pool": {k: v for k, v in small.items() if k != "tokens"},
            "lost": len(reqs) - small["finished"],
            "identical": not differing and small["finished"] == len(reqs),
            "differing_requests": differing,
            "first_difference": [next((j for j, (x, y) in enumerate(zip(small["tokens"][i], ref["tokens"][i]))
                                       if x != y), None) for i in differing],
        }
        print(json.dumps({name: out[name]}), flush=True)
    return {"what": "preemption under a small KV pool, recompute vs an uninterrupted run (tools/probe_exact_recompute.py)",
            "command": " ".join([os.path.basename(sys.executable), "-m", "tools.probe_exact_recompute", *sys.argv[1:]]),
            "host": platform.node(), "model": str(args.model), "requests": args.requests,
            "max_tokens": args.max_tokens, **out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--make-bf16", type=Path, default=None, help="write the bf16 tiny model here and exit")
    p.add_argument("--model", type=Path)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--kv-pages", type=int, default=48, help="the small pool (pages of 16 tokens)")
    p.add_argument("--reference-pages", type=int, default=1024)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--control", action="store_true", help="also run both without --exact-prefill")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.make_bf16:
        print(make_bf16(args.make_bf16))
        return 0
    if args.model is None:
        p.error("--model is required (or --make-bf16)")
    result = run(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    ok = result["exact"]["identical"] and result["exact"]["small_pool"]["preemptions"] > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
